"""flows/finetune_hf.py end to end: ``transformers.Trainer`` on 2 nodes x 2 ranks, a failure and a
Prefect retry that resumes from the trainer's sealed checkpoint, held-out perplexity, and an MLflow
version that links to the run holding the trainer's loss curve."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "flows"))

pytestmark = pytest.mark.e2e


def test_finetune_hf_on_two_nodes_of_two_ranks_resumes_after_a_retry_and_registers(prefect_server: None,
                                                                                   tmp_path: Path) -> None:
    import finetune_hf
    from mlflow.tracking import MlflowClient

    name = f"hf-{uuid.uuid4().hex[:8]}"
    fault = tmp_path / "fail-once"
    fault.write_text("rank 0 fails after step 5, once; the retry resumes from step 4")
    state = finetune_hf.finetune_hf(gpus=4, nodes=2, steps=8, checkpoint_every=4, model_name=name,
                                    fault_file=str(fault), fault_step=5, return_state=True)
    assert state.is_completed(), state
    out = state.result()

    assert not fault.exists(), "the injected fault fired"
    assert out["start_step"] == 4, "the Prefect retry resumed from the trainer's step-4 checkpoint"
    assert out["global_step"] == 8
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
        assert train_run.run_count == 2 and train_run.state.is_completed()
        messages = [log.message for log in prefect.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=0)]
    assert any("injected fault after step 5" in m for m in messages)
    assert sum("resuming from step-00000004" in m for m in messages) == 4, "every rank of both nodes resumed"
