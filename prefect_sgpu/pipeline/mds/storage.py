"""Where shard sets live, a local folder or an ``s3://`` prefix, and what makes one complete.

A set is complete when it holds streaming's ``index.json`` and our completion marker;
the marker records the set's :class:`ShardSet` fields and fingerprint, so
:func:`read_shard_set` (and the writer's reuse check) need nothing but these two files.
The S3 helpers are here because S3 has no rename: the writer clears a prefix itself,
marker and index first, so a set stops looking complete before any shard goes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.pipeline.mds.shard_set import ShardSet

MARKER = ".sgpu-complete.json"
INDEX = "index.json"
#: part of every fingerprint and marker: bump it and no set written before is reused
FORMAT_VERSION = 1


def is_s3(output: str) -> bool:
    return output.startswith("s3://")


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


def s3_client() -> Any:
    from prefect_sgpu import aws

    return aws.client("s3", endpoint_url=os.environ.get("S3_ENDPOINT_URL") or None)


def split_s3(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not bucket or not prefix.strip("/"):
        raise SGPUConfigError("output", uri, "s3://BUCKET/PREFIX (a prefix of its own, not a bucket root)")
    return bucket, prefix.strip("/")


def s3_keys(client: Any, bucket: str, prefix: str) -> list[str]:
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys += [obj["Key"] for obj in page.get("Contents", [])]
    return keys


def read_marker_s3(client: Any, bucket: str, prefix: str) -> dict[str, Any] | None:
    from botocore.exceptions import ClientError

    try:
        client.head_object(Bucket=bucket, Key=f"{prefix}/{INDEX}")
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{MARKER}")["Body"].read()
        return json.loads(body)
    except (ClientError, json.JSONDecodeError):
        return None


def delete_s3(client: Any, bucket: str, keys: list[str]) -> None:
    # marker and index first: from the first call on, the set no longer looks complete
    ordered = sorted(keys, key=lambda k: (not k.endswith(MARKER), not k.endswith(INDEX)))
    for key in ordered[:2]:
        client.delete_object(Bucket=bucket, Key=key)
    for start in range(2, len(ordered), 1000):
        batch = ordered[start:start + 1000]
        client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})


def marker_text(shard_set: ShardSet, source_fp: str | None) -> str:
    doc = {**shard_set.model_dump(exclude={"uri"}), "source_fingerprint": source_fp,
           "format": FORMAT_VERSION, "completed_at": time.time()}
    return json.dumps(doc, indent=1, sort_keys=True)


def read_shard_set(uri: str | os.PathLike[str]) -> ShardSet | None:
    """The :class:`ShardSet` of a complete set at ``uri`` (a folder or ``s3://``), else None."""
    uri = str(uri)
    if is_s3(uri):
        bucket, prefix = split_s3(uri)
        found = read_marker_s3(s3_client(), bucket, prefix)
        uri = f"s3://{bucket}/{prefix}"
    else:
        out = Path(uri).expanduser().absolute()
        found = read_marker_local(out)
        uri = str(out)
    if not found:
        return None
    return ShardSet(**{k: found[k] for k in ShardSet.model_fields if k != "uri"}, uri=uri)
