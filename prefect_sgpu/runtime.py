"""Inside a rank: who am I, which device is mine, where do checkpoints go.

Values come from torch elastic's environment (RANK, WORLD_SIZE, LOCAL_RANK,
GROUP_RANK, ...) and the launcher's own (SGPU_*), so these helpers also work in a
plain ``torchrun`` script and give single-process defaults outside any launcher.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Any, Callable


def _int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def rank() -> int:
    return _int("RANK", 0)


def world_size() -> int:
    return _int("WORLD_SIZE", 1)


def local_rank() -> int:
    return _int("LOCAL_RANK", 0)


def local_world_size() -> int:
    return _int("LOCAL_WORLD_SIZE", 1)


def restart_count() -> int:
    """Worker-group restarts after a failure on this node so far (torch elastic's, up to ``max_restarts``).
    A membership change of an elastic job restarts the ranks too, but is not counted here: see
    :func:`world_size_changed`."""
    return _int("TORCHELASTIC_RESTART_COUNT", 0)


def membership_round() -> int | None:
    """The rendezvous round this rank runs in: 0 (or the first this job reached) when the ranks first
    started; one more at each restart, a node joining an elastic job's next round included. The same
    on every rank of a round. None outside a prefect-sgpu node."""
    value = os.environ.get("SGPU_MEMBERSHIP_ROUND", "")
    return int(value) if value.isdigit() else None


def previous_world_size() -> int | None:
    """The job's world size in its previous round (ranks on every node then), or None in its first round
    (or outside a prefect-sgpu node). The same on every rank of a round, a node that has just joined
    included. Nodes run the same number of ranks each, so it is the previous round's node count times
    :func:`local_world_size`."""
    nodes = os.environ.get("SGPU_PREVIOUS_NODES", "")
    return int(nodes) * local_world_size() if nodes.isdigit() else None


def world_size_changed() -> bool:
    """True when this round's world size differs from the previous round's: an elastic job
    (``nodes=(min, max)``) grew as a node joined. The ranks were restarted for it: restore the last
    checkpoint and rescale what depends on the world size (per-rank batch, learning rate, data shards).
    False in a job's first round, after a restart that kept every node, and outside a prefect-sgpu node."""
    previous = previous_world_size()
    return previous is not None and previous != world_size()


def node_rank() -> int:
    """The node's index in the job (torch elastic calls it GROUP_RANK)."""
    return _int("GROUP_RANK", _int("NODE_RANK", 0))


def is_rank_zero() -> bool:
    return rank() == 0


def run_id() -> str | None:
    return os.environ.get("SGPU_RUN_ID")


def instance_id() -> str | None:
    """The cloud instance this rank runs on (EC2: ``i-...``), None for local processes."""
    return os.environ.get("SGPU_INSTANCE_ID")


def uses_gpu() -> bool:
    """True when the launcher gave this rank a GPU (or, outside it, one is visible)."""
    forced = os.environ.get("SGPU_DEVICE")
    if forced:
        return forced == "cuda"
    import torch

    return torch.cuda.is_available()


def device() -> Any:
    """This rank's ``torch.device``: its own GPU, or the CPU."""
    import torch

    if uses_gpu():
        torch.cuda.set_device(local_rank())
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def default_timeout() -> _dt.timedelta:
    """Collective timeout: long enough for a slow step, short enough not to hang for 30 min."""
    return _dt.timedelta(seconds=float(os.environ.get("SGPU_COLLECTIVE_TIMEOUT_S", 600)))


def init_process_group(backend: str | None = None, timeout: _dt.timedelta | None = None) -> str:
    """Join the job's process group: nccl on GPUs, gloo on CPU, explicit timeouts.

    Safe to call twice. Returns the backend in use.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return str(dist.get_backend())
    backend = backend or ("nccl" if uses_gpu() else "gloo")
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout or default_timeout()}
    if backend == "nccl":
        kwargs["device_id"] = device()
    dist.init_process_group(**kwargs)
    return backend


def checkpoint_uri() -> str:
    """Where this job's checkpoints live: a folder, or an ``s3://`` prefix on the job store.

    It outlives the nodes: a relaunch after a lost node, or a Prefect retry of the same
    task, sees the same location. Use it with ``torch.distributed.checkpoint`` through
    fsspec, or let :class:`~prefect_sgpu.pipeline.checkpoint.Checkpointer` handle it.
    """
    from prefect_sgpu.checkpoints import location_uri

    return location_uri()


def checkpoint_dir() -> Path:
    """A local folder for checkpoints, created on demand.

    With a local location (the local compute) it *is* the location, shared by every rank
    and kept across relaunches and retries. With an ``s3://`` location it is this node's
    stage of it, which goes away with the node: use a ``Checkpointer`` (which uploads
    each step and restores it on new nodes), or ``checkpoint_uri()``, for files that must
    survive the node.
    """
    from prefect_sgpu.checkpoints import Location

    return Location().ensure_local()


# --- signals between a rank and its node ------------------------------------------------

#: written in the node's job folder by the node when the cloud announced it will reclaim it
PREEMPT_FILE = "preempt"
#: written in the node's job folder by the node when the cloud recommended moving work off it (a
#: rebalance recommendation: a warning, not a reclaim)
REBALANCE_FILE = "rebalance"
#: written in the node's job folder by the node when the driver asks for a final checkpoint before it
#: stops the job (a cost cap: ``Heartbeat.checkpoint``); a checkpointer saves at once, as on a reclaim notice
FINAL_CHECKPOINT_FILE = "final-checkpoint"
#: one file per rank (``progress/rank-N``): what the hang watchdog reads
PROGRESS_DIR = "progress"
_PROGRESS_EVERY_S = 1.0
_last_progress = [0.0]
_progress_total: list[int | None] = [None]  # the last total given: later calls without one keep it
_first_step = [0.0]  # when this rank reported its first step (wall clock; 0: none yet): the job's timeline
#: where a rank's progress goes besides its node's job folder: a Ray worker has no job folder and
#: tells the driver through the job's collector instead (``prefect_sgpu.ray.train_worker``)
_progress_listeners: list[Callable[[int | None], None]] = []


def add_progress_listener(listener: Callable[[int | None], None]) -> Callable[[], None]:
    """Call ``listener(step)`` on each progress this rank reports (at most once a second);
    returns the function that removes it again."""
    _progress_listeners.append(listener)
    return lambda: _progress_listeners.remove(listener) if listener in _progress_listeners else None


def finished_marker(job_dir: Path, rank_: int) -> Path:
    """Where a rank that returned from the job's function leaves its pid. A rank forked by torch
    elastic stays alive after that until every rank of its node returned (its value travels
    back through a queue): the hang watchdog must not take its silence for a hang."""
    return job_dir / PROGRESS_DIR / f"rank-{rank_}.done"


def _job_dir() -> Path | None:
    value = os.environ.get("SGPU_JOB_DIR")
    return Path(value) if value else None


def _job_file(name: str, empty: str) -> str | None:
    """The text of the node's file ``name`` in this rank's job folder (``empty`` when it has none), or None."""
    job_dir = _job_dir()
    if job_dir is None:
        return None
    try:
        return (job_dir / name).read_text().strip() or empty
    except FileNotFoundError:
        return None


def preemption_notice() -> str | None:
    """The reclaim notice this node received (a spot interruption), or None; a
    rebalance recommendation is not one (:func:`rebalance_recommendation`)."""
    return _job_file(PREEMPT_FILE, "reclaim notice")


def rebalance_recommendation() -> str | None:
    """The rebalance recommendation this node received, or None. A warning only: the cloud may
    reclaim the node later, or never; the job is not relaunched for it."""
    return _job_file(REBALANCE_FILE, "rebalance recommendation")


def final_checkpoint_requested() -> str | None:
    """Why the driver asked this node's ranks for a final checkpoint before it stops the job (its cost
    cap), or None. Not a reclaim: the node stays until the driver stops the job."""
    return _job_file(FINAL_CHECKPOINT_FILE, "final checkpoint")


def preemption_requested() -> bool:
    """True once this node has been told it will be taken away: save now, the job is relaunched."""
    return preemption_notice() is not None


def progress(step: int | None = None, *, total: int | None = None, force: bool = False) -> None:
    """Tell the hang watchdog this rank is making progress (at most one write a second).

    ``Checkpointer.due``/``save`` call it at every step; output a rank prints counts too.
    With ``total`` (the steps the rank will run), rank 0's ``step / total`` is what a GPU
    task's progress artifact shows in the Prefect UI. Every rank's steps, with the time it
    reported them, are what the driver's straggler watch measures step rates from
    (``straggler_factor``); ``force=True`` writes every call.
    """
    import time

    if total is not None:
        _progress_total[0] = int(total)
    total = _progress_total[0]
    job_dir = _job_dir()
    now = time.time()
    if step is not None and not _first_step[0]:
        _first_step[0] = now
    if (job_dir is None and not _progress_listeners) or (not force and now - _last_progress[0] < _PROGRESS_EVERY_S):
        return
    _last_progress[0] = now
    for listener in list(_progress_listeners):
        listener(step)
    if job_dir is None:
        return
    path = job_dir / PROGRESS_DIR / f"rank-{rank()}"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    # "pid step total time first" (total 0: not given); the time is what the driver's step rates follow,
    # first (when the rank reported its first step) what the job's timeline shows
    line = (f"{os.getpid()}" if step is None
            else f"{os.getpid()} {int(step)} {int(total or 0)} {now:.3f} {_first_step[0]:.3f}")
    tmp.write_bytes(_sealed_progress(job_dir, line))
    os.replace(tmp, path)


def _sealed_progress(job_dir: Path, line: str) -> bytes:
    """The progress file: the line, and the line sealed with the rank's progress key (the driver acts
    on the sealed line only: :mod:`prefect_sgpu.protocol.rank_progress`)."""
    from prefect_sgpu.protocol import rank_progress
    from prefect_sgpu.protocol.jobfolder import GANG_ENV

    gang = os.environ.get(GANG_ENV, "")
    return rank_progress.file_bytes(line, os.environ.get(rank_progress.KEY_ENV, ""),
                                    Path(os.path.abspath(job_dir)).name, rank(), int(gang) if gang.isdigit() else 0)
