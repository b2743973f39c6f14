"""SSE-KMS with S3 Bucket Keys on every write of the store and of the node's stage: moto server behind the
fault proxy, whose request record shows the headers each write carried (``AWSFaultProxy.s3_kms_writes``),
through real boto3 clients and the stage's own signed requests."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from prefect_sgpu.launch import ec2_stage
from prefect_sgpu.store.s3 import S3Store
from support.aws_fault_proxy import AWSFaultProxy
from support.aws_fixtures import MotoAWS


@pytest.fixture
def kms_bucket(aws_env: MotoAWS) -> tuple[str, str]:
    """A bucket with no default encryption (what a write asks for is what it gets), and a KMS key."""
    bucket = f"sgpu-bk-{uuid.uuid4().hex[:12]}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    key = aws_env.client("kms").create_key(Description="sgpu store")["KeyMetadata"]["KeyId"]
    return bucket, key


def test_every_kms_write_of_the_store_asks_for_a_bucket_key(aws_env: MotoAWS, aws_faults: AWSFaultProxy,
                                                            kms_bucket: tuple[str, str], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import prefect_sgpu.store.s3 as store_s3

    bucket, key = kms_bucket
    monkeypatch.setattr(store_s3, "MULTIPART_BYTES", 5 * 1024 * 1024)  # S3's smallest part
    store = S3Store(f"s3://{bucket}/jobs", session=aws_env.session(), endpoint_url=aws_env.endpoint_url,
                    kms_key_id=key)
    store.put("run", "payload.bin", b"small")                              # put_object
    store.put("run", "results/rank-00000.bin", b"r" * (6 * 1024 * 1024))  # boto3's transfer, in parts
    store.append("run", "logs/rank-00000.log", 0, b"line\n")
    store.seal_appended("run", "logs/rank-00000.log", b"line\n")
    objects = store.objects()
    objects.put("checkpoints/step-1/COMPLETE", b"{}")
    shard = tmp_path / "shard.bin"
    shard.write_bytes(b"s" * 1024)
    objects.upload("checkpoints/step-1/rank-0.bin", shard)                 # boto3's transfer, one PUT

    writes = aws_faults.s3_kms_writes()
    assert len(writes) == 6, writes
    assert [path for path, asked in writes if not asked] == [], "every SSE-KMS write asks for a Bucket Key"
    s3 = aws_env.client("s3")
    for name in ("run/payload.bin", "run/logs/rank-00000.log", "checkpoints/step-1/COMPLETE",
                 "checkpoints/step-1/rank-0.bin"):
        head = s3.head_object(Bucket=bucket, Key=f"jobs/{name}")
        assert (head["ServerSideEncryption"], head["SSEKMSKeyId"].endswith(key), head.get("BucketKeyEnabled")) == \
            ("aws:kms", True, True), name


def test_a_store_without_a_kms_key_writes_sse_s3_and_no_bucket_key(aws_env: MotoAWS, aws_faults: AWSFaultProxy,
                                                                   kms_bucket: tuple[str, str]) -> None:
    bucket, _ = kms_bucket
    store = S3Store(f"s3://{bucket}/jobs", session=aws_env.session(), endpoint_url=aws_env.endpoint_url)
    store.put("run", "payload.bin", b"small")
    assert aws_faults.s3_kms_writes() == []
    assert "BucketKeyEnabled" not in store.write_args()
    head = aws_env.client("s3").head_object(Bucket=bucket, Key="jobs/run/payload.bin")
    assert head["ServerSideEncryption"] == "AES256"


def test_the_stage_writes_sse_kms_with_a_bucket_key_under_the_stores_key(aws_env: MotoAWS, aws_faults: AWSFaultProxy,
                                                                        kms_bucket: tuple[str, str],
                                                                        virtual_clock: Any) -> None:
    bucket, key = kms_bucket
    transport = ec2_stage.S3StageTransport.from_args(
        f"s3://{bucket}/jobs", [f"--region={aws_env.region}", f"--endpoint-url={aws_env.endpoint_url}",
                                f"--store-kms-key={key}"])
    transport.put("r1/setup/pack-i-1.json", b"{}", content_type="application/json")
    upload = transport.start_upload(".environments/packages-x/pack.tar.zst")
    part = transport.put_part(".environments/packages-x/pack.tar.zst", upload, 1, b"p" * 1024)
    transport.finish_upload(".environments/packages-x/pack.tar.zst", upload, [part])

    writes = aws_faults.s3_kms_writes()
    assert [(path.rsplit("/", 1)[-1], asked) for path, asked in writes] == \
        [("pack-i-1.json", True), ("pack.tar.zst", True)], "the PUT and the upload's start; never a part"
    head = aws_env.client("s3").head_object(Bucket=bucket, Key="jobs/r1/setup/pack-i-1.json")
    assert (head["ServerSideEncryption"], head.get("BucketKeyEnabled")) == ("aws:kms", True)
    assert aws_env.client("s3").get_object(Bucket=bucket, Key="jobs/.environments/packages-x/pack.tar.zst")[
        "Body"].read() == b"p" * 1024


def test_the_user_data_hands_the_stores_kms_key_to_the_stage() -> None:
    from prefect_sgpu.environment import ship

    _, runs = ship.stage_lines("python3", "a" * 64, "b" * 64, "s3://b/jobs", "r1", "us-east-1", None, None,
                               transport="ec2_stage", kms_key_id="1234abcd")
    stage_args = runs.split(" -- ")[0] if " -- " in runs else runs
    assert "--store-kms-key=1234abcd" in stage_args
    _, plain = ship.stage_lines("python3", "a" * 64, "b" * 64, "s3://b/jobs", "r1", "us-east-1", None, None,
                                transport="ec2_stage")
    assert "--store-kms-key" not in plain
