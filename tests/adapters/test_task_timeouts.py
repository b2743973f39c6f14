"""Prefect's own ``timeout_seconds`` on a GPU task: the task ends TimedOut, every rank is stopped, the
compute released and the job's MLflow run ended KILLED (the job's own limit is ``timeout=``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from prefect import flow

from prefect_sgpu import GPUTaskRunner, gpu_task

from support.conformance import LocalCase

pytestmark = pytest.mark.e2e

TIMEOUT_S = 30


@gpu_task(gpus=2, timeout_seconds=TIMEOUT_S, mlflow=True)
def sleeps(folder: str) -> int:
    from prefect_sgpu import runtime

    Path(folder, f"rank-{runtime.rank()}").write_text(os.environ["SGPU_RUN_ID"])
    time.sleep(600)
    return 0


def test_a_prefect_task_timeout_stops_every_rank_and_ends_the_mlflow_run_killed(
        prefect_server: None, tmp_path: Path) -> None:
    import mlflow

    jobs = Path(os.environ["PREFECT_SGPU_HOME"]) / "jobs"
    before = set(jobs.iterdir()) if jobs.exists() else set()

    @flow(task_runner=GPUTaskRunner())
    def times_out(folder: str) -> None:
        sleeps(folder)

    state = times_out(str(tmp_path), return_state=True)
    assert state.is_failed()
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        (task_run,) = client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    assert task_run.state.name == "TimedOut", task_run.state
    assert f"exceeded timeout of {TIMEOUT_S:.1f} second(s)" in task_run.state.message, task_run.state.message
    new = [p.name for p in set(jobs.iterdir()) - before]
    assert len(new) == 1, new
    run_id = new[0]
    assert LocalCase().leftovers(run_id) == [], "a rank, agent or control file outlived the task's timeout"
    runs = mlflow.search_runs(search_all_experiments=True, filter_string=f"tags.`sgpu.run_id` = '{run_id}'",
                              output_format="list")
    assert [r.info.status for r in runs] == ["KILLED"], runs
