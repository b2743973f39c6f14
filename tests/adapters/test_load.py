"""Concurrent jobs on one machine: from one driver, from two driver processes, through a work pool
with two workers; every job gets its own ranks' values (full size: ``./dev bench load``)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from support import load

# many drivers and jobs at once: these take the machine, so they never overlap each other
# (one xdist worker runs the group, one test after the other: docs/testing.md)
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("whole-machine")]


def test_jobs_of_one_driver_and_of_a_second_driver_process_at_once_never_cross(tmp_path: Path) -> None:
    other = load.start_driver(3, "other", tmp_path / "other.json")  # a second driver process, meanwhile
    mine = load.submit_jobs(3, "mine")
    out, _ = other.communicate(timeout=900)
    assert other.returncode == 0, out.decode(errors="replace")[-3000:]
    theirs = json.loads((tmp_path / "other.json").read_text())
    assert mine["problems"] == [] and theirs["problems"] == [], (mine, theirs)
    assert (mine["jobs"], theirs["jobs"]) == (3, 3)


def test_flow_runs_queued_in_an_sgpu_pool_with_two_workers_all_complete_with_their_own_values(
        prefect_on_postgres: str, postgres_cluster: Any) -> None:
    """On a Prefect server whose database is PostgreSQL, as a production user runs Prefect (its
    SQLite default serialises every write: many workers and flow runs at once wait on its lock)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # 3 runs for 2 workers of one run each: at least one run waits in the queue for a worker to free up
    with temporary_settings({PREFECT_API_URL: prefect_on_postgres}):
        report = load.pool_runs(f"sgpu-load-{uuid.uuid4().hex[:8]}", runs=3, workers=2, limit=1, timeout_s=900)
    assert report["problems"] == [], report
    # the runs, their states and their deployment are rows of the PostgreSQL database
    rows = postgres_cluster.query("prefect", "SELECT id::text, state_type::text FROM flow_run WHERE id = ANY($1::uuid[])",
                                  report["flow_run_ids"])
    assert sorted(rows) == sorted((i, "COMPLETED") for i in report["flow_run_ids"]), rows
