"""``prepare_mds``: ``write_mds`` as a Prefect task, with Prefect's cache on top of set reuse.

The task is built on first access (module ``__getattr__``), so importing this package
imports neither Prefect nor streaming: ranks unpickle ``ShardSet`` from it.
"""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import Any, Callable

from prefect_sgpu.pipeline.mds.settings import set_fingerprint
from prefect_sgpu.pipeline.mds.shard_set import ShardSet
from prefect_sgpu.pipeline.mds.storage import is_remote, read_shard_set
from prefect_sgpu.pipeline.mds.writer import write_mds


def _output_key(output: Any) -> str:
    text = str(output)
    return text if is_remote(text) else str(Path(text).expanduser().absolute())


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

    # named as users import it: from the package, as before it was split into files
    prepare_mds.__module__ = __package__
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
