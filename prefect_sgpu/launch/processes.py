"""Node programs' name for the shared process helpers, which live in :mod:`prefect_sgpu.procs.processes`."""

from prefect_sgpu.procs.processes import become_subreaper, kill_and_reap, node_log

__all__ = ["become_subreaper", "kill_and_reap", "node_log"]
