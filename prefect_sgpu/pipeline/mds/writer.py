"""``write_mds``: source rows -> MDS shards, written so that a set is complete or absent.

A training job that starts on a half-written shard set fails late and expensively, or
silently trains on part of the data. So a local set is written into a temporary sibling
folder and renamed into place only when its index and completion marker are there; an
``s3://`` set is cleared first and gets its marker last. Before any of that, a complete
set already at the output with the same fingerprint is reused instead of converted again.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.pipeline import sources
from prefect_sgpu.pipeline.mds.columns import (INFER_ROWS, check_row_columns, check_value, encoding_error,
                                               infer_columns)
from prefect_sgpu.pipeline.mds.progress import ConversionProgress
from prefect_sgpu.pipeline.mds.settings import check_settings, settings_fingerprint
from prefect_sgpu.pipeline.mds.shard_set import ShardSet
from prefect_sgpu.pipeline.mds.storage import (MARKER, check_replaceable, marker_text, read_marker_local,
                                               clear_objects, is_remote, open_objects, read_marker_objects)

# one logger for the whole package, the one it had before it was split into files
logger = logging.getLogger("prefect_sgpu.pipeline.mds")


def _peek(rows: Iterator[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    head = []
    for row in rows:
        head.append(row)
        if len(head) >= n:
            break
    return head


def _write_rows(out: str | tuple[str, str], head: list[dict[str, Any]], rest: Iterator[dict[str, Any]],
                columns: dict[str, str], check: bool, compression: str | None, size_limit: int | None,
                progress: ConversionProgress) -> tuple[int, int]:
    """Write every row with MDSWriter; return (rows, shards). Never finishes a failed set."""
    from streaming import MDSWriter

    writer = MDSWriter(out=out, columns=columns, compression=compression, size_limit=size_limit)
    count = 0
    names = list(columns)
    # per column, the (type, dtype) of a value already checked: a row whose values match needs no
    # new check (the checks of an inferred column otherwise cost half of MDSWriter's own time)
    checked: dict[str, tuple[type, Any]] = {}
    try:
        for i, row in enumerate(_chain(head, rest)):
            if check:
                if len(row) != len(names):
                    check_row_columns(row, i, names)
                for name, encoding in columns.items():
                    try:
                        value = row[name]
                    except KeyError:
                        check_row_columns(row, i, names)
                        raise
                    kind = (type(value), getattr(value, "dtype", None))
                    if checked.get(name) != kind:
                        check_value(name, encoding, i, value)
                        checked[name] = kind
            try:
                writer.write(row)
            except Exception as exc:  # noqa: BLE001 - turned into an error naming column and row
                raise encoding_error(row, i, columns, exc) from exc
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
    limit = check_settings(columns, compression, size_limit)
    source_fp = sources.fingerprint(source)
    fp = settings_fingerprint(source_fp, columns, compression, limit)
    label = f"{sources.describe(source)} -> {output}"

    if is_remote(output):
        return _write_remote(source, output, source_fp, fp, columns, compression, limit, progress, label)

    out = Path(output).expanduser().absolute()
    uri = str(out)
    found = read_marker_local(out)
    if fp is not None and found and found.get("fingerprint") == fp:
        logger.info("reusing the complete shard set at %s (fingerprint %s)", uri, fp[:12])
        return ShardSet(**{k: found[k] for k in ShardSet.model_fields if k != "uri"}, uri=uri)
    if out.exists():
        if not out.is_dir():
            raise SGPUConfigError("output", uri, "a folder path (a file is there)")
        check_replaceable([p.name for p in out.iterdir()], uri)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        shard_set = _convert(source, str(tmp), uri, fp, columns, compression, limit, progress, label)
        (tmp / MARKER).write_text(marker_text(shard_set, source_fp))
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("wrote %d rows in %d shard(s) to %s", shard_set.rows, shard_set.shards, uri)
    return shard_set


def _convert(source: Any, writer_out: str | tuple[str, str], uri: str, fp: str | None,
             columns: dict[str, str] | None, compression: str | None, limit: int | None, progress: bool,
             label: str) -> ShardSet:
    total, rows, typed = sources.open_rows(source)
    head = _peek(rows, INFER_ROWS)
    if not head:
        raise SGPUConfigError("source", sources.describe(source), "a source with at least one row")
    resolved = dict(columns) if columns is not None else infer_columns(head)
    bar = ConversionProgress(progress, total, label)
    ok = False
    count = 0
    try:
        # inferred types are checked row by row, unless the source's own dtypes already fix them
        check = columns is None and not typed
        count, shards = _write_rows(writer_out, head, rows, resolved, check, compression, limit, bar)
        ok = True
    finally:
        bar.close(count, ok)
    return ShardSet(uri=uri, rows=count, shards=shards, columns=resolved, fingerprint=fp, compression=compression)


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


def _write_remote(source: Any, uri: str, source_fp: str | None, fp: str | None,
                  columns: dict[str, str] | None, compression: str | None, limit: int | None, progress: bool,
                  label: str) -> ShardSet:
    """Object storage has no rename: clear the prefix (marker first), write, put the marker last."""
    objects = open_objects(uri)
    uri = objects.uri
    found = read_marker_objects(objects)
    if fp is not None and found and found.get("fingerprint") == fp:
        logger.info("reusing the complete shard set at %s (fingerprint %s)", uri, fp[:12])
        return ShardSet(**{k: found[k] for k in ShardSet.model_fields if k != "uri"}, uri=uri)
    keys = objects.keys()
    check_replaceable(keys, uri)
    if keys:
        clear_objects(objects, keys)
    staging = Path(tempfile.mkdtemp(prefix="sgpu-mds-")) / "shards"
    try:
        shard_set = _convert(source, (str(staging), uri), uri, fp, columns, compression, limit, progress, label)
    except BaseException:
        try:  # leave nothing behind; it could not look complete anyway (no index, no marker)
            clear_objects(objects, objects.keys())
        except Exception as exc:  # noqa: BLE001 - the original error matters more
            logger.warning("could not remove partial shards under %s: %s", uri, exc)
        raise
    finally:
        shutil.rmtree(staging.parent, ignore_errors=True)
    objects.put(MARKER, marker_text(shard_set, source_fp).encode())
    logger.info("wrote %d rows in %d shard(s) to %s", shard_set.rows, shard_set.shards, uri)
    return shard_set
