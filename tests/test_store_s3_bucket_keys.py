"""SSE-KMS with S3 Bucket Keys on every write of the store (driver, nodes, ranks): moto server behind the
fault proxy, whose request record shows the headers each write carried (``AWSFaultProxy.s3_kms_writes``),
through real boto3 clients; and the node stage's writes under the bucket's default."""

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


def test_the_stages_writes_take_the_buckets_default_encryption_with_its_bucket_key(
        aws_env: MotoAWS, aws_faults: AWSFaultProxy, kms_bucket: tuple[str, str], virtual_clock: Any) -> None:
    """The stage names no encryption (its code travels in the user-data, which has no room to spare): a
    bucket that ``prefect-sgpu setup aws`` made encrypts its writes under the store's key with a Bucket Key."""
    from prefect_sgpu.compute.ec2 import setup

    bucket, key = kms_bucket
    setup.AWSSetup(f"s3://{bucket}/jobs", aws_env.region, session=aws_env.session(), endpoint_url=aws_env.endpoint_url,
                   kms_key_id=key).bucket_steps()
    transport = ec2_stage.S3StageTransport(f"s3://{bucket}/jobs", aws_env.region, aws_env.endpoint_url)
    transport.put("r1/setup/pack-i-1.json", b"{}", content_type="application/json")
    assert aws_faults.s3_kms_writes() == []  # asked nothing: the bucket's default applies
    head = aws_env.client("s3").head_object(Bucket=bucket, Key="jobs/r1/setup/pack-i-1.json")
    assert (head["ServerSideEncryption"], head["SSEKMSKeyId"].endswith(key), head.get("BucketKeyEnabled")) == \
        ("aws:kms", True, True)
