"""Source data -> Mosaic Streaming (MDS) shards, once per content and settings.

``write_mds`` converts any source :mod:`prefect_sgpu.pipeline.sources` reads (parquet,
JSONL, CSV, numpy, a DataFrame, an iterable of dicts) with streaming's ``MDSWriter`` and
returns a :class:`ShardSet`, a small picklable description that GPU tasks take as input.
A set is complete or absent at every moment, and its completion marker records its
fingerprint (source content + settings): a later call that finds a complete set with
the same fingerprint reuses it, and the Prefect task ``prepare_mds`` adds Prefect's own
cache on top.

The package, one reason to change a file:

- :mod:`.shard_set` — ``ShardSet``, what ranks unpickle.
- :mod:`.settings` — checking ``columns``/``compression``/``size_limit``; the fingerprint.
- :mod:`.columns` — inferring column types and holding every row to them.
- :mod:`.progress` — the terminal progress bar and the Prefect progress artifact.
- :mod:`.storage` — local folders and ``s3://`` prefixes: the completion marker, reading a set back.
- :mod:`.writer` — ``write_mds``: converting, and putting a set in place complete or not at all.
- :mod:`.task` — ``prepare_mds``, the Prefect task, and its cache key.

Importing this package imports neither Prefect nor streaming (ranks unpickle
``ShardSet`` from here); ``prepare_mds`` is built on first access.
"""

from __future__ import annotations

from typing import Any, Callable

from prefect_sgpu.pipeline.mds import task
from prefect_sgpu.pipeline.mds.columns import ENCODING_OF_KIND, INFER_ROWS, infer_columns, kind_of
from prefect_sgpu.pipeline.mds.progress import ARTIFACT_AFTER_S, ARTIFACT_EVERY_S
from prefect_sgpu.pipeline.mds.settings import set_fingerprint
from prefect_sgpu.pipeline.mds.shard_set import ShardSet
from prefect_sgpu.pipeline.mds.storage import INDEX, MARKER, read_shard_set
from prefect_sgpu.pipeline.mds.task import mds_cache_key
from prefect_sgpu.pipeline.mds.writer import logger, write_mds

__all__ = [
    "ARTIFACT_AFTER_S", "ARTIFACT_EVERY_S", "ENCODING_OF_KIND", "INDEX", "INFER_ROWS", "MARKER", "ShardSet",
    "infer_columns", "kind_of", "logger", "mds_cache_key", "prepare_mds", "read_shard_set", "set_fingerprint",
    "write_mds",
]


def __getattr__(name: str) -> Any:
    """``prepare_mds`` (a Prefect task) is built on first use, so importing stays cheap."""
    if name == "prepare_mds":
        return task.prepare_mds
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


prepare_mds: Callable[..., ShardSet]  # for type checkers and readers; the value comes from __getattr__
