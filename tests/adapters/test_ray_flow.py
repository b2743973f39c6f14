"""The ray_digits flow end to end: a per-run Ray cluster, Ray Data + Ray Train, MLflow, the registry."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# @ray_launch clusters sit on the local compute's node addresses (127.0.0.1, 127.0.0.2): these
# modules share one xdist worker, so two such clusters never run at once (docs/testing.md)
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("ray-launch")]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "flows"))


def test_ray_digits_trains_logs_and_registers(prefect_server: None) -> None:
    from mlflow.tracking import MlflowClient

    import ray_digits

    # one node of four logical CPUs (two Ray Train workers, two for Ray Data): a joining node's start
    # and its idle Ray processes cost as much CPU as the training; Ray Train packs its workers on one
    # node anyway (PACK), and test_ray_launch.py shows nodes joining one cluster
    state = ray_digits.ray_digits(epochs=2, gpus=4, nodes=1, model_name="digits-cnn-test", min_accuracy=0.5,
                                  return_state=True)
    out = state.result()
    assert out["accuracy"] >= 0.5
    assert out["version"] >= 1

    client = MlflowClient()
    version = client.get_model_version("digits-cnn-test", str(out["version"]))
    run = client.get_run(version.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["test_accuracy"] == pytest.approx(out["accuracy"])
    assert len(client.get_metric_history(version.run_id, "loss")) == 2, "one loss point per epoch"

    import mlflow.pytorch
    import torch

    model = mlflow.pytorch.load_model(f"models:/digits-cnn-test/{out['version']}")
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)

    # the @ray_launch call inside a task counts as that run's GPU job, as a @gpu_task does
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, TaskRunFilter

    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])),
            flow_run_filter=FlowRunFilter(), task_run_filter=TaskRunFilter(), limit=50, offset=0)
    keys = {a.key for a in artifacts}
    assert {"sgpu-train-digits-job", "sgpu-train-digits-ranks", "sgpu-train-digits-progress"} <= keys, keys


def test_flow_module_imports_light() -> None:
    import subprocess

    code = ("import sys; sys.path.insert(0, 'flows'); import ray_digits; "
            "heavy = [m for m in ('torch', 'ray', 'mlflow', 'sklearn') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
