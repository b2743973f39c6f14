"""Source data -> Mosaic Streaming (MDS) shards, once per content and settings.

``write_mds`` converts any source :mod:`.sources` reads (parquet, JSONL, CSV, numpy,
a DataFrame, an iterable of dicts) with streaming's ``MDSWriter`` and returns a
:class:`ShardSet`, a small picklable description that GPU tasks take as input.

Why the care around completeness: a training job that starts on a half-written shard
set fails late and expensively, or silently trains on part of the data. So a local
set is written into a temporary sibling folder and renamed into place only when its
index and completion marker are there; an ``s3://`` set is cleared first and gets its
marker last. The marker records the set's fingerprint (source content + settings):
a later call that finds a complete set with the same fingerprint reuses it instead of
converting again, and the Prefect task ``prepare_mds`` adds Prefect's own cache on top.

Importing this module imports neither Prefect nor streaming (ranks unpickle
``ShardSet`` from here); ``prepare_mds`` is built on first access.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from pydantic import BaseModel, ConfigDict

from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.pipeline import sources

logger = logging.getLogger("prefect_sgpu.pipeline.mds")

MARKER = ".sgpu-complete.json"
INDEX = "index.json"
#: rows looked at to infer column types when ``columns`` is not given
INFER_ROWS = 100
#: a Prefect progress artifact is created once a conversion has run this long (seconds)
ARTIFACT_AFTER_S = 2.0
ARTIFACT_EVERY_S = 2.0
_FORMAT_VERSION = 1

#: Python/numpy kind of a value -> the MDS encoding used when inferring
ENCODING_OF_KIND = {
    "int": "int64",
    "float": "float64",
    "bool": "uint8",
    "str": "str",
    "bytes": "bytes",
    "ndarray": "ndarray",
    "json": "json",
}
#: kinds an inferred column accepts in later rows (an int fits a float column)
_ACCEPTS = {
    "int64": {"int", "bool"},
    "float64": {"float", "int", "bool"},
    "uint8": {"bool"},
    "str": {"str"},
    "bytes": {"bytes"},
    "ndarray": {"ndarray"},
    "json": {"json"},
}
_KINDS_HELP = "an int, float, bool, str, bytes, numpy array, or list/dict (JSON)"


class ShardSet(BaseModel):
    """A complete MDS shard set: where it is and what it holds. Cheap to pickle."""

    model_config = ConfigDict(frozen=True)

    uri: str
    rows: int
    shards: int
    columns: dict[str, str]
    fingerprint: str | None
    compression: str | None

    def __str__(self) -> str:
        return self.uri


# --- settings ---------------------------------------------------------------------


def _check_settings(columns: dict[str, str] | None, compression: str | None,
                    size_limit: int | str | None) -> int | None:
    """Validate settings before any row is read; return the size limit in bytes."""
    from streaming.base.compression import get_compressions
    from streaming.base.format.mds.encodings import get_mds_encodings, is_mds_encoding
    from streaming.base.util import bytes_to_int

    if columns is not None:
        if not isinstance(columns, dict) or not columns:
            raise SGPUConfigError("columns", columns, "None (inferred) or a dict of column name -> MDS encoding")
        for name, encoding in columns.items():
            if not isinstance(name, str) or not isinstance(encoding, str) or not is_mds_encoding(encoding):
                raise SGPUConfigError(f"columns[{name!r}]", encoding,
                                      "an MDS encoding: " + ", ".join(sorted(get_mds_encodings())))
    if compression is not None and compression not in get_compressions():
        raise SGPUConfigError("compression", compression,
                              "None or one of br, bz2, gz, snappy, zstd (optionally with a level, e.g. zstd:7)")
    if size_limit is None:
        return None
    try:
        limit = bytes_to_int(size_limit)
    except (ValueError, TypeError):
        limit = -1
    if not 0 < limit < 2**32:
        raise SGPUConfigError("size_limit", size_limit, "a size between 1 byte and 4 GiB, e.g. '64mb' or 1 << 26")
    return limit


def _settings_fingerprint(source_fp: str | None, columns: dict[str, str] | None, compression: str | None,
                          size_limit: int | None) -> str | None:
    if source_fp is None:
        return None
    settings = {"format": _FORMAT_VERSION, "source": source_fp, "columns": columns,
                "compression": compression, "size_limit": size_limit}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def set_fingerprint(source: Any, *, columns: dict[str, str] | None = None, compression: str | None = "zstd",
                    size_limit: int | str | None = "64mb") -> str | None:
    """The fingerprint a shard set of ``source`` with these settings gets (None: not hashable)."""
    limit = _check_settings(columns, compression, size_limit)
    return _settings_fingerprint(sources.fingerprint(source), columns, compression, limit)


# --- column types -------------------------------------------------------------------


def kind_of(value: Any) -> str:
    """The kind of a value, as far as MDS encodings are concerned."""
    if value is None:
        return "null"
    module = type(value).__module__
    if isinstance(value, bool) or (module == "numpy" and type(value).__name__ == "bool"):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (bytes, bytearray)):
        return "bytes"
    if isinstance(value, (list, dict)):
        return "json"
    if module == "numpy":
        import numpy as np

        if isinstance(value, np.ndarray):
            return "ndarray"
        if isinstance(value, np.integer):
            return "int"
        if isinstance(value, np.floating):
            return "float"
        if isinstance(value, np.str_):
            return "str"
        if isinstance(value, np.bytes_):
            return "bytes"
    return type(value).__name__


def _bad_value(name: str, row: int, value: Any, allowed: str, hint: str | None = None) -> SGPUConfigError:
    text = repr(value)
    return SGPUConfigError(f"column {name!r} at row {row}", text if len(text) <= 80 else text[:77] + "...",
                           allowed, hint)


def infer_columns(rows: list[dict[str, Any]]) -> dict[str, str]:
    """MDS encodings for the columns of ``rows`` (the first rows of a source).

    A column that mixes ints and floats is a float column; any other mix, a null, or a
    value MDS cannot encode is an error naming the column and the row.
    """
    if not rows:
        raise SGPUConfigError("source", "no rows", "at least one row")
    names = list(rows[0])
    kinds: dict[str, str] = {}
    for i, row in enumerate(rows):
        _check_row_columns(row, i, names)
        for name in names:
            value = row[name]
            kind = kind_of(value)
            if kind == "null":
                raise _bad_value(name, i, value, f"a value: nulls cannot be encoded; give columns={{{name!r}: "
                                 "'json'}} to keep them, or fill them")
            if kind not in ENCODING_OF_KIND:
                raise _bad_value(name, i, value, _KINDS_HELP,
                                 f"a {type(value).__name__} cannot be encoded; convert it or give columns=")
            if kind == "ndarray":
                _check_ndarray(name, i, value)
            seen = kinds.setdefault(name, kind)
            if seen == kind:
                continue
            if {seen, kind} <= {"int", "float", "bool"}:
                kinds[name] = "float" if "float" in (seen, kind) else "int"
                continue
            first = next(j for j, r in enumerate(rows) if kind_of(r[name]) == seen)
            raise _bad_value(name, i, value, f"a {seen} like row {first} (a column holds one type)")
    return {name: ENCODING_OF_KIND[kinds[name]] for name in names}


def _check_row_columns(row: dict[str, Any], i: int, names: list[str]) -> None:
    if len(row) != len(names) or any(name not in row for name in names):
        missing = [n for n in names if n not in row]
        extra = [n for n in row if n not in names]
        raise SGPUConfigError(f"row {i}", sorted(row), f"the columns of row 0: {names}",
                              f"missing {missing}" if missing else f"unexpected {extra}")


_NDARRAY_DTYPES = ("uint8", "int8", "uint16", "int16", "float16", "uint32", "int32", "float32",
                   "uint64", "int64", "float64")


def _check_ndarray(name: str, i: int, value: Any) -> None:
    if value.dtype.name not in _NDARRAY_DTYPES:
        raise _bad_value(name, i, value, "a numpy array of dtype " + ", ".join(_NDARRAY_DTYPES),
                         f"its dtype is {value.dtype.name}; convert it with .astype()")


def _check_value(name: str, encoding: str, i: int, value: Any) -> None:
    """An inferred column must keep its type in every row (not only the first ones)."""
    kind = kind_of(value)
    if kind not in _ACCEPTS[encoding]:
        raise _bad_value(name, i, value, f"a value of the column's type ({encoding}, inferred from the first "
                         f"rows)", "give columns= to set types explicitly" if kind != "null" else
                         "nulls cannot be encoded")
    if kind == "ndarray":
        _check_ndarray(name, i, value)


def _encoding_error(row: dict[str, Any], i: int, columns: dict[str, str], exc: Exception) -> SGPUConfigError:
    """Find which column of a row MDSWriter could not encode."""
    from streaming.base.format.mds.encodings import mds_encode

    for name, encoding in columns.items():
        if name not in row:
            return SGPUConfigError(f"row {i}", sorted(row), f"a value for every column in columns: missing {name!r}")
        try:
            mds_encode(encoding, row[name])
        except Exception as col_exc:  # noqa: BLE001 - every encoder failure is the user's value
            return _bad_value(name, i, row[name], f"a value MDS can encode as {encoding!r}",
                              f"{type(col_exc).__name__}: {col_exc}")
    return SGPUConfigError(f"row {i}", "a row", "a row MDS can encode", f"{type(exc).__name__}: {exc}")


# --- progress ---------------------------------------------------------------------


class _Progress:
    """A rich progress bar in the terminal and, inside a Prefect task run, a progress artifact."""

    def __init__(self, enabled: bool, total: int | None, label: str) -> None:
        self.total = total
        self.label = label
        self.bar: Any = None
        self.task_id: Any = None
        self.started = time.monotonic()
        self.artifact_id: Any = None
        self.last_artifact = 0.0
        self.in_task_run = enabled and _in_prefect_task_run()
        if enabled:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("rows"), TimeElapsedColumn(), TimeRemainingColumn(),
                                transient=False)
            self.bar.start()
            self.task_id = self.bar.add_task(label, total=total)

    def advance(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task_id, completed=done)
        if self.in_task_run and self.total:
            now = time.monotonic()
            if now - self.started >= ARTIFACT_AFTER_S and now - self.last_artifact >= ARTIFACT_EVERY_S:
                self._artifact(100.0 * done / self.total)
                self.last_artifact = now

    def _artifact(self, percent: float) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        try:
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(percent, description=f"MDS conversion: {self.label}")
            else:
                update_progress_artifact(self.artifact_id, percent)
        except Exception as exc:  # noqa: BLE001 - progress reporting must never fail a conversion
            logger.debug("progress artifact not updated: %s", exc)
            self.in_task_run = False

    def close(self, done: int, ok: bool) -> None:
        if self.bar is not None:
            self.bar.update(self.task_id, completed=done)
            self.bar.stop()
        if ok and self.artifact_id is not None:
            self._artifact(100.0)


def _in_prefect_task_run() -> bool:
    if "prefect" not in sys.modules:  # never import Prefect just to find out
        return False
    from prefect.context import TaskRunContext

    return TaskRunContext.get() is not None


# --- where shards go --------------------------------------------------------------


def _is_s3(output: str) -> bool:
    return output.startswith("s3://")


def _shard_set_file(name: str) -> bool:
    """Files a shard set folder may hold (so an unrelated folder is never deleted)."""
    return (name in (INDEX, MARKER) or (name.startswith("shard.") and ".mds" in name)
            or name.endswith(".tmp"))


def _read_marker_local(out: Path) -> dict[str, Any] | None:
    try:
        if not (out / INDEX).is_file():
            return None
        return json.loads((out / MARKER).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def _check_replaceable(names: list[str], output: str) -> None:
    foreign = sorted(n for n in names if not _shard_set_file(n))
    if foreign:
        raise SGPUConfigError("output", output, "an empty or new folder, or a shard set written by write_mds",
                              f"it holds other files ({', '.join(foreign[:5])}); nothing was deleted")


def _s3_client() -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=os.environ.get("S3_ENDPOINT_URL") or None)


def _split_s3(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not bucket or not prefix.strip("/"):
        raise SGPUConfigError("output", uri, "s3://BUCKET/PREFIX (a prefix of its own, not a bucket root)")
    return bucket, prefix.strip("/")


def _s3_keys(client: Any, bucket: str, prefix: str) -> list[str]:
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys += [obj["Key"] for obj in page.get("Contents", [])]
    return keys


def _read_marker_s3(client: Any, bucket: str, prefix: str) -> dict[str, Any] | None:
    from botocore.exceptions import ClientError

    try:
        client.head_object(Bucket=bucket, Key=f"{prefix}/{INDEX}")
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{MARKER}")["Body"].read()
        return json.loads(body)
    except (ClientError, json.JSONDecodeError):
        return None


def _delete_s3(client: Any, bucket: str, keys: list[str]) -> None:
    # marker and index first: from the first call on, the set no longer looks complete
    ordered = sorted(keys, key=lambda k: (not k.endswith(MARKER), not k.endswith(INDEX)))
    for key in ordered[:2]:
        client.delete_object(Bucket=bucket, Key=key)
    for start in range(2, len(ordered), 1000):
        batch = ordered[start:start + 1000]
        client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})


# --- conversion -------------------------------------------------------------------


def _peek(rows: Iterator[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    head = []
    for row in rows:
        head.append(row)
        if len(head) >= n:
            break
    return head


def _write_rows(out: str | tuple[str, str], head: list[dict[str, Any]], rest: Iterator[dict[str, Any]],
                columns: dict[str, str], inferred: bool, compression: str | None, size_limit: int | None,
                progress: _Progress) -> tuple[int, int]:
    """Write every row with MDSWriter; return (rows, shards). Never finishes a failed set."""
    from streaming import MDSWriter

    writer = MDSWriter(out=out, columns=columns, compression=compression, size_limit=size_limit)
    count = 0
    try:
        for i, row in enumerate(_chain(head, rest)):
            if inferred:
                _check_row_columns(row, i, list(columns))
                for name, encoding in columns.items():
                    _check_value(name, encoding, i, row[name])
            try:
                writer.write(row)
            except Exception as exc:  # noqa: BLE001 - turned into an error naming column and row
                raise _encoding_error(row, i, columns, exc) from exc
            count = i + 1
            if count % 256 == 0:
                progress.advance(count)
        if count == 0:
            raise SGPUConfigError("source", "no rows", "at least one row")
    except BaseException:
        writer.cancel_future_jobs()  # no finish(): a failed set never gets an index.json
        raise
    writer.finish()
    progress.advance(count)
    return count, len(writer.shards)


def _chain(head: list[dict[str, Any]], rest: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield from head
    yield from rest


def write_mds(
    source: Any,
    output: str | os.PathLike[str],
    *,
    columns: dict[str, str] | None = None,
    compression: str | None = "zstd",
    size_limit: int | str | None = "64mb",
    progress: bool = True,
) -> ShardSet:
    """Convert ``source`` to MDS shards at ``output`` (a folder or ``s3://bucket/prefix``).

    ``columns`` maps column names to MDS encodings (e.g. ``{"x": "ndarray", "y": "int64"}``);
    left out, the types are inferred from the first rows and every later row must keep
    them. A complete set at ``output`` with the same fingerprint (source content +
    settings) is reused as is. Bad input raises :class:`SGPUConfigError` naming the
    column and row, and never leaves a set that looks complete.
    """
    output = str(output)
    limit = _check_settings(columns, compression, size_limit)
    source_fp = sources.fingerprint(source)
    fp = _settings_fingerprint(source_fp, columns, compression, limit)
    label = f"{sources.describe(source)} -> {output}"

    if _is_s3(output):
        return _write_s3(source, output, source_fp, fp, columns, compression, limit, progress, label)

    out = Path(output).expanduser().absolute()
    uri = str(out)
    found = _read_marker_local(out)
    if fp is not None and found and found.get("fingerprint") == fp:
        logger.info("reusing the complete shard set at %s (fingerprint %s)", uri, fp[:12])
        return ShardSet(**{k: found[k] for k in ShardSet.model_fields if k != "uri"}, uri=uri)
    if out.exists():
        if not out.is_dir():
            raise SGPUConfigError("output", uri, "a folder path (a file is there)")
        _check_replaceable([p.name for p in out.iterdir()], uri)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        shard_set = _convert(source, str(tmp), uri, fp, columns, compression, limit, progress, label)
        (tmp / MARKER).write_text(_marker_text(shard_set, source_fp))
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("wrote %d rows in %d shard(s) to %s", shard_set.rows, shard_set.shards, uri)
    return shard_set


def _convert(source: Any, writer_out: str | tuple[str, str], uri: str, fp: str | None,
             columns: dict[str, str] | None, compression: str | None, limit: int | None, progress: bool,
             label: str) -> ShardSet:
    total, rows = sources.open_rows(source)
    head = _peek(rows, INFER_ROWS)
    if not head:
        raise SGPUConfigError("source", sources.describe(source), "a source with at least one row")
    resolved = dict(columns) if columns is not None else infer_columns(head)
    bar = _Progress(progress, total, label)
    ok = False
    count = 0
    try:
        count, shards = _write_rows(writer_out, head, rows, resolved, columns is None, compression, limit, bar)
        ok = True
    finally:
        bar.close(count, ok)
    return ShardSet(uri=uri, rows=count, shards=shards, columns=resolved, fingerprint=fp, compression=compression)


def _marker_text(shard_set: ShardSet, source_fp: str | None) -> str:
    doc = {**shard_set.model_dump(exclude={"uri"}), "source_fingerprint": source_fp,
           "format": _FORMAT_VERSION, "completed_at": time.time()}
    return json.dumps(doc, indent=1, sort_keys=True)


def _move_into_place(tmp: Path, out: Path) -> None:
    """Swap the finished set in; the output is at every moment complete or absent."""
    if not out.exists():
        try:
            tmp.rename(out)
            return
        except OSError:
            if not out.exists():
                raise
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    out.rename(old)
    try:
        tmp.rename(out)
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _write_s3(source: Any, uri: str, source_fp: str | None, fp: str | None, columns: dict[str, str] | None, compression: str | None,
              limit: int | None, progress: bool, label: str) -> ShardSet:
    """S3 has no rename: clear the prefix (marker first), write, put the marker last."""
    bucket, prefix = _split_s3(uri)
    uri = f"s3://{bucket}/{prefix}"
    client = _s3_client()
    found = _read_marker_s3(client, bucket, prefix)
    if fp is not None and found and found.get("fingerprint") == fp:
        logger.info("reusing the complete shard set at %s (fingerprint %s)", uri, fp[:12])
        return ShardSet(**{k: found[k] for k in ShardSet.model_fields if k != "uri"}, uri=uri)
    keys = _s3_keys(client, bucket, prefix)
    _check_replaceable([k[len(prefix) + 1:] for k in keys], uri)
    if keys:
        _delete_s3(client, bucket, keys)
    staging = Path(tempfile.mkdtemp(prefix="sgpu-mds-")) / "shards"
    try:
        shard_set = _convert(source, (str(staging), uri), uri, fp, columns, compression, limit, progress, label)
    except BaseException:
        try:  # leave nothing behind; it could not look complete anyway (no index, no marker)
            _delete_s3(client, bucket, _s3_keys(client, bucket, prefix))
        except Exception as exc:  # noqa: BLE001 - the original error matters more
            logger.warning("could not remove partial shards under %s: %s", uri, exc)
        raise
    finally:
        shutil.rmtree(staging.parent, ignore_errors=True)
    client.put_object(Bucket=bucket, Key=f"{prefix}/{MARKER}", Body=_marker_text(shard_set, source_fp).encode())
    logger.info("wrote %d rows in %d shard(s) to %s", shard_set.rows, shard_set.shards, uri)
    return shard_set


def read_shard_set(uri: str | os.PathLike[str]) -> ShardSet | None:
    """The :class:`ShardSet` of a complete set at ``uri`` (a folder or ``s3://``), else None."""
    uri = str(uri)
    if _is_s3(uri):
        bucket, prefix = _split_s3(uri)
        found = _read_marker_s3(_s3_client(), bucket, prefix)
        uri = f"s3://{bucket}/{prefix}"
    else:
        out = Path(uri).expanduser().absolute()
        found = _read_marker_local(out)
        uri = str(out)
    if not found:
        return None
    return ShardSet(**{k: found[k] for k in ShardSet.model_fields if k != "uri"}, uri=uri)


# --- the Prefect task -------------------------------------------------------------


def _output_key(output: Any) -> str:
    text = str(output)
    return text if _is_s3(text) else str(Path(text).expanduser().absolute())


def mds_cache_key(context: Any, parameters: dict[str, Any]) -> str | None:
    """Prefect cache key: the set's fingerprint and its output; None (no cache) for one-shot iterators.

    A cached ShardSet is only true while its set exists. When Prefect remembers a set
    that is gone (deleted, or replaced by another conversion), the key is a one-off, so
    the task converts again; once the set is back, the remembered result (same uri, same
    fingerprint) is right again and later runs are cache hits.
    """
    fp = set_fingerprint(parameters["source"], columns=parameters.get("columns"),
                         compression=parameters.get("compression", "zstd"),
                         size_limit=parameters.get("size_limit", "64mb"))
    if fp is None:
        return None
    output = _output_key(parameters["output"])
    key = f"sgpu-mds-{fp[:32]}-{hashlib.sha256(output.encode()).hexdigest()[:16]}"
    on_disk = read_shard_set(output)
    if on_disk is not None and on_disk.fingerprint == fp:
        return key
    store = getattr(context, "result_store", None)
    if store is not None and store.exists(key):
        return f"{key}-rebuild-{uuid.uuid4().hex[:12]}"
    return key


def _build_task() -> Any:
    from prefect import task

    def prepare_mds(source: Any, output: str, *, columns: dict[str, str] | None = None,
                    compression: str | None = "zstd", size_limit: int | str | None = "64mb",
                    progress: bool = True) -> ShardSet:
        """Convert source data to MDS shards (cached by content and settings)."""
        return write_mds(source, output, columns=columns, compression=compression, size_limit=size_limit,
                         progress=progress)

    prepare_mds.__module__ = __name__
    prepare_mds.__qualname__ = "prepare_mds"
    return task(prepare_mds, name="prepare-mds", cache_key_fn=mds_cache_key, persist_result=True)


_task: Any = None


def __getattr__(name: str) -> Any:
    """``prepare_mds`` (a Prefect task) is built on first use, so importing stays cheap."""
    global _task
    if name == "prepare_mds":
        if _task is None:
            _task = _build_task()
        return _task
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


prepare_mds: Callable[..., ShardSet]  # for type checkers and readers; the value comes from __getattr__
