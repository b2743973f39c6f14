"""Inside a rank: who am I, which device is mine, where do checkpoints go.

Values come from torch elastic's environment (RANK, WORLD_SIZE, LOCAL_RANK,
GROUP_RANK, ...) and the launcher's own (SGPU_*), so these helpers also work in a
plain ``torchrun`` script and give single-process defaults outside any launcher.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Any


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


def node_rank() -> int:
    """The node's index in the job (torch elastic calls it GROUP_RANK)."""
    return _int("GROUP_RANK", _int("NODE_RANK", 0))


def is_rank_zero() -> bool:
    return rank() == 0


def run_id() -> str | None:
    return os.environ.get("SGPU_RUN_ID")


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


def checkpoint_dir() -> Path:
    """A folder shared by the job's ranks for checkpoints (created on demand)."""
    base = os.environ.get("SGPU_CHECKPOINT_DIR")
    path = Path(base) if base else Path(os.environ.get("SGPU_JOB_DIR", ".")) / "checkpoints"
    path.mkdir(parents=True, exist_ok=True)
    return path
