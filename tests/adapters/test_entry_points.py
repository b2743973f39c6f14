"""Every way of starting a job inside a flow run counts as a GPU job of that run: ``.submit()`` and
``.distributed()`` of a ``@distributed`` function, ``run_script`` and the TorchDistributor all hold
the ``gpu:<type>`` quota, emit the ``prefect-sgpu.job.*`` events and write the job artifacts, as a
``@gpu_task`` does; the library's lines reach the run once, even where Prefect's own handler is on
the library's logger too (``PREFECT_LOGGING_EXTRA_LOGGERS=prefect_sgpu``)."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path
from typing import Iterator

import pytest
from prefect import flow, task

from prefect_sgpu import distributed, run_script
from prefect_sgpu.compat import TorchDistributor
from prefect_sgpu.adapters.reports import quota_name
from prefect_sgpu.adapters.run_logs import LIBRARY_LOGGER

from support.polling import poll
from support.prefect_limits import global_limit

pytestmark = pytest.mark.e2e

HOLD_S = 2.0


def _span(hold_s: float) -> tuple[float, float]:
    import time as t

    start = t.time()
    t.sleep(hold_s)
    return start, t.time()


span = distributed(gpus=2, gpu_type="A10", mlflow=False)(_span)

SCRIPT = textwrap.dedent("""\
    import json, os, sys, time
    start = time.time()
    time.sleep(float(sys.argv[2]))
    if os.environ["RANK"] == "0":
        with open(sys.argv[1], "w") as fh:
            json.dump([start, time.time()], fh)
""")


@pytest.fixture
def a10_limit_of_two(prefect_server: None) -> Iterator[str]:
    with global_limit(quota_name("A10"), 2) as name:
        yield name


@pytest.fixture
def prefects_handler_on_the_library_logger() -> Iterator[None]:
    """What ``PREFECT_LOGGING_EXTRA_LOGGERS=prefect_sgpu`` does when Prefect sets up logging: the
    handlers of Prefect's ``prefect.extra`` logger (its API log handler) added to ``prefect_sgpu``."""
    from prefect.logging.handlers import APILogHandler

    extra = [h for h in logging.getLogger("prefect.extra").handlers if isinstance(h, APILogHandler)]
    assert extra, "Prefect's logging set-up gave prefect.extra no API log handler"
    library = logging.getLogger(LIBRARY_LOGGER)
    added = [h for h in extra if h not in library.handlers]
    for handler in added:
        library.addHandler(handler)
    try:
        yield
    finally:
        for handler in added:
            library.removeHandler(handler)


def test_every_entry_point_in_a_flow_holds_the_gpu_quota_emits_events_and_logs_once(
        a10_limit_of_two: str, prefects_handler_on_the_library_logger: None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter,
                                                LogFilter, LogFilterFlowRunId, TaskRunFilter)
    from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

    monkeypatch.setenv("PREFECT_SGPU_GPU_TYPE", "A10")  # the TorchDistributor has no gpu_type of its own
    script = tmp_path / "hold.py"
    script.write_text(SCRIPT)
    script_out = tmp_path / "script-span.json"

    @task
    def by_distributed() -> tuple[float, float]:
        return span.distributed(HOLD_S)[0]

    @task
    def by_script() -> tuple[float, float]:
        run_script(script, [str(script_out), str(HOLD_S)], gpus=2, gpu_type="A10", mlflow=False)
        start, end = json.loads(script_out.read_text())
        return start, end

    @task
    def by_torch_distributor() -> tuple[float, float]:
        return TorchDistributor(num_processes=2, use_gpu=False, mlflow=False).run(_span, HOLD_S)  # type: ignore[no-any-return]

    @flow
    def four_entry_points() -> list[tuple[float, float]]:
        submitted = span.submit(HOLD_S)
        futures = [by_distributed.submit(), by_script.submit(), by_torch_distributor.submit()]
        return [tuple(submitted.result()[0]), *(tuple(f.result()) for f in futures)]  # type: ignore[misc]

    state = four_entry_points(return_state=True)
    spans = sorted(state.result())
    assert len(spans) == 4
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end, f"two 2-GPU A10 jobs overlapped under a 2-slot {a10_limit_of_two!r} limit: {spans}"

    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        holding = f"holding 2 slot(s) of global concurrency limit {a10_limit_of_two!r}"
        messages = poll(lambda: [log.message for log in client.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=0)],
            lambda got: sum(holding in m for m in got) >= 4, "a quota line of each job")
        assert sum(holding in m for m in messages) == 4, [m for m in messages if "slot" in m]
        assert sum("running 2 CPU rank(s)" in m for m in messages) == 4, [m for m in messages if "rank(s)" in m]

        events = poll(lambda: client.read_events(EventFilter(
            event=EventNameFilter(prefix=["prefect-sgpu.job."]),
            related=EventRelatedFilter(id=[f"prefect.flow-run.{flow_run_id}"])), limit=50).events,
            lambda evs: sum(e.event == "prefect-sgpu.job.finished" for e in evs) >= 4, "a finished event of each job")
        names = sorted(e.event for e in events)
        assert names == ["prefect-sgpu.job.finished"] * 4 + ["prefect-sgpu.job.started"] * 4, names
        assert {e.resource["prefect.resource.name"] for e in events} == {"_span", "hold.py"}, events
        assert all(e.payload["gpus"] == 2 and e.payload["gpu_type"] == "A10" for e in events), events

        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])),
            flow_run_filter=FlowRunFilter(), task_run_filter=TaskRunFilter(), limit=50, offset=0)
    keys = {a.key for a in artifacts}
    assert {"sgpu-span-job", "sgpu-span-ranks", "sgpu-hold-py-job", "sgpu-hold-py-ranks"} <= keys, keys


def test_outside_a_flow_run_a_job_needs_no_prefect_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """A script or notebook calling ``.distributed()`` talks to no Prefect API: with the API set to
    an address where nothing listens, the job still runs and nothing waits on a quota."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        values = span.distributed(0.0)
    assert len(values) == 2 and all(end >= start for start, end in values), values
