"""Functions the tests run on every rank, shared by test modules of several computes."""

from __future__ import annotations

from prefect_sgpu import runtime


class TrainingDiverged(Exception):
    """Raised inside a rank; the caller gets this very type back."""


def fails_on_rank_1() -> int:
    """Rank 1 raises; every other rank waits in a barrier until the driver stops its node."""
    runtime.init_process_group()
    if runtime.rank() == 1:
        raise TrainingDiverged("loss is nan on rank 1")
    import torch.distributed as dist

    dist.barrier()  # rank 0 waits here until its node is stopped
    return runtime.rank()


def progress_on_rank_0_silence_on_rank_1(seconds: float) -> int:
    """Rank 0 reports progress (and prints nothing) for ``seconds``; rank 1 sleeps without a word."""
    import time

    if runtime.rank() == 1:
        time.sleep(600)
    for step in range(int(seconds * 4)):
        runtime.progress(step)
        time.sleep(0.25)
    return runtime.rank()
