"""One set of behaviours every compute must show, run against each of them.

The cases (how to run on a compute, what it may leave behind) are in
``tests/support/conformance.py`` and listed in ``tests/compute/conftest.py``.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from prefect_sgpu import JobCancelled, LaunchTimeout, distributed, runtime
from prefect_sgpu.compute.base import Released
from support.conformance import CASES, ENVIRONMENT_SHIPPING, STALLABLE, SWEEPABLE
from support.threads import run_in_thread

pytestmark = pytest.mark.e2e


class DivergedOnPurpose(Exception):
    """Raised in one rank; the caller must get this very class back."""


@pytest.fixture(params=CASES)
def case(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_case")


@pytest.fixture(params=CASES + ENVIRONMENT_SHIPPING)
def any_case(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_case")


@pytest.fixture(params=ENVIRONMENT_SHIPPING)
def shipping_case(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_case")


@pytest.fixture(params=STALLABLE)
def stallable_case(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_case")


@pytest.fixture(params=SWEEPABLE)
def sweepable_case(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_case")


def _rank_and_world(tag: str) -> tuple[int, int, str]:
    return runtime.rank(), runtime.world_size(), tag


def _mlflow_status(run_id: str | None) -> str | None:
    if run_id is None:
        return None
    import mlflow

    return mlflow.MlflowClient().get_run(run_id).info.status


def _wait_for(path_prefix: str, count: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while sum(1 for i in range(count) if Path(f"{path_prefix}{i}").exists()) < count:
        assert time.monotonic() < deadline, "ranks never started"
        time.sleep(0.2)


@pytest.mark.quick  # the inner loop's tier: one short job of this kind
def test_values_come_back_in_rank_order_and_release_is_idempotent(any_case: Any) -> None:
    case = any_case
    fn = distributed(**case.options(mlflow=True))(_rank_and_world)
    job = fn.job("conformance")
    shown = job.dry_run()
    result = job.run()
    world = result.plan.world_size
    assert result.values == [(r, world, "conformance") for r in range(world)]
    assert [r.rank for r in result.ranks] == list(range(world))
    assert result.released, "release says what it removed"
    case.check_sent(job, shown)
    again = job.compute.release(job.allocation)
    assert isinstance(again, Released)
    assert _mlflow_status(result.mlflow_run_id) == "FINISHED"
    assert case.leftovers(job.run_id) == []


def _where_it_runs() -> dict[str, str]:
    import sys

    import prefect_sgpu

    return {"prefix": sys.prefix, "executable": sys.executable, "prefect_sgpu": prefect_sgpu.__file__}


def test_ranks_run_in_the_environment_their_machines_built(shipping_case: Any) -> None:
    """The driver shipped its environment; each machine's stage built (or reused) the venv under the
    case's env root and the ranks ran there, prefect-sgpu included, not in the driver's venv."""
    case = shipping_case
    job = distributed(**case.options())(_where_it_runs).job()
    result = job.run()
    venv = case.venv(job)
    assert len(result.values) == result.plan.world_size
    for value in result.values:
        assert Path(value["prefix"]) == venv, value
        assert Path(value["executable"]).is_relative_to(venv), value
        assert Path(value["prefect_sgpu"]).is_relative_to(venv), value
    assert case.leftovers(job.run_id) == []


def test_a_failing_rank_raises_its_own_exception(case: Any) -> None:
    def fails_on_last_rank() -> int:
        if runtime.rank() == runtime.world_size() - 1:
            raise DivergedOnPurpose(f"rank {runtime.rank()} diverged")
        time.sleep(1)
        return runtime.rank()

    job = distributed(**case.options(mlflow=True))(fails_on_last_rank).job()
    with pytest.raises(DivergedOnPurpose, match="diverged") as info:
        job.run()
    failure = info.value.sgpu_failure  # type: ignore[attr-defined]
    assert failure.rank == job.plan.world_size - 1
    assert "DivergedOnPurpose" in (failure.remote_traceback or "")
    assert _mlflow_status(job.tracked.run_id if job.tracked else None) in (None, "FAILED")
    assert case.leftovers(job.run_id) == []


def test_timeout_while_running_stops_every_rank(case: Any) -> None:
    def forever() -> None:
        time.sleep(600)

    job = distributed(**case.options(timeout=25))(forever).job()
    with pytest.raises(LaunchTimeout) as info:
        job.run()
    assert info.value.timeout == 25
    assert case.leftovers(job.run_id) == []


def test_cancel_while_running_stops_every_rank(case: Any, tmp_path: Path) -> None:
    marker = str(tmp_path / "started-")

    def slow(prefix: str) -> None:
        Path(f"{prefix}{runtime.rank()}").write_text("1")
        time.sleep(600)

    fn = distributed(**case.options(mlflow=True))(slow)
    job = fn.job(marker, cancel_event=threading.Event())
    runner, outcome = run_in_thread(job)
    try:  # on a machine too busy to start the ranks in time the job is still cancelled: what it holds
        # (a Ray placement group, instances) would otherwise fail every later case of the session
        _wait_for(marker, job.prepare()[0].plan.world_size, timeout=300.0)
    finally:
        job.cancel_event.set()
        runner.join(timeout=120)
    assert not runner.is_alive()
    assert outcome and isinstance(outcome[0], JobCancelled), outcome
    assert _mlflow_status(job.tracked.run_id if job.tracked else None) in (None, "KILLED")
    assert case.leftovers(job.run_id) == []


def test_timeout_during_acquire_gives_everything_back(stallable_case: Any) -> None:
    def never_runs() -> None:
        raise AssertionError("no rank should start")

    job = distributed(**stallable_case.options(timeout=12))(never_runs).job()
    with stallable_case.stalled_acquire(), pytest.raises(LaunchTimeout) as info:
        job.run()
    assert info.value.phase != "run", "the deadline was enforced while acquiring"
    assert info.value.timeout == 12, "acquire ended at the job's own deadline, not at a limit of its own"
    assert stallable_case.leftovers(job.run_id) == []


def test_cancel_during_acquire_gives_everything_back(stallable_case: Any) -> None:
    def never_runs() -> None:
        raise AssertionError("no rank should start")

    job = distributed(**stallable_case.options())(never_runs).job(cancel_event=threading.Event())
    with stallable_case.stalled_acquire():
        timer = threading.Timer(4.0, job.cancel_event.set)
        timer.start()
        try:
            with pytest.raises(JobCancelled):
                job.run()
        finally:
            timer.cancel()
    assert stallable_case.leftovers(job.run_id) == []


def test_the_sweeper_removes_a_dead_runs_leftovers_and_leaves_a_live_runs_whole(sweepable_case: Any) -> None:
    """Through the provider alone (:meth:`Provider.find_leftovers`, :meth:`Provider.remove_leftovers`):
    the sweeper of the compute knows no cloud."""
    from prefect_sgpu.compute.remote.sweep import sweeper
    from prefect_sgpu.protocol.jobfolder import CONTROL

    case = sweepable_case
    tag = uuid.uuid4().hex[:8]
    live, dead = f"live-{tag}", f"dead-{tag}"
    case.leave_behind(live, dead=False)
    case.leave_behind(dead, dead=True)
    compute = case.options()["compute"]
    try:
        left_dead, left_live = case.leftovers(dead), case.leftovers(live)
        assert left_dead and left_live, "machines, a secret and control files of each run"
        made = sweeper(compute)
        dry = made.sweep(dry_run=True)
        assert {x.run_id for x in dry.found} == {dead} and live in dry.live, dry
        categories = {x.category for x in compute.provisioner.find_leftovers(compute.store).found if x.run_id == dead}
        assert {"machine", "secret"} <= categories
        assert case.leftovers(dead) == left_dead, "a dry run removes nothing"
        report = made.sweep()
        assert not report.errors, report.errors
        assert {(x.kind, x.name) for x in report.removed} == {(x.kind, x.name) for x in dry.found}, report
        assert case.leftovers(dead) == []
        assert live in report.live and case.leftovers(live) == left_live, "a live run is left whole"
        assert not made.sweep().found, "a second pass finds nothing"
    finally:
        provider = compute.provisioner
        provider.remove_leftovers(live, [x for x in provider.find_leftovers(compute.store).found if x.run_id == live])
        for key in CONTROL:
            compute.store.delete(live, key)

