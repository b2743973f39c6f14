"""flows/finetune_llm.py end to end: MDS -> DDP training with a failure and a resumed retry ->
held-out perplexity -> MLflow version with ``candidate``/``champion`` that reproduces the metric."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from prefect_sgpu.errors import SGPUConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "flows"))

pytestmark = pytest.mark.e2e


def test_finetune_llm_trains_resumes_after_a_retry_and_registers_a_champion(prefect_server: None,
                                                                              tmp_path: Path) -> None:
    import mlflow
    import finetune_llm

    name = f"llm-{uuid.uuid4().hex[:8]}"
    fault = tmp_path / "fail-once"
    fault.write_text("rank 0 fails at step 9, once; the retry resumes from step 6")
    state = finetune_llm.finetune_llm(strategy="ddp", gpus=2, nodes=1, steps=12, checkpoint_every=6,
                                      model_name=name, fault_file=str(fault), fault_step=9, return_state=True)
    assert state.is_completed(), state
    out = state.result()

    assert not fault.exists(), "the injected fault fired"
    assert out["start_step"] == 6, "the Prefect retry resumed from the step-6 checkpoint, not from scratch"
    assert out["strategy"] == "ddp"
    from prefect_sgpu.pipeline.checkpoint import load_model

    assert Path(out["model_uri"]).is_file(), "training handed on where the weights are, not the weights"
    assert set(load_model(out["model_uri"])) >= {"transformer.wte.weight"}
    assert 1.0 < out["perplexity"] < 128, f"the model learned little: perplexity {out['perplexity']} (256 = uniform)"

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    version = client.get_model_version(name, out["version"])
    assert str(client.get_model_version_by_alias(name, "champion").version) == out["version"]
    assert str(client.get_model_version_by_alias(name, "candidate").version) == out["version"]
    run = client.get_run(version.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["perplexity"] == pytest.approx(out["perplexity"])
    assert run.data.metrics["train_loss"] == pytest.approx(out["train_loss"])
    assert run.data.params["strategy"] == "ddp" and run.data.params["steps"] == "12"
    curve = client.get_metric_history(version.run_id, "train_loss")
    assert 12 in {m.step for m in curve}, "the version links to the training run, which holds the loss curve"

    champion = mlflow.pytorch.load_model(f"models:/{name}@champion")
    again = finetune_llm.perplexity(champion, finetune_llm.load_blocks(out["heldout"]))
    assert again == pytest.approx(out["perplexity"], rel=1e-6), "the registered model reproduces the metric"

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as prefect:
        task_runs = prefect.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        train_run = next(tr for tr in task_runs if tr.task_key.startswith("train_lm"))
        assert train_run.run_count == 2 and train_run.state.is_completed()
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

        from prefect.client.schemas.sorting import ArtifactSort

        failed, progress = prefect.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["sgpu-train-lm-progress"]), task_run_id={"any_": [train_run.id]}),
            sort=ArtifactSort.CREATED_DESC, limit=10, offset=0)[::-1]
        assert "failed at step" in failed.description and float(failed.data) < 100.0, failed
        assert float(progress.data) == 100.0 and "of 12)" in progress.description, progress
        messages = [log.message for log in prefect.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=0)]
    assert any("injected fault at step 9" in m for m in messages)
    assert "[rank 0 node 0] resuming from the checkpoint of step 6" in messages


def test_bad_strategy_fails_before_anything_starts(prefect_server: None) -> None:
    import finetune_llm

    with pytest.raises(SGPUConfigError, match="strategy='zero3'"):
        finetune_llm.finetune_llm(strategy="zero3", gpus=2, nodes=1)
