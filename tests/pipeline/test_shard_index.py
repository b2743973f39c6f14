"""A shard set's index.json names files; a name that leads outside the set or the cache is refused.

Whoever writes the data location writes ``index.json``. Mosaic Streaming joins each shard
file name of it onto its local folder and downloads, decompresses or reads the file there.
Each exploit below plants a name that leads out (``../../x``, an absolute ``/tmp/.../x``, a
symlink) and checks that the loader raises ``SGPUConfigError`` before any shard is read,
and that no file appeared outside the set and its cache. The S3 case runs against a moto
server on loopback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import pytest

from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.pipeline import shard_index
from prefect_sgpu.pipeline.mds import write_mds
from prefect_sgpu.pipeline.streaming import streaming_dataset

ROWS = 40


def _rows() -> Iterator[dict]:
    return ({"id": i, "label": f"item-{i}"} for i in range(ROWS))


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def _rename_shard(index_path: Path, key: str, name: str) -> None:
    index = json.loads(index_path.read_text())
    index["shards"][0][key]["basename"] = name
    index_path.write_text(json.dumps(index))


def _read_all(dataset: Any) -> None:
    """What a training loop does next; only today's unchecked loaders ever get here."""
    for _ in dataset:
        pass


# --- the rule for one name ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["shard.00000.mds", "shard.00000.mds.zstd", "part-1/shard.00000.mds",
                                  "a/b/shard.00003.json"])
def test_plain_relative_names_are_allowed(name: str, tmp_path: Path) -> None:
    assert shard_index.name_problem(name) is None
    shard_index.check_name(name, tmp_path, "shards[0].raw_data.basename")


@pytest.mark.parametrize("name", ["", "/etc/cron.d/x", "../x", "a/../../x", "a//b", "./x", "a/.", "x/",
                                  "a\\..\\x", "x\x00y", None, 7])
def test_names_that_are_not_plain_and_relative_are_refused(name: Any, tmp_path: Path) -> None:
    assert shard_index.name_problem(name) is not None
    with pytest.raises(SGPUConfigError, match=r"raw_data\.basename.*plain relative file name") as err:
        shard_index.check_name(name, tmp_path, "shards[0].raw_data.basename")
    assert err.value.value == name and err.value.field == "shards[0].raw_data.basename"


def test_an_index_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    for index in ({"version": 2}, {"shards": ["x"]}, {"shards": [{"raw_data": "shard.00000.mds"}]}, []):
        with pytest.raises(SGPUConfigError, match="shards"):
            shard_index.check_index(index, tmp_path, "index.json")


# --- local sets: decompressed into a cache, or read in place --------------------------------


@pytest.mark.parametrize("escape", ["relative", "absolute"])
def test_compressed_set_cannot_decompress_outside_its_cache(escape: str, tmp_path: Path) -> None:
    """The probe: the decompressed name of shard 0 is ``../../x`` or an absolute /tmp path."""
    data = tmp_path / "data"
    write_mds(_rows(), data / "set", size_limit="1kb", progress=False)
    cache = tmp_path / "caches" / "job" / "node-0"
    target = tmp_path / "caches" / "escaped.mds" if escape == "relative" else tmp_path / "abs" / "x"
    target.parent.mkdir(parents=True, exist_ok=True)
    bad = "../../escaped.mds" if escape == "relative" else str(target)
    _rename_shard(data / "set" / "index.json", "raw_data", bad)
    written = _files(data)

    with pytest.raises(SGPUConfigError, match=r"shards\[0\]\.raw_data\.basename") as err:
        _read_all(streaming_dataset(data / "set", batch_size=4, shuffle=False, local=cache))
    assert err.value.value == bad
    assert not target.exists(), "a shard was written outside the cache"
    assert _files(data) == written
    assert not cache.exists() or not _files(cache), "nothing is fetched from a set whose index is refused"


def test_in_place_set_cannot_read_outside_its_folder(tmp_path: Path) -> None:
    """An uncompressed set is read in place: ``../`` would read whatever file it names."""
    data = tmp_path / "set"
    write_mds(_rows(), data, compression=None, size_limit="1kb", progress=False)
    outside = tmp_path / "outside.mds"
    outside.write_bytes((data / "shard.00000.mds").read_bytes())
    _rename_shard(data / "index.json", "raw_data", "../outside.mds")

    with pytest.raises(SGPUConfigError, match=r"shards\[0\]\.raw_data\.basename='\.\./outside\.mds'"):
        _read_all(streaming_dataset(data, batch_size=4, shuffle=False))


def test_a_shard_that_is_a_symlink_out_of_the_set_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "set"
    write_mds(_rows(), data, compression=None, size_limit="1kb", progress=False)
    outside = tmp_path / "elsewhere.mds"
    (data / "shard.00000.mds").rename(outside)
    (data / "shard.00000.mds").symlink_to(outside)

    with pytest.raises(SGPUConfigError, match="resolves outside the folder"):
        streaming_dataset(data, batch_size=4, shuffle=False)


def test_names_streaming_parsed_are_checked_again(tmp_path: Path) -> None:
    """An index swapped between the first check and Streaming's own read is still refused."""
    from streaming import StreamingDataset

    data = tmp_path / "set"
    write_mds(_rows(), data, compression=None, size_limit="1kb", progress=False)
    _rename_shard(data / "index.json", "raw_data", "../swapped.mds")
    dataset = StreamingDataset(local=str(data), batch_size=4, shuffle=False)  # Streaming alone opens it
    with pytest.raises(SGPUConfigError, match=r"shards\[0\] raw file='\.\./swapped\.mds'"):
        shard_index.check_dataset(dataset)


def test_a_good_local_set_still_opens(tmp_path: Path) -> None:
    write_mds(_rows(), tmp_path / "set", size_limit="1kb", progress=False)
    dataset = streaming_dataset(tmp_path / "set", batch_size=4, shuffle=False, local=tmp_path / "cache")
    assert sorted(int(sample["id"]) for sample in dataset) == list(range(ROWS))
    assert (tmp_path / "cache" / "index.json").read_bytes() == (tmp_path / "set" / "index.json").read_bytes()


# --- S3: the index is fetched and checked before Streaming fetches anything -----------------


@pytest.fixture
def s3(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A bucket on the session's moto server; Streaming and write_mds find it through the env."""
    import boto3

    env = {"S3_ENDPOINT_URL": moto_server, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    client = boto3.client("s3", endpoint_url=moto_server)
    try:
        client.create_bucket(Bucket="sgpu-index")
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    return client


def test_s3_set_cannot_write_outside_its_cache(s3: Any, tmp_path: Path) -> None:
    """The probe on S3: shard 0 is named ``../../x`` and an object waits at that very key."""
    uri = "s3://sgpu-index/sets/evil"
    write_mds(_rows(), uri, compression=None, size_limit="1kb", progress=False)
    index = json.loads(s3.get_object(Bucket="sgpu-index", Key="sets/evil/index.json")["Body"].read())
    shard = s3.get_object(Bucket="sgpu-index", Key="sets/evil/" + index["shards"][0]["raw_data"]["basename"])
    s3.put_object(Bucket="sgpu-index", Key="sets/evil/../../escaped.mds", Body=shard["Body"].read())
    index["shards"][0]["raw_data"]["basename"] = "../../escaped.mds"
    s3.put_object(Bucket="sgpu-index", Key="sets/evil/index.json", Body=json.dumps(index).encode())
    cache = tmp_path / "caches" / "job" / "node-0"

    with pytest.raises(SGPUConfigError, match=r"shards\[0\]\.raw_data\.basename='\.\./\.\./escaped\.mds'"):
        _read_all(streaming_dataset(uri, batch_size=4, shuffle=False, local=cache))
    assert _files(tmp_path) == set(), "nothing was fetched: not the index, not a shard"


def test_a_bad_index_already_in_the_cache_is_refused(s3: Any, tmp_path: Path) -> None:
    """Another rank of the node placed the index first: it is checked all the same."""
    uri = "s3://sgpu-index/sets/cached"
    write_mds(_rows(), uri, compression=None, size_limit="1kb", progress=False)
    index = json.loads(s3.get_object(Bucket="sgpu-index", Key="sets/cached/index.json")["Body"].read())
    index["shards"][0]["raw_data"]["basename"] = str(tmp_path / "abs" / "x")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "index.json").write_text(json.dumps(index))

    with pytest.raises(SGPUConfigError, match="absolute"):
        streaming_dataset(uri, batch_size=4, shuffle=False, local=cache)
    assert os.listdir(cache) == ["index.json"]


def test_a_good_s3_set_opens_with_the_checked_index(s3: Any, tmp_path: Path) -> None:
    uri = "s3://sgpu-index/sets/good"
    write_mds(_rows(), uri, compression=None, size_limit="1kb", progress=False)
    cache = tmp_path / "cache"
    dataset = streaming_dataset(uri, batch_size=4, shuffle=False, local=cache)
    assert len(dataset) == ROWS
    assert os.listdir(cache) == ["index.json"], "only the index is fetched before the first sample"
    remote = s3.get_object(Bucket="sgpu-index", Key="sets/good/index.json")["Body"].read()
    assert (cache / "index.json").read_bytes() == remote
    assert sorted(int(sample["id"]) for sample in dataset) == list(range(ROWS))
