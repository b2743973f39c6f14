"""Reading MDS shard sets inside ranks: partition per rank, mid-epoch resume, S3 with a per-job cache.

The jobs are real torch elastic jobs on the local compute (each simulated node has its
own /dev/shm, as streaming needs); the S3 endpoint is a moto server on loopback.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest

from prefect_sgpu import distributed
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.pipeline import streaming as sgpu_streaming
from prefect_sgpu.pipeline.mds import write_mds

ROWS = 480


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """480 rows in several small zstd shards; ``id`` is the row number."""
    import numpy as np

    out = tmp_path_factory.mktemp("mds") / "ids"
    rows = ({"id": i, "x": np.full(4, i, dtype=np.float32)} for i in range(ROWS))
    return write_mds(rows, out, size_limit="4kb", progress=False)


# --- where data is cached -----------------------------------------------------------


def test_cache_dir_is_per_job_and_node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SGPU_JOB_DIR", str(tmp_path / "job"))
    monkeypatch.setenv("GROUP_RANK", "1")
    first = sgpu_streaming.cache_dir("s3://bucket/sets/a")
    assert first.parent == tmp_path / "job" / "mds-cache" / "node-1"
    assert sgpu_streaming.cache_dir("s3://bucket/sets/b") != first

    monkeypatch.delenv("SGPU_JOB_DIR")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-123")
    outside = sgpu_streaming.cache_dir("s3://bucket/sets/a")
    assert "run-123" in outside.parts and outside.parent.name == "node-1"


def test_bad_uri_and_batch_size_fail_before_reading(tmp_path: Path, shard_set: Any) -> None:
    with pytest.raises(SGPUConfigError, match="index.json"):
        sgpu_streaming.streaming_dataset(tmp_path, batch_size=8)
    with pytest.raises(SGPUConfigError, match="batch_size"):
        sgpu_streaming.streaming_dataset(shard_set, batch_size=0)


# --- every sample once per epoch, across 2 nodes x 2 ranks ------------------------------


@distributed(gpus=4, nodes=2, mlflow=False)
def read_epochs(uri: str, batch_size: int, epochs: int) -> dict:
    import os
    from pathlib import Path

    from prefect_sgpu import runtime
    from prefect_sgpu.pipeline.streaming import cache_dir, streaming_loader

    runtime.init_process_group()
    loader = streaming_loader(uri, batch_size, seed=7)
    seen = [[int(i) for batch in loader for i in batch["id"]] for _ in range(epochs)]
    cache = cache_dir(str(Path(uri).absolute()))
    return {"rank": runtime.rank(), "node": runtime.node_rank(), "epochs": seen, "cache": str(cache),
            "cached": sorted(os.listdir(cache)) if cache.is_dir() else []}


@pytest.mark.e2e
def test_two_nodes_read_each_sample_once_per_epoch(shard_set: Any) -> None:
    written = sorted(os.listdir(shard_set.uri))
    results = read_epochs.distributed(shard_set.uri, batch_size=8, epochs=2)
    # zstd shards are decompressed in each node's own cache, never beside the set: two nodes
    # on one filesystem decompressing the same shard in place raced on its temporary file
    assert sorted(os.listdir(shard_set.uri)) == written
    caches = {r["node"]: r["cache"] for r in results}
    assert len(set(caches.values())) == 2 and all(f"node-{n}" in c for n, c in caches.items())
    assert all(any(name.endswith(".mds") for name in r["cached"]) for r in results), results[0]["cached"]
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert [r["node"] for r in results] == [0, 0, 1, 1]
    for epoch in range(2):
        parts = [r["epochs"][epoch] for r in results]
        assert all(len(p) == ROWS // 4 for p in parts), [len(p) for p in parts]
        together = [i for p in parts for i in p]
        assert sorted(together) == list(range(ROWS)), f"epoch {epoch}: a sample was repeated or lost"
    first, second = ([i for r in results for i in r["epochs"][e]] for e in range(2))
    assert first != second, "shuffle=True gives each epoch a new order"


# --- mid-epoch resume -------------------------------------------------------------------


@distributed(gpus=2, nodes=1, mlflow=False)
def read_with_resume(uri: str, batch_size: int, stop_after: int) -> dict:
    """Read ``stop_after`` batches, take rank 0's state, start a new loader from it, finish the epoch."""
    import gc

    import torch.distributed as dist

    from prefect_sgpu import runtime
    from prefect_sgpu.pipeline.streaming import streaming_loader

    runtime.init_process_group()
    loader = streaming_loader(uri, batch_size, seed=3)
    before: list[int] = []
    for step, batch in enumerate(loader):
        before += [int(i) for i in batch["id"]]
        if step + 1 == stop_after:
            break
    state = [loader.state_dict() if runtime.is_rank_zero() else None]
    dist.broadcast_object_list(state, src=0)  # as a checkpoint would carry it to every rank
    del loader
    gc.collect()

    resumed = streaming_loader(uri, batch_size, seed=3, state=state[0])
    after = [int(i) for batch in resumed for i in batch["id"]]
    return {"before": before, "after": after, "state": state[0]}


@pytest.mark.e2e
def test_mid_epoch_resume_loses_and_repeats_nothing(shard_set: Any) -> None:
    results = read_with_resume.distributed(shard_set.uri, batch_size=8, stop_after=5)
    assert results[0]["state"]["sample_in_epoch"] == 5 * 8 * 2
    before = [i for r in results for i in r["before"]]
    after = [i for r in results for i in r["after"]]
    assert len(before) == 5 * 8 * 2
    assert not set(before) & set(after), "a sample seen before the stop was served again"
    assert sorted(before + after) == list(range(ROWS)), "the resumed epoch lost samples"


# --- S3: written by write_mds, read through a per-job cache -------------------------------


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on loopback, with throwaway credentials in the environment."""
    import socket

    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    os.environ.update(S3_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="sgpu-data")
        yield endpoint
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


@distributed(gpus=2, nodes=1, mlflow=False)
def read_remote(uri: str, batch_size: int) -> dict:
    import os

    from prefect_sgpu import runtime
    from prefect_sgpu.pipeline.streaming import cache_dir, streaming_loader

    runtime.init_process_group()
    ids = [int(i) for batch in streaming_loader(uri, batch_size) for i in batch["id"]]
    cache = cache_dir(uri)
    return {"ids": ids, "cache": str(cache), "cached": sorted(os.listdir(cache)),
            "job_dir": os.environ["SGPU_JOB_DIR"]}


@pytest.mark.e2e
def test_s3_shard_set_is_written_reused_and_read_through_a_job_cache(s3_endpoint: str) -> None:
    import boto3

    rows = [{"id": i, "label": f"item-{i}"} for i in range(200)]
    uri = "s3://sgpu-data/sets/labels"
    first = write_mds(rows, uri, size_limit="2kb", progress=False)
    assert first.uri == uri and first.rows == 200 and first.shards > 1
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="sgpu-data", Prefix="sets/labels/")["Contents"]}
    assert {"sets/labels/index.json", "sets/labels/.sgpu-complete.json"} <= keys
    stamp = s3.head_object(Bucket="sgpu-data", Key="sets/labels/index.json")["LastModified"]
    assert write_mds(rows, uri, size_limit="2kb", progress=False) == first
    assert s3.head_object(Bucket="sgpu-data", Key="sets/labels/index.json")["LastModified"] == stamp

    env = {k: os.environ[k] for k in ("S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                      "AWS_DEFAULT_REGION")}
    results = read_remote.with_options(env=env).distributed(uri, batch_size=10)
    assert sorted(i for r in results for i in r["ids"]) == list(range(200))
    cache = Path(results[0]["cache"])
    assert cache.is_relative_to(Path(results[0]["job_dir"]) / "mds-cache" / "node-0")
    assert "index.json" in results[0]["cached"]


def test_failed_s3_conversion_leaves_no_index_or_marker(s3_endpoint: str) -> None:
    import boto3

    def rows() -> Iterator[dict]:
        for i in range(300):
            yield {"id": i, "label": f"item-{i}" if i != 250 else 250}

    uri = "s3://sgpu-data/sets/broken"
    with pytest.raises(SGPUConfigError, match=r"'label' at row 250"):
        write_mds(rows(), uri, size_limit="1kb", progress=False)
    listed = boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket="sgpu-data", Prefix="sets/broken/")
    keys = {o["Key"] for o in listed.get("Contents", [])}
    assert not {"sets/broken/index.json", "sets/broken/.sgpu-complete.json"} & keys
