"""Stopping what a job started: the last step every process-owning part shares."""

from __future__ import annotations

from typing import Any


def kill_and_reap(processes: list[Any], timeout: float = 5.0) -> None:
    """SIGKILL every ``psutil.Process`` still alive and wait up to ``timeout`` for them to go."""
    import psutil

    for proc in processes:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=timeout)
