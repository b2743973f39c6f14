"""Where shard sets live, a local folder or an object store's prefix (``s3://``), and what makes one complete.

A set is complete when it holds streaming's ``index.json`` and our completion marker;
the marker records the set's :class:`ShardSet` fields and fingerprint, so
:func:`read_shard_set` (and the writer's reuse check) need nothing but these two files.
Object storage is reached through the store its scheme names (:mod:`prefect_sgpu.store`).
It has no rename: the writer clears a prefix itself, marker and index first
(:func:`clear_objects`), so a set stops looking complete before any shard goes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.pipeline.mds.shard_set import ShardSet
from prefect_sgpu.store import Objects, is_object_uri, open_store

MARKER = ".sgpu-complete.json"
INDEX = "index.json"
#: part of every fingerprint and marker: bump it and no set written before is reused
FORMAT_VERSION = 1
#: where the streaming library, which writes and reads the shards, takes an object store's endpoint from
ENDPOINT_ENV = "S3_ENDPOINT_URL"


def is_remote(output: str) -> bool:
    """Whether ``output`` is an object store's prefix, not a folder."""
    return is_object_uri(output)


def _shard_set_file(name: str) -> bool:
    """Files a shard set folder may hold (so an unrelated folder is never deleted)."""
    return (name in (INDEX, MARKER) or (name.startswith("shard.") and ".mds" in name)
            or name.endswith(".tmp"))


def read_marker_local(out: Path) -> dict[str, Any] | None:
    try:
        if not (out / INDEX).is_file():
            return None
        return json.loads((out / MARKER).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def check_replaceable(names: list[str], output: str) -> None:
    foreign = sorted(n for n in names if not _shard_set_file(n))
    if foreign:
        raise SGPUConfigError("output", output, "an empty or new folder, or a shard set written by write_mds",
                              f"it holds other files ({', '.join(foreign[:5])}); nothing was deleted")


def open_objects(uri: str) -> Objects:
    """The objects of the set at ``uri`` (a prefix of its own, not a bucket's root), as the streaming
    library reaches them: its endpoint, and none of the job store's own write settings."""
    scheme, _, rest = uri.partition("://")
    bucket, _, prefix = rest.partition("/")
    if not bucket or not prefix.strip("/"):
        raise SGPUConfigError("output", uri,
                              f"{scheme}://BUCKET/PREFIX (a prefix of its own, not a bucket root)")
    store = open_store(f"{scheme}://{bucket}/{prefix.strip('/')}",
                       endpoint_url=os.environ.get(ENDPOINT_ENV) or None)
    return store.objects(store_settings=False)


def read_marker_objects(objects: Objects) -> dict[str, Any] | None:
    """The marker of a complete set in ``objects`` (its index is there too), else None."""
    try:
        if not objects.exists(INDEX):
            return None
        body = objects.get(MARKER)
        return None if body is None else json.loads(body)
    except json.JSONDecodeError:
        return None


def clear_objects(objects: Objects, keys: list[str]) -> None:
    """Delete ``keys``: marker and index first, so from the first call on the set no longer looks complete."""
    ordered = sorted(keys, key=lambda k: (not k.endswith(MARKER), not k.endswith(INDEX)))
    for key in ordered[:2]:
        objects.delete([key])
    objects.delete(ordered[2:])


def marker_text(shard_set: ShardSet, source_fp: str | None) -> str:
    doc = {**shard_set.model_dump(exclude={"uri"}), "source_fingerprint": source_fp,
           "format": FORMAT_VERSION, "completed_at": time.time()}
    return json.dumps(doc, indent=1, sort_keys=True)


def read_shard_set(uri: str | os.PathLike[str]) -> ShardSet | None:
    """The :class:`ShardSet` of a complete set at ``uri`` (a folder or ``s3://``), else None."""
    uri = str(uri)
    if is_remote(uri):
        objects = open_objects(uri)
        found = read_marker_objects(objects)
        uri = objects.uri
    else:
        out = Path(uri).expanduser().absolute()
        found = read_marker_local(out)
        uri = str(out)
    if not found:
        return None
    return ShardSet(**{k: found[k] for k in ShardSet.model_fields if k != "uri"}, uri=uri)
