"""Finding what a job left running."""

from __future__ import annotations

import time
from pathlib import Path


def job_processes(run_id: str) -> list[str]:
    """Command lines of live processes that belong to a job (its run id is in their argv)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if run_id in cmd and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(f"{proc.pid}: {cmd}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_gone(marker: str, timeout: float = 30.0) -> list[str]:
    """Wait until no live process carries ``marker`` in its argv; what is still there at the timeout.

    A killed PID namespace's init ends only after the kernel has killed and reaped everything
    else in it, so the holder that started it can be gone while it is still exiting."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        left = job_processes(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def default_sigint() -> None:
    """``preexec_fn`` for a child that must turn Ctrl-C, SIGTERM and SIGHUP into KeyboardInterrupt.

    Python leaves SIGINT ignored in a process started with it ignored, as every child of
    a test run started in the background of a non-interactive shell (CI) is; SIGHUP is
    ignored under ``nohup``. The driver takes over only signals still at their default,
    so the child starts with all three there, as in a terminal.
    """
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def warm_node_pids() -> list[int]:
    """Warm node processes of this test session (its PREFECT_SGPU_HOME), not their namespace wrappers."""
    import os

    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            home = (proc.info["environ"] or {}).get("PREFECT_SGPU_HOME")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if ("prefect_sgpu.launch.warm_node" in cmd and home == os.environ["PREFECT_SGPU_HOME"]
                and "unshare" not in (proc.info["cmdline"] or [""])[0]):  # the node, not its namespace's wrapper
            found.append(proc.pid)
    return found


#: forks and lets its parent exit, over and over (no pid lives 10 ms); each generation adds a byte to argv[1]
HOPPER = """
import os, sys, time
with open(sys.argv[1], "ab", buffering=0) as out:
    while True:
        out.write(b".")
        time.sleep(0.002)
        if os.fork():
            os._exit(0)
"""


def still_growing(path: Path, wait: float = 0.5) -> bool:
    """Did a hopper write to ``path`` in the last ``wait`` seconds?"""
    before = path.stat().st_size
    time.sleep(wait)
    return path.stat().st_size != before


def remove_machine_cgroups(machine_id: str) -> None:
    """The job cgroups a simulated machine's bootstrap made and did not remove (it was killed with its
    machine): on a real VM they go with it; here they are this host's, below this process's own cgroup
    (the bootstrap's names start with ``sgpu-<machine id>-``)."""
    from prefect_sgpu.launch.job_cgroup import JobCgroup, cgroup2_root, own_cgroup

    root, own = cgroup2_root(), own_cgroup()
    if root is None or own is None:
        return
    for path in (root / own.lstrip("/")).glob(f"sgpu-{machine_id}-*"):
        JobCgroup(path).kill(timeout=5)
