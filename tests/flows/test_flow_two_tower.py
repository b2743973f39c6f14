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


def test_two_tower_flow_beats_a_random_model_resumes_after_a_retry_and_logs_to_mlflow(prefect_server: None,
                                                                                       tmp_path: Path) -> None:
    import torch
    import two_tower

    fault = tmp_path / "fail-once"
    fault.write_text("rank 0 fails at the start of epoch 3, once; the retry resumes from last.ckpt")
    # 2 nodes x 1 rank: Lightning with num_nodes=2
    out = two_tower.two_tower(epochs=6, gpus=2, nodes=2, fault_file=str(fault), fault_epoch=3)

    assert out["world_size"] == 2 and out["evaluated"] >= 600
    recall, auc = out["recall_at_10"], out["auc"]
    assert math.isfinite(recall) and math.isfinite(auc)
    assert recall > 1.5 * out["random_recall_at_10"], f"recall@10 {recall} is no better than random"
    assert auc > 0.6, f"AUC {auc} is no better than random (0.5)"
    assert not fault.exists(), "the injected fault fired"
    assert out["start_epoch"] == 3, "the Prefect retry resumed from Lightning's last.ckpt of epoch 2"
    assert len(out["train_losses"]) == 3, "the retry trained epochs 3-5 only"
    assert Path(out["model_path"]).is_file()
    last = torch.load(out["lightning_checkpoint"], map_location="cpu", weights_only=True)
    assert last["epoch"] == 5, "ModelCheckpoint kept the last epoch, loadable weights-only"

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run = client.get_run(out["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["recall_at_10"] == pytest.approx(recall)
    assert run.data.metrics["auc"] == pytest.approx(auc)
    assert run.data.params["world_size"] == "2" and run.data.params["nodes"] == "2"
    history = client.get_metric_history(out["mlflow_run_id"], "train_loss")
    assert [m.step for m in history] == [3, 4, 5], "Lightning's MLFlowLogger logs one loss per epoch, once"
    first_attempt = [r for r in client.search_runs([run.info.experiment_id])
                     if r.info.run_id != run.info.run_id and r.data.tags.get("prefect.task_run_id")
                     == run.data.tags.get("prefect.task_run_id")]
    losses = [m.value for r in first_attempt for m in client.get_metric_history(r.info.run_id, "train_loss")]
    losses += [m.value for m in history]
    assert losses[-1] < losses[0], f"training loss did not go down: {losses}"
