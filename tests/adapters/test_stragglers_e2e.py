"""Stragglers on real torch elastic ranks (the local compute, gloo), seen where a Prefect user looks:
the task run's logs, its stragglers table and the job summary, and the event
``prefect-sgpu.job.straggler`` on the suite's real Prefect server."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prefect import flow

from prefect_sgpu import GPUTaskRunner, gpu_task

from support.polling import poll as _poll

pytestmark = pytest.mark.e2e


@gpu_task(gpus=2, mlflow=False, straggler_factor=2.0, straggler_steps=3)
def steps(slow_rank: int | None) -> int:
    """Every rank runs a few seconds of steps; ``slow_rank`` sleeps ten times longer each step.

    Without a slow rank the ranks step together, as data-parallel training does (a barrier each
    step), so a loaded machine that holds one rank back a moment does not make it look slow."""
    import time as t

    import torch.distributed as dist

    from prefect_sgpu import runtime

    runtime.init_process_group()
    dist.barrier()  # both ranks start their steps together
    slow = runtime.rank() == slow_rank
    period, count = (0.4, 15) if slow else ((0.04, 150) if slow_rank is not None else (0.1, 40))
    for step in range(1, count + 1):
        t.sleep(period)
        if slow_rank is None:
            dist.barrier()
        runtime.progress(step, total=count, force=True)
    dist.barrier()
    return runtime.rank()


def _run(slow_rank: int | None) -> tuple[Any, list[str], dict[str, Any], list[Any]]:
    """Run the task in a flow; its logs, its artifacts by key and the prefect-sgpu events of its task run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterTaskRunId, FlowRunFilter,
                                                LogFilter, LogFilterTaskRunId, TaskRunFilter)
    from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

    @flow(task_runner=GPUTaskRunner())
    def pipeline() -> Any:
        return steps(slow_rank, return_state=True)

    state = pipeline()
    assert state.is_completed(), state
    task_run_id = str(state.state_details.task_run_id)

    def mine(events: list[Any]) -> list[Any]:
        return [e for e in events if task_run_id in {r.id.split(".")[-1] for r in e.related}]

    with get_client(sync_client=True) as client:
        events = _poll(lambda: mine(client.read_events(EventFilter(
            event=EventNameFilter(prefix=["prefect-sgpu.job."]),
            related=EventRelatedFilter(id=[f"prefect.task-run.{task_run_id}"])), limit=50).events),
            lambda evs: any(e.event == "prefect-sgpu.job.finished" for e in evs), "the job's finished event")
        logs = _poll(lambda: [log.message for log in client.read_logs(
            LogFilter(task_run_id=LogFilterTaskRunId(any_=[state.state_details.task_run_id])), limit=200,
            offset=0)], lambda got: any("starting 2 rank(s)" in m for m in got), "the job's start line")
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(task_run_id=ArtifactFilterTaskRunId(any_=[state.state_details.task_run_id])),
            flow_run_filter=FlowRunFilter(), task_run_filter=TaskRunFilter(), limit=50, offset=0)
    return state, logs, {a.key: a for a in artifacts}, events


def _table(artifact: Any) -> list[dict[str, Any]]:
    return json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data


def test_a_rank_sleeping_each_step_is_named_a_straggler_once(prefect_server: None) -> None:
    state, logs, by_key, events = _run(slow_rank=1)
    assert state.result() == 0

    named = [m for m in logs if "is a straggler" in m]
    assert len(named) == 1, logs
    assert named[0].startswith("steps: rank 1 (node 0") and "steps/s against a median of" in named[0], named[0]

    stragglers = [e for e in events if e.event == "prefect-sgpu.job.straggler"]
    assert len(stragglers) == 1, [e.event for e in events]
    event = stragglers[0]
    assert event.resource["prefect-sgpu.rank"] == "1" and event.resource["prefect-sgpu.node"] == "0"
    payload = event.payload
    assert payload["rank"] == 1 and payload["node"] == 0 and "instance_id" in payload
    assert 0 < payload["rate"] * 2.0 < payload["median_rate"], payload
    assert payload["straggler_factor"] == 2.0 and payload["straggler_steps"] == 3

    rows = _table(by_key["sgpu-steps-stragglers"])
    assert [(r["rank"], r["node"]) for r in rows] == [(1, 0)], rows
    # the table shows the rate to 3 places, the event to 4: both round the one measured rate
    assert rows[0]["rate (steps/s)"] == pytest.approx(payload["rate"], abs=0.00051), (rows, payload)
    assert "**Stragglers**" in by_key["sgpu-steps-job"].data
    ranks = _table(by_key["sgpu-steps-ranks"])
    assert ranks[1]["steps/s"] * 2 < ranks[0]["steps/s"], ranks


def test_an_even_job_names_no_straggler(prefect_server: None) -> None:
    state, logs, by_key, events = _run(slow_rank=None)
    assert state.result() == 0
    # the watch measured both ranks (the ranks table shows their rates), and named neither
    ranks = _table(by_key["sgpu-steps-ranks"])
    assert all(r.get("steps/s", 0) > 0 for r in ranks), ranks
    assert not any("is a straggler" in m for m in logs), logs
    assert [e.event for e in events if e.event == "prefect-sgpu.job.straggler"] == []
    assert "sgpu-steps-stragglers" not in by_key and "Stragglers" not in by_key["sgpu-steps-job"].data
