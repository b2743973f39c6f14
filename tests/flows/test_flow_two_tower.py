"""flows/two_tower.py end to end: MDS shards -> Lightning DDP on 2 simulated nodes -> held-out metrics in MLflow."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "flows"))

pytestmark = pytest.mark.e2e


def test_two_tower_flow_beats_a_random_model_and_logs_to_mlflow(prefect_server: None) -> None:
    import two_tower

    out = two_tower.two_tower(epochs=6, gpus=2, nodes=2)  # 2 nodes x 1 rank: Lightning with num_nodes=2

    assert out["world_size"] == 2 and out["evaluated"] >= 600
    recall, auc = out["recall_at_10"], out["auc"]
    assert math.isfinite(recall) and math.isfinite(auc)
    assert recall > 1.5 * out["random_recall_at_10"], f"recall@10 {recall} is no better than random"
    assert auc > 0.6, f"AUC {auc} is no better than random (0.5)"
    losses = out["train_losses"]
    assert len(losses) == 6 and losses[-1] < losses[0], f"training loss did not go down: {losses}"
    assert Path(out["model_path"]).is_file()

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run = client.get_run(out["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["recall_at_10"] == pytest.approx(recall)
    assert run.data.metrics["auc"] == pytest.approx(auc)
    assert run.data.params["world_size"] == "2" and run.data.params["nodes"] == "2"
    history = client.get_metric_history(out["mlflow_run_id"], "train_loss")
    assert [m.step for m in history] == list(range(6)), "rank 0 alone logs one loss per epoch"
