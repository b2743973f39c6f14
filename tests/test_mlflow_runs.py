"""One MLflow run per call, handed to every rank, ended to match the outcome."""

from __future__ import annotations

import os

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from prefect_sgpu import distributed, runtime

pytestmark = pytest.mark.e2e


@distributed(gpus=2)
def log_from_rank_zero(steps: int) -> str:
    import mlflow as ml

    run_id = os.environ["MLFLOW_RUN_ID"]  # mlflow unsets it once a rank resumes the run
    if runtime.is_rank_zero():
        for step in range(steps):
            ml.log_metric("loss", 1.0 / (step + 1), step=step)
    return run_id


def test_ranks_log_into_the_calls_run_which_ends_finished() -> None:
    result = log_from_rank_zero.run(3)
    run_ids = set(result.values)
    assert run_ids == {result.mlflow_run_id}
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [1.0, 0.5, 1 / 3]
    assert run.data.params["sgpu.gpus"] == "2"
    assert run.data.tags["sgpu.run_id"] == result.run_id


def test_call_inside_an_active_run_is_nested() -> None:
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    with mlflow.start_run(run_name="sweep") as parent:
        result = log_from_rank_zero.run(1)
    child = MlflowClient().get_run(result.mlflow_run_id)
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.info.experiment_id == parent.info.experiment_id


def test_failed_call_ends_its_run_failed() -> None:
    @distributed(gpus=2)
    def fails() -> None:
        raise ValueError("bad batch")

    job = fails.job()
    with pytest.raises(ValueError, match="bad batch"):
        job.run()
    run = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(job.tracked.run_id)
    assert run.info.status == "FAILED"
