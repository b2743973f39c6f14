"""The S3 job store against a moto server, through real boto3 clients (and the fault proxy)."""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest

from support.aws_fixtures import MotoAWS
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.observe.logs import LogTailer
from prefect_sgpu.store.s3 import S3Store


@pytest.fixture
def store(aws_env: MotoAWS) -> S3Store:
    bucket = f"sgpu-store-{uuid.uuid4().hex[:12]}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    return S3Store(f"s3://{bucket}/team/jobs/", session=aws_env.session(), endpoint_url=aws_env.endpoint_url)


def test_keys_uris_and_round_trip(store: S3Store) -> None:
    assert store.root_uri == f"s3://{store.bucket}/team/jobs"
    assert store.uri("run-1", "logs") == f"s3://{store.bucket}/team/jobs/run-1/logs"
    store.put("run-1", "payload.bin", b"\x00payload")
    store.put("run-1", "logs/rank-00001.log", b"one\n")
    store.put("run-1", "logs/rank-00000.log", b"zero\n")
    store.put("run-1", "logs/.partial", b"hidden")
    store.put("run-1", "checkpoints/step-1/model.pt", b"deep")
    store.put("run-2", "logs/rank-00000.log", b"another job\n")
    assert store.get("run-1", "payload.bin") == b"\x00payload"
    assert store.get("run-1", "missing") is None
    assert store.list("run-1", "logs") == ["logs/rank-00000.log", "logs/rank-00001.log"]
    assert store.list("run-1", "checkpoints") == [], "only direct children, as the local store lists"
    assert store.list("run-1", "results") == []
    store.put("run-1", "payload.bin", b"")
    assert store.get("run-1", "payload.bin") == b""


def test_delete_one_key_or_a_folder(store: S3Store) -> None:
    for rank in range(3):
        store.put("run", f"results/rank-{rank:05d}.bin", b"r")
    store.put("run", "payload.bin", b"p")
    store.put("run", "logs/rank-00000.log", b"kept\n")
    store.delete("run", "results")
    store.delete("run", "payload.bin")
    store.delete("run", "never-written")
    assert store.list("run", "results") == []
    assert store.get("run", "payload.bin") is None
    assert store.get("run", "logs/rank-00000.log") == b"kept\n"


def test_read_from_is_a_ranged_read(store: S3Store, aws_faults: Any) -> None:
    store.put("run", "logs/rank-00000.log", b"first\nsecond\n")
    assert store.read_from("run", "logs/rank-00000.log", 6) == b"second\n"
    assert store.read_from("run", "logs/rank-00000.log", 13) == b"", "nothing new past the end"
    assert store.read_from("run", "logs/rank-00000.log", 99) == b""
    assert store.read_from("run", "logs/missing.log", 0) == b""


def test_log_tailer_follows_a_growing_log(store: S3Store) -> None:
    lines: list[tuple[int, int, str]] = []
    tailer = LogTailer(store, "run", procs_per_node=2, sink=lambda r, n, t: lines.append((r, n, t)))
    store.put("run", "logs/rank-00003.log", b"step 1\nstep 2 partial")
    tailer.poll()
    assert lines == [(3, 1, "step 1")]
    store.put("run", "logs/rank-00003.log", b"step 1\nstep 2 partial done\nstep 3")  # re-uploaded whole
    tailer.poll()
    tailer.poll(final=True)
    assert [t for _, _, t in lines] == ["step 1", "step 2 partial done", "step 3"]


def test_throttled_requests_are_retried_by_botocore(store: S3Store, aws_faults: Any) -> None:
    aws_faults.fail("", "SlowDown", status=503, times=2)  # S3 REST calls: the next two answer 503
    store.put("run", "heartbeat", b"1.0")
    assert store.get("run", "heartbeat") == b"1.0"
    rest = [r for r in aws_faults.requests if r.service == "rest"]
    assert [r.status for r in rest[:3]] == [503, 503, 200]


def test_adaptive_retry_mode_and_bad_settings(aws_env: MotoAWS) -> None:
    store = S3Store("s3://some-bucket", endpoint_url=aws_env.endpoint_url, retry_mode="adaptive")
    assert store.client.meta.config.retries["mode"] == "adaptive"
    assert store.uri("r", "k") == "s3://some-bucket/r/k"
    with pytest.raises(SGPUConfigError, match="store_uri"):
        S3Store("some-bucket/prefix")
    with pytest.raises(SGPUConfigError, match="retry_mode"):
        S3Store("s3://some-bucket", retry_mode="sometimes")


def test_store_and_provisioner_build_clients_in_one_place(aws_env: MotoAWS) -> None:
    """Both go through prefect_sgpu.aws.client: botocore retries and the same timeouts."""
    from prefect_sgpu import aws
    from prefect_sgpu.compute.ec2.instances import EC2Provisioner
    from prefect_sgpu.compute.ec2.settings import EC2Settings

    store = S3Store("s3://any-bucket/jobs", session=aws_env.session(), endpoint_url=aws_env.endpoint_url)
    ec2 = EC2Provisioner(EC2Settings(endpoint_url=aws_env.endpoint_url, max_attempts=3),
                         session=aws_env.session()).client("ec2")
    for client, attempts in ((store.client, aws.DEFAULT_MAX_ATTEMPTS), (ec2, 3)):
        config = client.meta.config
        assert config.retries["mode"] == "standard"
        assert config.retries["total_max_attempts"] == attempts + 1  # botocore counts the first call too
        assert (config.connect_timeout, config.read_timeout) == (aws.CONNECT_TIMEOUT_S, aws.READ_TIMEOUT_S)
        assert aws.USER_AGENT in (config.user_agent_extra or "")


def test_new_sessions_share_one_parsed_service_model_and_use_the_environments_credentials(aws_env: MotoAWS) -> None:
    """The driver, its sweeper and each compute open sessions of their own; EC2's model is parsed once."""
    from prefect_sgpu import aws

    first, second = aws.new_session(aws_env.region), aws.new_session(aws_env.region)
    assert first is not second and first._session is not second._session, "each caller has its own session"
    a = aws.client("ec2", first, aws_env.region, aws_env.endpoint_url)
    b = aws.client("ec2", second, aws_env.region, aws_env.endpoint_url)
    assert a.meta.service_model.shape_for("RunInstancesRequest") is not None
    loader = first._session.get_component("data_loader")
    assert loader is second._session.get_component("data_loader"), "one data loader per process"
    assert (loader.load_service_model("ec2", "service-2")
            is loader.load_service_model("ec2", "service-2")), "the model is parsed once and kept"
    # the sessions still read the environment's keys (the instance profile on a node)
    assert first.get_credentials().access_key == os.environ["AWS_ACCESS_KEY_ID"]
    assert b.describe_regions()["Regions"], "a client of a later session calls the endpoint as the first does"
    assert a.describe_regions()["Regions"]


def test_an_appended_object_reads_as_one_until_sealed_and_ships_each_byte_once(store: S3Store) -> None:
    key = "logs/rank-00000.log"
    log = b""
    for i in range(5):
        piece = f"line {i}\n".encode()
        store.append("run", key, len(log), piece)
        log += piece
    assert store.list("run", "logs") == [key], "listed under its own name, its pieces not enumerated"
    assert store.get("run", key) == log
    assert store.read_from("run", key, 0) == log
    assert store.read_from("run", key, len(b"line 0\n")) == log[len(b"line 0\n"):], "from a piece's start"
    assert store.read_from("run", key, 3) == log[3:], "from inside a piece"
    assert store.read_from("run", key, len(log)) == b"", "nothing new past the end"

    lines: list[str] = []
    tailer = LogTailer(store, "run", procs_per_node=1, sink=lambda r, n, t: lines.append(t))
    tailer.poll()
    store.append("run", key, len(log), b"line 5\nline 6 part")
    log += b"line 5\nline 6 part"
    tailer.poll()
    store.seal_appended("run", key, log + b"ial\n")
    tailer.poll(final=True)
    assert lines == [f"line {i}" for i in range(6)] + ["line 6 partial"], "the tailer crosses into the sealed object"

    objects = [o["Key"] for o in store.client.list_objects_v2(Bucket=store.bucket)["Contents"]]
    assert objects == [store._key("run", key)], "sealing leaves one object"
    store.append("run", "metrics/rank-00000.jsonl", 0, b"{}\n")
    store.delete("run", "metrics/rank-00000.jsonl")
    assert store.get("run", "metrics/rank-00000.jsonl") is None and store.list("run", "metrics") == []


class _SealedWhileReading(S3Store):
    """A store whose writer seals the appended object right after a reader listed its pieces."""

    sealed_with: bytes = b""

    def _parts(self, run_id: str, key: str, from_offset: int = 0) -> list[tuple[int, int, str]]:
        listed = super()._parts(run_id, key, from_offset)
        if self.sealed_with:
            self.seal_appended(run_id, key, self.sealed_with)
            self.sealed_with = b""
        return listed


@pytest.mark.parametrize("read", ["get", "read_from"])
def test_a_reader_that_lists_pieces_just_before_they_are_sealed_reads_the_sealed_object(
        aws_env: MotoAWS, store: S3Store, read: str) -> None:
    racing = _SealedWhileReading(store.root_uri, session=aws_env.session(), endpoint_url=aws_env.endpoint_url)
    key = "logs/rank-00001.log"
    racing.append("run", key, 0, b"rank is up\n")
    racing.sealed_with = b"rank is up\nand done\n"
    data = racing.get("run", key) if read == "get" else racing.read_from("run", key, 0)
    assert data == b"rank is up\nand done\n", "the piece it listed was gone: it read the object whole"


def test_a_node_ships_a_growing_log_in_at_most_twice_its_size(store: S3Store, tmp_path: Any) -> None:
    from pathlib import Path

    from prefect_sgpu.launch.bootstrap import NodeBootstrap, NodeIdentity

    class Counting(S3Store):
        sent = 0

        def put(self, run_id: str, key: str, data: bytes) -> None:
            if "/logs/" in f"/{key}":
                Counting.sent += len(data)
            super().put(run_id, key, data)

    counting = Counting(store.root_uri, client=store.client)
    node = NodeBootstrap(counting, "run", NodeIdentity("i-0123456789abcdef0", 0, "10.0.0.5"), Path(tmp_path),
                         heartbeat_ttl=60)
    log = Path(tmp_path) / "run" / "logs" / "rank-00000.log"
    log.parent.mkdir(parents=True)
    with open(log, "ab") as fh:
        for tick in range(60):  # a log that grows by 2 KB between syncs
            fh.write(f"step {tick} ".encode() + b"x" * 2000 + b"\n")
            fh.flush()
            node.sync_up()
    node.sync_up(final=True)  # what waited to be coalesced with later lines goes at the end
    size = log.stat().st_size
    assert Counting.sent == size, "while it runs each byte goes once (a whole upload per sync: ~30x)"
    node.seal_appended()
    assert Counting.sent <= 2 * size
    assert store.get("run", "logs/rank-00000.log") == log.read_bytes()
    assert store.list("run", "logs") == ["logs/rank-00000.log"]


def test_a_large_object_goes_up_in_parts_encrypted_and_reads_back_whole(store: S3Store,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import prefect_sgpu.store.s3 as store_s3

    monkeypatch.setattr(store_s3, "MULTIPART_BYTES", 5 * 1024 * 1024)  # S3's smallest part
    data = bytes(range(256)) * (12 * 1024 * 1024 // 256)  # 12 MB: 3 parts of 5 MB
    store.put("run", "results/rank-00000.bin", data)
    head = store.client.head_object(Bucket=store.bucket, Key=store._key("run", "results/rank-00000.bin"))
    assert head["ETag"].strip('"').endswith("-3"), f"a multipart upload: {head['ETag']}"
    assert head["ServerSideEncryption"] == "AES256", "the store's encryption applies to every part"
    assert store.get("run", "results/rank-00000.bin") == data
    store.put("run", "small.bin", b"x")
    small = store.client.head_object(Bucket=store.bucket, Key=store._key("run", "small.bin"))
    assert "-" not in small["ETag"].strip('"'), "a small object is one PUT"


def test_a_saved_model_on_s3_is_fetched_and_loaded_weights_only_elsewhere(
        store: S3Store, aws_env: MotoAWS, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from prefect_sgpu.checkpoints import ENDPOINT_ENV, URI_ENV
    from prefect_sgpu.pipeline.checkpoint import load_model, save_model

    location = f"s3://{store.bucket}/checkpoints/flow/train"
    monkeypatch.setenv(URI_ENV, location)
    monkeypatch.setenv(ENDPOINT_ENV, aws_env.endpoint_url)
    monkeypatch.setenv("SGPU_JOB_DIR", str(tmp_path / "node"))  # the writing node's stage
    weights = {"w": torch.arange(6.0).reshape(2, 3)}
    uri = save_model(weights)
    assert uri == f"{location}/final/model.pt"
    keys = [o["Key"] for o in store.client.list_objects_v2(Bucket=store.bucket)["Contents"]]
    assert keys == ["checkpoints/flow/train/final/COMPLETE", "checkpoints/flow/train/final/model.pt"]

    monkeypatch.setenv("SGPU_JOB_DIR", str(tmp_path / "reader"))  # another machine: nothing staged
    got = load_model(uri)
    assert torch.equal(got["w"], weights["w"])


@pytest.mark.parametrize("kind", ["s3", "local"])
def test_versions_change_when_an_object_is_written_again_and_only_then(kind: str, store: S3Store,
                                                                       tmp_path: Any) -> None:
    """One listing says which of many documents changed (what the EC2 poll watches liveness by)."""
    from prefect_sgpu.store import LocalStore, Store

    target: Store = store if kind == "s3" else LocalStore(tmp_path)
    target.put("run", "nodes/node-0.alive", b"seq 1")
    target.put("run", "nodes/node-1.alive", b"seq 1")
    target.put("run", "nodes/.hidden", b"x")
    target.append("run", "nodes/node-0.log", 0, b"first piece")
    first = target.versions("run", "nodes")
    assert sorted(first) == ["nodes/node-0.alive", "nodes/node-0.log", "nodes/node-1.alive"]
    assert sorted(first) == target.list("run", "nodes")
    assert target.versions("run", "nodes") == first, "nothing written, nothing changed"
    target.put("run", "nodes/node-1.alive", b"seq 2")
    second = target.versions("run", "nodes")
    assert second["nodes/node-1.alive"] != first["nodes/node-1.alive"]
    assert second["nodes/node-0.alive"] == first["nodes/node-0.alive"]
    assert target.versions("run", "missing") == {}


def test_the_store_of_a_url_is_the_class_its_scheme_names(store: S3Store, tmp_path: Any) -> None:
    """Code that opens storage by URL (checkpoints, shard sets) names no cloud's module."""
    from prefect_sgpu import store as store_mod

    assert store_mod.store_class(store.root_uri) is S3Store and store_mod.is_object_uri(store.root_uri)
    assert store_mod.store_class(str(tmp_path)) is store_mod.LocalStore
    assert not store_mod.is_object_uri(str(tmp_path))
    opened = store_mod.open_store(store.root_uri, session=None, endpoint_url=store.endpoint_url)
    assert isinstance(opened, S3Store) and opened.root_uri == store.root_uri
    assert isinstance(store_mod.open_store(str(tmp_path)), store_mod.LocalStore)
    with pytest.raises(SGPUConfigError, match="s3://"):
        store_mod.store_class("gs://bucket/prefix")
    with pytest.raises(SGPUConfigError, match="object store"):
        store_mod.LocalStore(tmp_path).objects()
    store_mod.register_scheme("s3test", "prefect_sgpu.store.s3:S3Store")
    try:
        assert store_mod.store_class("s3test://bucket") is S3Store
    finally:
        del store_mod.SCHEMES["s3test"]


def test_the_objects_under_a_prefix_are_listed_at_any_depth_sent_fetched_and_deleted(store: S3Store,
                                                                                      tmp_path: Any) -> None:
    objects = store.objects()
    assert objects.uri == store.root_uri
    objects.put("step-1/COMPLETE", b"marker")
    source = tmp_path / "shard.bin"
    source.write_bytes(b"\x01" * 1000)
    objects.upload("step-1/deep/shard.bin", source)
    objects.put("step-2/model.pt", b"m")
    assert sorted(objects.keys()) == ["step-1/COMPLETE", "step-1/deep/shard.bin", "step-2/model.pt"]
    assert objects.keys("step-1") == ["step-1/COMPLETE", "step-1/deep/shard.bin"]
    assert objects.exists("step-1/COMPLETE") and not objects.exists("step-1/missing")
    assert objects.get("step-1/COMPLETE") == b"marker" and objects.get("missing") is None
    objects.download("step-1/deep/shard.bin", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == source.read_bytes()
    objects.delete(["step-2/model.pt"])
    objects.delete(objects.keys("step-1"))
    objects.delete([])
    assert objects.keys() == []
    plain = store.objects(store_settings=False)
    assert plain.write_args == {} and plain.owner_args == {}
    assert store.objects().write_args == store.write_args()
