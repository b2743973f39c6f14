"""Inside a rank: this rank's share of an MDS shard set, resumable mid-epoch.

Mosaic Streaming reads RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, which torch
elastic sets in every rank, and places ranks on nodes as ``rank // local_world_size``
(torch elastic numbers ranks node by node). Each rank gets a disjoint part of every
epoch; the partition depends on ``batch_size``, so pass the per-rank batch size here
and to the loader.

Shared memory: streaming coordinates the ranks of one node through ``/dev/shm``, and a
crashed run leaves its blocks behind, which makes the next run on that node fail or
hang. The first dataset a process builds first cleans stale blocks — done by local
rank 0 while the node's other ranks wait (streaming's own collective helper, called by
every rank). Simulated nodes on one host do not collide: the local compute gives each
node its own ``/dev/shm``.

Every set's ``index.json`` is checked before Streaming turns its shard names into paths
(:mod:`.shard_index`): a name that would lead outside the set's folder or the cache is
refused, with nothing read or downloaded.

Remote sets (``s3://...``) are downloaded to a local cache that is per job and per
node: under the job folder when the launcher set one, else under the temp dir keyed by
the torch elastic run id. Local sets are read in place.

This module imports no Prefect and nothing heavy at import time.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from prefect_sgpu.pipeline.shard_index import INDEX, check_dataset, check_index_file, fetch_checked_index

_cleaned_stale_shm = False


def _uri_of(uri: Any) -> str:
    """A ShardSet (anything with ``.uri``) or a path/URI string."""
    return str(getattr(uri, "uri", uri))


def _is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def cache_dir(uri: str) -> Path:
    """Where this node keeps downloaded shards of ``uri`` for the current job."""
    key = hashlib.sha256(uri.encode()).hexdigest()[:16]
    node = os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0"))
    job_dir = os.environ.get("SGPU_JOB_DIR")
    if job_dir:
        base = Path(job_dir) / "mds-cache"
    else:
        run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SGPU_RUN_ID") or f"pid-{os.getpid()}"
        base = Path(tempfile.gettempdir()) / "sgpu-mds-cache" / run
    return base / f"node-{node}" / key


def _compressed(index: Any) -> bool:
    """Does this (checked) MDS index describe compressed shards?"""
    shards = index.get("shards") if isinstance(index, dict) else None
    return isinstance(shards, list) and any(isinstance(s, dict) and s.get("compression") for s in shards)


def clean_stale_shared_memory() -> None:
    """Remove shared memory a crashed run left on this node; once per process.

    Every rank must call it (local rank 0 cleans, the rest wait at a barrier), and
    before any dataset of this process exists: cleaning later would pull the blocks
    from under a live dataset.
    """
    global _cleaned_stale_shm
    if _cleaned_stale_shm:
        return
    from streaming.base.util import clean_stale_shared_memory as clean

    clean()
    _cleaned_stale_shm = True


def streaming_dataset(uri: Any, *, batch_size: int, shuffle: bool = True, seed: int = 0,
                      local: str | os.PathLike[str] | None = None, **kw: Any) -> Any:
    """A ``StreamingDataset`` of this rank's share of the MDS set at ``uri``.

    ``uri``: a :class:`~prefect_sgpu.pipeline.mds.ShardSet`, a local folder or a remote
    URI. ``batch_size`` is the per-rank batch size (streaming partitions by it, and a
    resumed run needs the same). ``local``: cache folder for a remote set (default: per
    job and node; compressed local sets use it too). Other keywords go to ``StreamingDataset`` (``num_canonical_nodes``,
    ``predownload``, ``shuffle_algo``, ``epoch_size``, ...).
    """
    from prefect_sgpu.errors import SGPUConfigError

    if not isinstance(batch_size, int) or batch_size < 1:
        raise SGPUConfigError("batch_size", batch_size, "a positive int (the per-rank batch size)")
    text = _uri_of(uri)
    split = kw.get("split")
    if _is_remote(text):
        remote: str | None = text
        local_dir = str(local) if local is not None else str(cache_dir(text))
    else:
        path = Path(text.removeprefix("file://")).expanduser().absolute()
        index_file = path / (split or "") / INDEX
        if not index_file.is_file():
            raise SGPUConfigError("uri", text, "a complete MDS shard set (a folder with index.json)")
        if _compressed(check_index_file(index_file, str(index_file))):
            # decompressed into this node's cache, never beside the set
            remote = str(path)
            local_dir = str(local) if local is not None else str(cache_dir(remote))
        else:
            remote, local_dir = None, str(path)
    if remote is not None:  # Streaming finds the checked index in the cache and fetches none
        fetch_checked_index(remote, local_dir, split, kw.get("download_timeout"))
    clean_stale_shared_memory()
    from streaming import StreamingDataset

    dataset = StreamingDataset(remote=remote, local=local_dir, batch_size=batch_size, shuffle=shuffle,
                               shuffle_seed=seed, **kw)
    check_dataset(dataset)  # what Streaming parsed, before any shard is fetched
    return dataset


def streaming_loader(uri: Any, batch_size: int, *, state: dict[str, Any] | None = None, shuffle: bool = True,
                     seed: int = 0, local: str | os.PathLike[str] | None = None, num_workers: int = 0,
                     dataset_options: dict[str, Any] | None = None, **loader_kw: Any) -> Any:
    """A ``StreamingDataLoader`` over :func:`streaming_dataset`, resumed from ``state`` if given.

    ``state`` is what ``loader.state_dict()`` returned (on rank 0) in an earlier run:
    the new loader continues that epoch where it stopped, without repeating or losing
    samples (every rank must load the same state). Extra keywords go to the DataLoader
    (``collate_fn``, ``pin_memory``, ...); ``dataset_options`` to the dataset.
    """
    from streaming import StreamingDataLoader

    dataset = streaming_dataset(uri, batch_size=batch_size, shuffle=shuffle, seed=seed, local=local,
                                **(dataset_options or {}))
    loader = StreamingDataLoader(dataset, batch_size=batch_size, num_workers=num_workers, **loader_kw)
    if state:
        loader.load_state_dict(state)
    return loader
