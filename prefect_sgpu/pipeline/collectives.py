"""The few collectives checkpoints and trainer callbacks share, each a no-op without a process group.

Saving and restoring are the same code on one process and on many: every helper here answers
for a single process when torch.distributed is not initialised, so callers never branch on it.
"""

from __future__ import annotations

from typing import Any


def dist_ready() -> bool:
    """Whether this process is in a torch.distributed process group (a single process is not)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def barrier(group: Any = None) -> None:
    """Every rank of ``group`` (None: the job's) is here; nothing to wait for without a process group."""
    if dist_ready():
        import torch.distributed as dist

        dist.barrier(group=group)


def from_rank_zero(value: Any) -> Any:
    """Rank 0's ``value`` on every rank, so all ranks act on the same decision."""
    if not dist_ready():
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def flag_group() -> Any:
    """A gloo group for small CPU flags (collective: every rank builds its Checkpointer); None when
    the job's own group is gloo already, or there is no process group."""
    if not dist_ready():
        return None
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")
