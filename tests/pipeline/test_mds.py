"""write_mds / prepare_mds: every source kind, type inference, the error matrix, reuse, atomicity,
and Prefect's cache and progress artifact on a real server."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pandas as pd
import pytest

from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.pipeline import mds
from prefect_sgpu.pipeline.mds import MARKER, ShardSet, infer_columns, read_shard_set, write_mds


def read_back(shard_set: ShardSet, tmp_path: Path) -> list[dict[str, Any]]:
    """Every sample of a local set, decompressing shards into a scratch copy."""
    from streaming import LocalDataset
    from streaming.base.compression import decompress

    copy = tmp_path / "read-back"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(shard_set.uri, copy)
    for shard in json.loads((copy / "index.json").read_text())["shards"]:
        if shard.get("zip_data"):
            data = (copy / shard["zip_data"]["basename"]).read_bytes()
            (copy / shard["raw_data"]["basename"]).write_bytes(decompress(shard["compression"], data))
    dataset = LocalDataset(str(copy))
    return [dataset[i] for i in range(len(dataset))]


def frame(n: int = 50) -> pd.DataFrame:
    return pd.DataFrame({"id": np.arange(n), "score": np.linspace(0, 1, n), "name": [f"n{i}" for i in range(n)]})


# --- type inference ----------------------------------------------------------------


def test_infer_columns_maps_python_and_numpy_values_to_mds_encodings() -> None:
    rows = [{"i": 1, "f": 0.5, "s": "a", "b": b"\x00", "a": np.zeros(3, np.float32), "j": {"k": [1]},
             "flag": True, "ni": np.int32(4), "nf": np.float32(1.5)}]
    assert infer_columns(rows) == {"i": "int64", "f": "float64", "s": "str", "b": "bytes", "a": "ndarray",
                                   "j": "json", "flag": "uint8", "ni": "int64", "nf": "float64"}


def test_ints_and_floats_in_one_column_make_a_float_column() -> None:
    assert infer_columns([{"x": 1}, {"x": 2.5}, {"x": 3}]) == {"x": "float64"}


def test_given_columns_select_and_type_the_output(tmp_path: Path) -> None:
    rows = [{"id": i, "text": f"t{i}", "dropped": i} for i in range(10)]
    shard_set = write_mds(rows, tmp_path / "out", columns={"id": "int32", "text": "str"}, progress=False)
    assert shard_set.columns == {"id": "int32", "text": "str"}
    back = read_back(shard_set, tmp_path)
    assert [r["id"] for r in back] == list(range(10)) and set(back[0]) == {"id", "text"}


# --- every source kind --------------------------------------------------------------


def _files(tmp_path: Path) -> dict[str, Path]:
    df = frame()
    paths = {k: tmp_path / f"src.{k}" for k in ("parquet", "csv", "jsonl", "json")}
    df.to_parquet(paths["parquet"])
    df.to_csv(paths["csv"], index=False)
    paths["jsonl"].write_text("\n".join(json.dumps(r) for r in df.to_dict("records")) + "\n\n")
    paths["json"].write_text(json.dumps(df.to_dict("records")))
    structured = np.zeros(50, dtype=[("id", "i8"), ("score", "f8"), ("name", "U8")])
    structured["id"], structured["score"], structured["name"] = df["id"], df["score"], df["name"]
    np.save(tmp_path / "src.npy", structured)
    np.savez(tmp_path / "src.npz", id=df["id"].to_numpy(), score=df["score"].to_numpy(),
             name=df["name"].to_numpy().astype(str))
    return {**paths, "npy": tmp_path / "src.npy", "npz": tmp_path / "src.npz"}


@pytest.mark.parametrize("kind", ["parquet", "csv", "jsonl", "json", "npy", "npz", "dataframe", "columns",
                                  "records", "generator"])
def test_every_source_kind_round_trips(kind: str, tmp_path: Path) -> None:
    df = frame()
    files = _files(tmp_path)
    source: Any = {
        "dataframe": df,
        "columns": {"id": df["id"].to_numpy(), "score": df["score"].to_numpy(), "name": list(df["name"])},
        "records": df.to_dict("records"),
        "generator": (r for r in df.to_dict("records")),
    }.get(kind, files.get(kind))
    shard_set = write_mds(source, tmp_path / "out", compression="zstd", size_limit="1kb", progress=False)
    assert shard_set.rows == 50 and shard_set.shards > 1
    assert shard_set.columns == {"id": "int64", "score": "float64", "name": "str"}
    assert (shard_set.fingerprint is None) == (kind == "generator")
    back = read_back(shard_set, tmp_path)
    assert [int(r["id"]) for r in back] == list(range(50))
    assert [r["name"] for r in back] == list(df["name"])
    assert np.allclose([r["score"] for r in back], df["score"])


def test_ndarray_bytes_and_json_columns_round_trip(tmp_path: Path) -> None:
    rows = [{"v": np.arange(i + 1, dtype=np.int16), "raw": bytes([i]), "meta": {"tags": ["a"] * i}}
            for i in range(5)]
    back = read_back(write_mds(rows, tmp_path / "out", compression=None, progress=False), tmp_path)
    assert [r["v"].tolist() for r in back] == [list(range(i + 1)) for i in range(5)]
    assert back[3]["raw"] == b"\x03" and back[2]["meta"] == {"tags": ["a", "a"]}


# --- the error matrix ------------------------------------------------------------------


def test_empty_sources_are_refused(tmp_path: Path) -> None:
    empty_jsonl = tmp_path / "empty.jsonl"
    empty_jsonl.write_text("\n")
    for source in ([], pd.DataFrame({"a": []}), empty_jsonl, (r for r in [])):
        with pytest.raises(SGPUConfigError, match="at least one row"):
            write_mds(source, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad_row", [7, 150])  # inside and past the rows types are inferred from
def test_mixed_column_types_name_the_column_and_row(bad_row: int, tmp_path: Path) -> None:
    rows = [{"user": i if i != bad_row else f"user-{i}", "item": i} for i in range(200)]
    with pytest.raises(SGPUConfigError, match=rf"column 'user' at row {bad_row}\b") as info:
        write_mds(rows, tmp_path / "out", progress=False)
    assert "'user-" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_only_sources_whose_dtypes_fix_every_row_skip_the_row_checks(tmp_path: Path) -> None:
    """Columns of fixed numpy dtypes cannot change type between rows; anything else is checked
    row by row, so a column that changes type past the inferred rows is still named."""
    from prefect_sgpu.pipeline.sources import typed_columns

    structured = np.zeros(3, dtype=[("a", "i8"), ("b", "f4", (2,))])
    assert typed_columns({"id": np.arange(3), "x": np.zeros((3, 4), np.float32)})
    assert typed_columns(structured)
    assert typed_columns(pd.DataFrame({"id": np.arange(3), "score": np.linspace(0, 1, 3)}))
    assert not typed_columns(frame(3)), "a str column is of object dtype"
    assert not typed_columns({"id": np.arange(3), "tag": np.array(["a", 1, None], dtype=object)})
    assert not typed_columns({"id": [0, 1, 2]}), "a list column may hold anything"
    assert not typed_columns([{"id": 0}]) and not typed_columns({})
    mixed = {"id": np.arange(200), "tag": np.array([1] * 150 + ["x"] * 50, dtype=object)}
    with pytest.raises(SGPUConfigError, match=r"column 'tag' at row 150\b"):
        write_mds(mixed, tmp_path / "out", progress=False)
    typed = {"id": np.arange(200), "x": np.ones((200, 3), np.float32)}
    rows = read_back(write_mds(typed, tmp_path / "typed", progress=False), tmp_path)
    assert [int(r["id"]) for r in rows] == list(range(200)) and rows[-1]["x"].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("value, row, column", [
    (None, 4, "x"),                                 # a null
    (2**70, 4, "x"),                                # does not fit int64
    (np.zeros(2, dtype=bool), 4, "arr"),            # an array dtype MDS has no code for
    (object(), 0, "x"),                             # not encodable at all
])
def test_unencodable_values_name_the_column_and_row(value: Any, row: int, column: str, tmp_path: Path) -> None:
    rows = [{"x": i, "arr": np.zeros(2, np.float32)} for i in range(10)]
    rows[row] = {**rows[row], column: value}
    with pytest.raises(SGPUConfigError, match=rf"column '{column}' at row {row}\b"):
        write_mds(rows, tmp_path / "out", progress=False)


def test_given_encoding_that_cannot_take_a_value_names_it(tmp_path: Path) -> None:
    rows = [{"x": "a"}, {"x": "b"}, {"x": 5}]
    with pytest.raises(SGPUConfigError, match=r"column 'x' at row 2\b.*'str'"):
        write_mds(rows, tmp_path / "out", columns={"x": "str"}, progress=False)


def test_a_row_with_other_columns_is_named(tmp_path: Path) -> None:
    rows = [{"a": 1, "b": 2}] * 4 + [{"a": 1}]
    with pytest.raises(SGPUConfigError, match=r"row 4.*missing \['b'\]"):
        write_mds(rows, tmp_path / "out", progress=False)


@pytest.mark.parametrize("settings, field", [
    ({"columns": {"a": "int65"}}, "columns['a']"),
    ({"compression": "lzma"}, "compression"),
    ({"size_limit": "lots"}, "size_limit"),
    ({"size_limit": 0}, "size_limit"),
])
def test_bad_settings_fail_before_reading(settings: dict, field: str, tmp_path: Path) -> None:
    def never_read() -> Iterator[dict]:
        raise AssertionError("the source was read before the settings were checked")
        yield {}

    with pytest.raises(SGPUConfigError) as info:
        write_mds(never_read(), tmp_path / "out", progress=False, **settings)
    assert info.value.field == field


def test_bad_sources_are_named(tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(SGPUConfigError, match="a file ending in"):
        write_mds(tmp_path / "data.txt", tmp_path / "out")
    with pytest.raises(SGPUConfigError, match="an existing file"):
        write_mds(tmp_path / "missing.parquet", tmp_path / "out")
    with pytest.raises(SGPUConfigError, match="equal length"):
        write_mds({"a": [1, 2], "b": [1]}, tmp_path / "out")
    with pytest.raises(SGPUConfigError, match="source row 1"):
        write_mds([{"a": 1}, 5], tmp_path / "out")
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(SGPUConfigError, match="bad.jsonl line 2"):
        write_mds(bad_jsonl, tmp_path / "out")


def test_a_folder_with_other_files_is_never_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SGPUConfigError, match="notes.txt"):
        write_mds([{"a": 1}], out, progress=False)
    assert (out / "notes.txt").read_text() == "mine"


# --- reuse ---------------------------------------------------------------------------


def _stamps(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def test_same_input_and_settings_reuse_the_set_without_rewriting(tmp_path: Path) -> None:
    source = tmp_path / "src.parquet"
    frame(300).to_parquet(source)
    out = tmp_path / "out"
    first = write_mds(source, out, size_limit="2kb", progress=False)
    stamps = _stamps(out)
    assert MARKER in stamps and "index.json" in stamps and first.shards > 1

    copy = tmp_path / "elsewhere.parquet"  # the same content elsewhere: the same fingerprint
    shutil.copy(source, copy)
    again = write_mds(copy, out, size_limit="2kb", progress=False)
    assert again == first and _stamps(out) == stamps
    assert read_shard_set(out) == first

    changed = write_mds(source, out, size_limit="2kb", compression=None, progress=False)
    assert changed.fingerprint != first.fingerprint and changed.compression is None
    assert _stamps(out) != stamps and not any(n.endswith(".zstd") for n in _stamps(out))


def test_one_shot_iterators_are_converted_every_time(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_mds((r for r in [{"a": 1}]), out, progress=False)
    before = (out / MARKER).stat().st_mtime_ns
    second = write_mds((r for r in [{"a": 1}, {"a": 2}]), out, progress=False)
    assert second.rows == 2 and (out / MARKER).stat().st_mtime_ns != before


def test_shard_set_pickles_small() -> None:
    shard_set = ShardSet(uri="s3://b/p", rows=10, shards=1, columns={"a": "int64"}, fingerprint="f" * 64,
                         compression="zstd")
    data = pickle.dumps(shard_set)
    assert pickle.loads(data) == shard_set and len(data) < 1024 and str(shard_set) == "s3://b/p"


def test_importing_mds_loads_neither_prefect_nor_streaming() -> None:
    code = ("import sys, prefect_sgpu.pipeline.mds, prefect_sgpu.pipeline.streaming;"
            "print(sorted(m for m in ('prefect', 'streaming', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    assert out == "[]"


# --- atomicity -------------------------------------------------------------------------


def _failing_rows(fail_at: int) -> Iterator[dict]:
    for i in range(fail_at + 100):
        if i == fail_at:
            raise RuntimeError(f"source broke at row {i}")
        yield {"id": i, "payload": "x" * 100}


def test_a_conversion_that_fails_midway_leaves_nothing_that_looks_complete(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="row 900"):
        write_mds(_failing_rows(900), out, size_limit="4kb", progress=False)  # several shards were flushed
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [], "no temporary folder is left behind"


def test_a_failed_rewrite_keeps_the_previous_complete_set(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = write_mds([{"id": i, "payload": "x"} for i in range(50)], out, progress=False)
    stamps = _stamps(out)
    with pytest.raises(RuntimeError):
        write_mds(_failing_rows(500), out, size_limit="4kb", progress=False)
    assert _stamps(out) == stamps and read_shard_set(out) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --- Prefect: cache hit on the second run, progress artifact ------------------------------


def test_prepare_mds_second_run_is_cached_and_reports_progress(prefect_server: None, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterTaskRunId, ArtifactFilterType

    monkeypatch.setattr(mds.progress, "ARTIFACT_AFTER_S", 0.0)
    monkeypatch.setattr(mds.progress, "ARTIFACT_EVERY_S", 0.0)
    source = tmp_path / "src.parquet"
    frame(3000).to_parquet(source)

    @flow
    def convert_twice(path: str, out: str) -> list:
        states = []
        for _ in range(2):
            states.append(mds.prepare_mds(path, out, return_state=True))
        return states

    out = tmp_path / "out"
    first, second = convert_twice(str(source), str(out))
    assert first.is_completed() and first.name == "Completed"
    assert second.is_completed() and second.name == "Cached"
    assert second.result() == first.result() and first.result().rows == 3000

    shutil.rmtree(out)  # Prefect remembers a set that is gone: convert again, then hit the cache
    rebuilt, cached = convert_twice(str(source), str(out))
    assert rebuilt.name == "Completed" and read_shard_set(out) == first.result()
    assert cached.name == "Cached" and cached.result() == first.result()

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            type=ArtifactFilterType(any_=["progress"]),
            task_run_id=ArtifactFilterTaskRunId(any_=[first.state_details.task_run_id])))
    assert artifacts and max(float(a.data) for a in artifacts) == 100.0


def test_cache_key_follows_content_settings_and_output(tmp_path: Path) -> None:
    records = [{"a": i} for i in range(5)]
    key = mds.mds_cache_key(None, {"source": records, "output": str(tmp_path / "o")})
    assert key == mds.mds_cache_key(None, {"source": list(records), "output": str(tmp_path / "o")})
    assert key != mds.mds_cache_key(None, {"source": records, "output": str(tmp_path / "p")})
    assert key != mds.mds_cache_key(None, {"source": records, "output": str(tmp_path / "o"), "compression": None})
    assert key != mds.mds_cache_key(None, {"source": records[:4], "output": str(tmp_path / "o")})
    assert mds.mds_cache_key(None, {"source": iter(records), "output": str(tmp_path / "o")}) is None
