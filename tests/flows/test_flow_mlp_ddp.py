"""flows/mlp_ddp.py end to end: a Prefect flow, DDP over 2 nodes, loss in MLflow."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "flows"))

pytestmark = pytest.mark.e2e


def test_mlp_ddp_flow_trains_and_logs_loss(prefect_server: None) -> None:
    import mlp_ddp

    result = mlp_ddp.train_mlp.with_options(gpus=4, nodes=2).run(num_epochs=4, batch_size=128)
    assert len({v["loss"] for v in result.values}) == 1, "every rank reports the same all-reduced loss"
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    losses = [m.value for m in client.get_metric_history(result.mlflow_run_id, "loss")]
    assert len(losses) == 4
    assert losses[-1] < losses[0] * 0.7, f"loss did not go down: {losses}"
    run = client.get_run(result.mlflow_run_id)
    assert run.data.params["world_size"] == "4" and run.info.status == "FINISHED"

    final = mlp_ddp.mlp_ddp(num_epochs=2, gpus=2, nodes=1)
    assert final["loss"] > 0 and final["start_epoch"] == 0


@pytest.mark.parametrize("pace_s", [-1, 7200, "1"])
def test_a_pace_outside_0_to_3600_seconds_is_refused_naming_it_before_any_process_group(pace_s: object) -> None:
    import mlp_ddp

    with pytest.raises(ValueError, match=r"pace_s=.*a number from 0 to 3600"):
        mlp_ddp.train_mlp.func(num_epochs=1, pace_s=pace_s)
