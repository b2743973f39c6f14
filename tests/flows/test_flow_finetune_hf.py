"""flows/finetune_hf.py end to end: ``transformers.Trainer`` on 2 nodes x 2 ranks, its checkpoints
sealed at the job's location, held-out perplexity, and an MLflow version that links to the run
holding the trainer's loss curve.

A retry resuming from the trainer's checkpoint is tested once, where it costs least:
``tests/pipeline/test_hf_trainer.py`` (a failed job and the next one on 2 nodes x 1 rank); the
flow-level Prefect retry of a GPU task is ``tests/flows/test_flow_finetune_llm.py``'s."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "flows"))

pytestmark = pytest.mark.e2e


def test_finetune_hf_on_two_nodes_of_two_ranks_seals_checkpoints_and_registers(prefect_server: None) -> None:
    import finetune_hf
    from mlflow.tracking import MlflowClient

    from prefect_sgpu.pipeline.checkpoint import complete_steps

    name = f"hf-{uuid.uuid4().hex[:8]}"
    state = finetune_hf.finetune_hf(gpus=4, nodes=2, steps=8, checkpoint_every=4, model_name=name,
                                    return_state=True)
    assert state.is_completed(), state
    out = state.result()

    assert out["start_step"] == 0 and out["global_step"] == 8
    location = Path(out["model_uri"]).parent.parent  # final/ sits beside the step folders
    assert complete_steps(location) == [4, 8], "both of the trainer's checkpoints were sealed as step folders"
    assert 1.0 < out["perplexity"] < 200, f"the model learned little: perplexity {out['perplexity']} (256 = uniform)"

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    version = client.get_model_version(name, out["version"])
    assert str(client.get_model_version_by_alias(name, "champion").version) == out["version"]
    run = client.get_run(version.run_id)
    assert run.data.metrics["perplexity"] == pytest.approx(out["perplexity"])
    assert run.data.params["trainer"] == "transformers.Trainer" and run.data.params["nodes"] == "2"
    # the trainer's own MLflow reporting reached the job's run (HF's callback reattached to MLFLOW_RUN_ID)
    assert run.data.params.get("max_steps") == "8", (sorted(run.data.params), run.data.metrics, run.info)
    assert {m.step for m in client.get_metric_history(version.run_id, "loss")} >= {6, 8}

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as prefect:
        task_runs = prefect.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        train_run = next(tr for tr in task_runs if tr.task_key.startswith("train_with_trainer"))
        assert train_run.run_count == 1 and train_run.state.is_completed()
        messages = [log.message for log in prefect.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=0)]
    started = sorted(m.split("]")[0] + "]" for m in messages if m.startswith("[rank ") and "world size 4" in m)
    assert started == [f"[rank {r} node {r // 2}]" for r in range(4)], f"2 nodes x 2 ranks: {started}"
