"""What a Prefect user sees of a GPU task on a real temporary server: the library's log lines in
the task run's logs, keyed artifacts (ranks table, MLflow reference), lifecycle events, GPU quotas."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from prefect import flow

from prefect_sgpu import GPUTaskRunner, SGPUConfigError, gpu_task
from prefect_sgpu.adapters.reports import mlflow_reference, quota_name

from support.polling import poll as _poll
from support.prefect_limits import global_limit

pytestmark = pytest.mark.e2e


@gpu_task(gpus=2, nodes=2)
def two_ranks(x: int) -> int:
    import time as t

    import mlflow

    from prefect_sgpu import runtime

    for step in range(1, 5):
        t.sleep(1.2)
        runtime.progress(step, total=4)
        if runtime.is_rank_zero():
            mlflow.log_metric("train_loss", 1.0 / step, step=step)
            mlflow.log_metric("x", x, step=step)
    return x + runtime.rank()


def test_library_lines_artifacts_and_events_of_a_gpu_task(prefect_server: None) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterTaskRunId, FlowRunFilter,
                                                LogFilter, LogFilterTaskRunId, TaskRunFilter)
    from prefect.events.filters import EventFilter, EventNameFilter

    @flow(task_runner=GPUTaskRunner())
    def pipeline() -> Any:
        return two_ranks(5, return_state=True)

    state = pipeline()
    assert state.is_completed() and state.result() == 5
    task_run_id = state.state_details.task_run_id
    with get_client(sync_client=True) as client:
        logs = _poll(lambda: [log.message for log in client.read_logs(
            LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])), limit=200, offset=0)],
            lambda got: any("no GPU on this machine" in m for m in got) and any("gang check passed" in m for m in got),
            "the library's 'no GPU' and 'gang check passed' lines")
        assert any("running 2 CPU rank(s)" in m for m in logs), logs
        assert any("two_ranks: gang check passed: 2 rank(s) on 2 node(s)" in m for m in logs), logs

        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(task_run_id=ArtifactFilterTaskRunId(any_=[task_run_id])),
            flow_run_filter=FlowRunFilter(), task_run_filter=TaskRunFilter(), limit=20, offset=0)
        by_key = {a.key: a for a in artifacts}
        assert {"sgpu-two-ranks-job", "sgpu-two-ranks-ranks", "sgpu-two-ranks-mlflow",
                "sgpu-two-ranks-progress", "sgpu-two-ranks-loss"} <= set(by_key), by_key
        losses = by_key["sgpu-two-ranks-loss"]
        rows = json.loads(losses.data) if isinstance(losses.data, str) else losses.data
        assert rows == [{"step": s, "train_loss": round(1.0 / s, 6)} for s in range(1, 5)], rows
        progress = by_key["sgpu-two-ranks-progress"]
        assert progress.type == "progress" and float(progress.data) == 100.0, progress
        assert "finished (step 4 of 4)" in progress.description, progress.description
        table = by_key["sgpu-two-ranks-ranks"]
        assert table.type == "table"
        rows = json.loads(table.data) if isinstance(table.data, str) else table.data
        assert [(r["rank"], r["exit code"]) for r in rows] == [(0, 0), (1, 0)], rows
        links = by_key["sgpu-two-ranks-links"]  # the gang check's table: one row per node link
        rows = json.loads(links.data) if isinstance(links.data, str) else links.data
        assert sorted((r["from node"], r["to node"]) for r in rows) == [(0, 1), (1, 0)], rows
        assert all(r["GB/s"] > 0 for r in rows), rows
        assert "**Gang check** passed" in by_key["sgpu-two-ranks-job"].data
        timeline = by_key["sgpu-two-ranks-timeline"]  # where the time went: a row per phase per node
        assert timeline.type == "table"
        rows = json.loads(timeline.data) if isinstance(timeline.data, str) else timeline.data
        seen = [(r["phase"], r["node"]) for r in rows]
        for phase in ("agent up", "rendezvous", "first step", "ranks done"):
            assert {(phase, 0), (phase, 1)} <= set(seen), (phase, rows)
        assert seen[0] == ("launch requested", "all") and seen[-1] == ("release", "all"), rows
        assert [r["seconds"] for r in rows] == sorted(r["seconds"] for r in rows), rows
        reference = by_key["sgpu-two-ranks-mlflow"].data
        uri = os.environ["MLFLOW_TRACKING_URI"]
        assert f"mlflow ui --backend-store-uri {uri}\n" in reference, reference
        run_id = reference.split("`")[1]  # the job's MLflow run keeps the same timeline
        from mlflow.artifacts import load_text

        kept = json.loads(load_text(f"runs:/{run_id}/timeline.json"))
        assert [(p["phase"], "all" if p["node"] is None else p["node"]) for p in kept["phases"]] == seen

        page = _poll(lambda: client.read_events(EventFilter(
            event=EventNameFilter(prefix=["prefect-sgpu.job."])), limit=50).events,
            lambda evs: any(e.event == "prefect-sgpu.job.finished" and str(task_run_id) in
                            {r.id.split(".")[-1] for r in e.related} for e in evs),
            "the prefect-sgpu.job.finished event")
    mine = [e for e in page if str(task_run_id) in {r.id.split(".")[-1] for r in e.related}]
    names = [e.event for e in sorted(mine, key=lambda e: e.occurred)]
    assert names == ["prefect-sgpu.job.started", "prefect-sgpu.job.finished"], names
    finished = next(e for e in mine if e.event == "prefect-sgpu.job.finished")
    assert finished.payload["gpus"] == 2 and finished.payload["duration_s"] > 0, finished.payload
    assert finished.resource.id.startswith("prefect-sgpu.job.")


def test_a_long_loss_history_is_thinned_to_a_table_that_keeps_the_last_step(tmp_path: Any) -> None:
    from mlflow.tracking import MlflowClient

    from prefect_sgpu.adapters.reports import loss_table

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("losses")).info.run_id
    from mlflow.entities import Metric

    client.log_batch(run, metrics=[Metric("loss", 1000.0 - s, 0, s) for s in range(1000)]
                     + [Metric("system/rank-0/loss_like", 1.0, 0, 0), Metric("accuracy", 0.5, 0, 1)])
    table = loss_table(uri, run, rows=50)
    assert len(table) == 50 and table[0] == {"step": 0, "loss": 1000.0} and table[-1] == {"step": 999, "loss": 1.0}
    assert [r["step"] for r in table] == sorted(r["step"] for r in table)


def test_mlflow_reference_links_a_server_and_gives_the_command_for_a_local_store() -> None:
    assert mlflow_reference("http://mlflow.internal:5000/", "3", "abc") == (
        "MLflow run `abc`: [open](http://mlflow.internal:5000/#/experiments/3/runs/abc)")
    local = mlflow_reference("sqlite:////srv/mlflow.db", "3", "abc")
    assert "mlflow ui --backend-store-uri sqlite:////srv/mlflow.db\n" in local
    assert "http://127.0.0.1:5000/#/experiments/3/runs/abc" in local


@gpu_task(gpus=2, gpu_type="A10", mlflow=False)
def timed(hold_s: float) -> tuple[float, float]:
    import time as t

    start = t.time()
    t.sleep(hold_s)
    return start, t.time()


def test_a_gpu_quota_lets_one_two_gpu_job_run_at_a_time(prefect_server: None) -> None:
    name = quota_name("a10")
    assert name == "gpu:A10"
    with global_limit(name, 2):
        @flow(task_runner=GPUTaskRunner(max_workers=3))
        def three_at_once() -> list[tuple[float, float]]:
            futures = [timed.submit(2.0) for _ in range(3)]
            return [f.result() for f in futures]

        spans = sorted(three_at_once())
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end, f"two A10 jobs overlapped under a 2-slot limit: {spans}"

        @flow(task_runner=GPUTaskRunner())
        def too_big() -> Any:
            return timed.with_options(gpus=4)(0.0)

        with pytest.raises(SGPUConfigError, match=r"gpus=4.*at most 2.*'gpu:A10'"):
            too_big()


def test_without_a_limit_for_its_gpu_type_a_task_does_not_wait(prefect_server: None) -> None:
    @flow(task_runner=GPUTaskRunner())
    def one() -> Any:
        return timed.with_options(gpu_type="L4")(0.0)

    start, end = one()
    assert end >= start, "ran without a limit for L4 to wait on"
