"""Finding what a job left running."""

from __future__ import annotations


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
