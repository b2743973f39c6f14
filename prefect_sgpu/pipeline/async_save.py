"""The background half of ``Checkpointer(async_save=True)``.

The training loop pays only for a copy of the state to CPU memory (for FSDP2, torch DCP's own
``async_save`` stages it); writing the files, sending each node's part to an ``s3://`` location,
the barrier and rank 0's sealed ``COMPLETE`` marker run in a thread. The thread's collectives go
over a gloo group of their own, so they never interleave with the loop's collectives on the job's
group. A checkpoint is still complete or absent: the marker is written last, so a rank killed in
the middle of a background save leaves the previous complete checkpoint the newest one.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from typing import Any, Callable

logger = logging.getLogger("prefect_sgpu.checkpoints")


def cpu_copy(value: Any) -> Any:
    """``value`` with every tensor copied to CPU memory and containers rebuilt: what the training
    loop changes next cannot reach it."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        copied = {k: cpu_copy(v) for k, v in value.items()}
        if type(value) is dict:
            return copied
        try:
            return type(value)(copied)  # an OrderedDict (a module's state dict) stays one
        except TypeError:
            return copied
    if isinstance(value, list):
        return [cpu_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(cpu_copy(v) for v in value)
    return value


def save_group() -> Any:
    """A gloo group for the background saves alone (collective: every rank builds its Checkpointer);
    None without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")


_pending: "set[BackgroundSave]" = set()
_pending_lock = threading.Lock()


def wait_all() -> None:
    """Wait for every background save of this process (the rank's function has returned); raise the
    first error one of them raised."""
    with _pending_lock:
        pending = sorted(_pending, key=lambda s: s.step)
    for save in pending:
        save.wait()


class BackgroundSave:
    """One checkpoint being written by a thread; ``wait()`` ends with it and raises what it raised."""

    def __init__(self, step: int, work: Callable[[], None]) -> None:
        self.step = step
        self.error: BaseException | None = None

        def run() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - raised by wait(), in the training loop
                logger.error("the background checkpoint of step %d failed: %s", step, exc)
                self.error = exc

        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(run,),
                                        name=f"sgpu-checkpoint-{step}")
        with _pending_lock:
            _pending.add(self)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()
        with _pending_lock:
            _pending.discard(self)
        if self.error is not None:
            error, self.error = self.error, None  # raised once
            raise error
