"""Checking an MDS set's ``index.json`` before Mosaic Streaming turns its names into paths.

Streaming joins every shard file name of the index (``raw_data``, ``zip_data``,
``raw_meta``, ``zip_meta``: their ``basename``) onto its local folder and downloads,
decompresses or deletes files there (``streaming/base/stream.py``, ``_prepare_shard_part``).
The index comes from the data location, and whoever can write that location is not
trusted to write anywhere else on a node: an absolute name or a ``..`` part would send
those writes outside the cache. So every loader checks the index first:

- a name is plain and relative: ``/``-separated parts, none empty, ``.`` or ``..``, no
  backslash or NUL. Sub-folders are allowed: ``MDSWriter`` writes flat names
  (``shard.00000.mds.zstd``), but Streaming's own ``merge_index`` (sets written in
  parallel parts) writes ``<part>/shard.00000.mds``;
- after resolving (symlinks included), the file stays inside the set's local folder;
- a remote index (and the index of a compressed local set, which is copied to the
  node's cache) is fetched here, into the cache, and placed only once checked: Streaming
  finds it there and never fetches its own, so the index it uses is the one checked;
- once Streaming has parsed the index, the names it holds are checked again
  (:func:`check_dataset`), before any shard is fetched: an in-place set whose index was
  swapped after the first check is still refused.

A bad index raises :class:`~prefect_sgpu.errors.SGPUConfigError` naming the field, the
name and what is allowed. This module imports nothing heavy at import time.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any, Iterator

from prefect_sgpu.errors import SGPUConfigError

INDEX = "index.json"
#: every field of a shard entry whose ``basename`` Streaming joins onto its folder
NAME_FIELDS = ("raw_data", "zip_data", "raw_meta", "zip_meta")
ALLOWED = ("a plain relative file name inside the set's folder ('/'-separated parts; no absolute path, "
           "no empty, '.' or '..' part, no backslash or NUL)")
#: Streaming's own default for one download
_DOWNLOAD_TIMEOUT = 60.0


def name_problem(name: Any) -> str | None:
    """Why ``name`` is not a plain relative name, or None when it is one."""
    if not isinstance(name, str):
        return f"not a string ({type(name).__name__})"
    if not name:
        return "empty"
    if "\x00" in name:
        return "holds a NUL"
    if "\\" in name:
        return "holds a backslash"
    if name.startswith("/"):
        return "absolute"
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "has an empty, '.' or '..' part"
    return None


def _names(index: Any, where: str) -> Iterator[tuple[str, Any]]:
    """(field, name) for every file name of the index; refuses a shape that hides names."""
    shards = index.get("shards") if isinstance(index, dict) else None
    if not isinstance(shards, list):
        raise SGPUConfigError(f"{where}: shards", type(shards).__name__,
                              "a list of shard entries (MDS index.json)")
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict):
            raise SGPUConfigError(f"{where}: shards[{i}]", type(shard).__name__,
                                  "a shard entry (a JSON object)")
        for key in NAME_FIELDS:
            info = shard.get(key)
            if info is None:
                continue
            if not isinstance(info, dict):
                raise SGPUConfigError(f"{where}: shards[{i}].{key}", info,
                                      "a file entry (a JSON object) or null")
            yield f"shards[{i}].{key}.basename", info.get("basename")


def check_name(name: Any, folder: Path, field: str) -> None:
    """Refuse ``name`` unless it is plain, relative and resolves inside ``folder``."""
    problem = name_problem(name)
    if problem is None:
        root = folder.resolve()
        if not (root / name).resolve().is_relative_to(root):
            problem = "resolves outside the folder (a symlink)"
    if problem is not None:
        raise SGPUConfigError(field, name, ALLOWED,
                              f"The name is {problem}; no shard of this set was read or written")


def check_index(index: Any, folder: Path, where: str) -> None:
    """Check every file name of a parsed ``index.json`` against ``folder`` (where the files go)."""
    for field, name in _names(index, where):
        check_name(name, folder, f"{where}: {field}")


def check_index_file(path: Path, where: str) -> Any:
    """Read, parse and check the index at ``path``; return the parsed index."""
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SGPUConfigError("uri", where, f"a readable MDS index.json ({exc})") from exc
    check_index(index, path.parent, where)
    return index


def fetch_checked_index(remote: str, local: str | os.PathLike[str], split: str | None = None,
                        timeout: float | None = None) -> Any:
    """Place the checked index of the set at ``remote`` in the cache folder ``local``.

    Fetched to a private name, checked, then linked into place without replacing one
    another rank of this node placed first (which is checked too). Streaming then reads
    this file and fetches no index of its own. Returns the parsed index.
    """
    folder = Path(local, split or "")
    final = folder / INDEX
    where = os.path.join(remote, split or "", INDEX)
    if not final.exists():
        from streaming.base.storage import CloudDownloader

        folder.mkdir(parents=True, exist_ok=True)
        private = folder / f".{INDEX}.{os.getpid()}-{uuid.uuid4().hex}.sgpu"
        try:
            try:
                CloudDownloader.direct_download(where, str(private), timeout or _DOWNLOAD_TIMEOUT)
            except Exception as exc:  # noqa: BLE001 - any store error: the set cannot be opened
                raise SGPUConfigError("uri", remote, f"a readable MDS index.json ({exc})") from exc
            check_index_file(private, where)
            try:
                os.link(private, final)
            except FileExistsError:
                pass
            except OSError:  # a filesystem without hard links
                os.replace(private, final)
        finally:
            private.unlink(missing_ok=True)
    return check_index_file(final, where)


def check_dataset(dataset: Any) -> None:
    """Check the names a built ``StreamingDataset`` holds, before it fetches any shard."""
    shards = getattr(dataset, "shards", None)
    if not isinstance(shards, list):
        raise SGPUConfigError("dataset", type(dataset).__name__,
                              "a StreamingDataset whose shard names can be checked (mosaicml-streaming 0.13)")
    for i, reader in enumerate(shards):
        folder = Path(reader.dirname, reader.split or "")
        for raw_info, zip_info in reader.file_pairs:
            for kind, info in (("raw", raw_info), ("zip", zip_info)):
                if info is not None:
                    check_name(info.basename, folder, f"shards[{i}] {kind} file")
