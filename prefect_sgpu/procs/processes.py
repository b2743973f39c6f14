"""What every node program shares: its log line, and stopping what a job started."""

from __future__ import annotations

from typing import Any


def node_log(message: str) -> None:
    """One line of a remote node's own log (its console; on EC2 the instance's console output)."""
    print(f"[sgpu-bootstrap] {message}", flush=True)


def kill_and_reap(processes: list[Any], timeout: float = 5.0) -> None:
    """SIGKILL every ``psutil.Process`` still alive and wait up to ``timeout`` for them to go."""
    import psutil

    for proc in processes:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=timeout)


_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphans of this process's descendants become its children (Linux), so a job's
    left-behind processes can be found and killed after it, whatever session they started."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
