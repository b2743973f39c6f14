"""``max_cost_usd``: validated with the other fields, refused where a compute has no price, projected one
check ahead while the job runs, and at the cap a final checkpoint asked for and ``CostCapReached``.

The driver runs against the thread-backed fake compute with a price of its own (``running_cost`` is
the contract's method the EC2 compute answers from its provider's ``cost()``); the EC2 end to end is
``tests/compute/test_ec2_cost_cap.py``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from prefect_sgpu import runtime
from prefect_sgpu import spec as spec_mod
from prefect_sgpu.adapters.reports import CostProgress
from prefect_sgpu.compute.base import Allocation, Released, Request
from prefect_sgpu.driver import cost_cap
from prefect_sgpu.driver.cost_cap import CostReading, CostWatch, project
from prefect_sgpu.driver.heartbeat import DriverHeartbeat
from prefect_sgpu.driver.job import Job
from prefect_sgpu.errors import CostCapReached, SGPUConfigError
from prefect_sgpu.pipeline.checkpoint import SealedSteps
from prefect_sgpu.protocol import payload
from prefect_sgpu.protocol.jobfolder import JobFolder, new_key
from prefect_sgpu.store import LocalStore
from support.fake_compute import FakeCompute


class PricedFake(FakeCompute):
    """The fake compute with a price: ``usd_per_hour`` from the moment ``acquire`` returned."""

    def __init__(self, usd_per_hour: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.usd_per_hour = usd_per_hour
        self.acquired_at = 0.0

    def price_per_hour(self, request: Request) -> float | None:
        return self.usd_per_hour

    def acquire(self, *args: Any, **kwargs: Any) -> Any:
        allocation = super().acquire(*args, **kwargs)
        self.acquired_at = time.monotonic()
        return allocation

    def running_cost(self, allocation: Allocation) -> dict[str, Any] | None:
        hours = (time.monotonic() - self.acquired_at) / 3600
        return {"usd": self.usd_per_hour * hours, "usd_per_hour": self.usd_per_hour}


def _job(fn: Any, compute: Any, tmp_path: Path, *args: Any, **given: Any) -> Job:
    spec = spec_mod.merge(spec_mod.layer("call", mlflow=False, **given))
    return Job(payload.FunctionCall(fn, args), spec, compute, LocalStore(tmp_path))


def _sleep(seconds: float) -> float:
    import time as _time

    _time.sleep(seconds)
    return seconds


# -- the projection and the decision ----------------------------------------------------


def test_the_projection_is_the_cost_so_far_plus_the_hourly_rate_for_one_check_ahead() -> None:
    assert project(1.0, 36.0, 10.0) == pytest.approx(1.1)
    assert project(1.0, 36.0, -5.0) == 1.0, "nothing is projected backwards"
    below = CostReading(spent_usd=1.0, usd_per_hour=36.0, ahead_s=10.0, cap_usd=1.2)
    across = CostReading(spent_usd=1.0, usd_per_hour=36.0, ahead_s=10.0, cap_usd=1.05)
    assert not below.reached, "1.10 projected stays under a 1.20 cap"
    assert across.reached, "spent 1.00 is under the 1.05 cap, but by the next check it would be 1.10"
    assert not CostReading(5.0, 36.0, 10.0, None).reached, "no cap, never reached"
    assert "$1.0000 spent of max_cost_usd=1.05" in across.describe() and "$1.1000 by the next check" in across.describe()


def test_the_watch_reads_once_per_interval_adds_what_was_given_back_and_stops_at_the_cap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cost_cap.FINAL_CHECKPOINT_ENV, "0")
    compute = PricedFake(usd_per_hour=36.0)  # a cent a second
    job = _job(_sleep, compute, tmp_path, 0.0, max_cost_usd=0.5)
    job.allocation = Allocation(request=compute.plan(job.spec, job.run_id), folder=None, nodes=[])  # type: ignore[arg-type]
    job.given_back = [Released(cost={"usd": 0.2})]  # a lost node's machine, ended earlier
    seen: list[CostReading] = []
    job.cost_listeners.append(seen.append)
    watch = CostWatch(job, every=10.0)
    compute.acquired_at = time.monotonic() - 10.0  # 0.10 spent on the machines that run now
    first = watch.poll(now=100.0)
    assert first is not None and first.spent_usd == pytest.approx(0.3, abs=0.01)
    assert first.projected_usd == pytest.approx(0.4, abs=0.01) and not first.reached
    assert watch.poll(now=105.0) is None, "read once per interval"
    compute.acquired_at -= 15.0  # 0.25 on the running machines: 0.45 spent, 0.55 projected
    with pytest.raises(CostCapReached) as caught:
        watch.poll(now=110.0)
    err = caught.value
    assert (err.cap_usd, err.checkpoint_step) == (0.5, None)
    assert err.spent_usd == pytest.approx(0.45, abs=0.01) and err.projected_usd == pytest.approx(0.55, abs=0.01)
    assert "max_cost_usd=0.5" in str(err) and "$0.45" in str(err) and "$0.55" in str(err)
    assert [r.reached for r in seen] == [False, True], "every reading reached the listeners, the last at the cap"


def test_a_job_past_its_cap_is_stopped_with_the_error_and_released(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cost_cap.FINAL_CHECKPOINT_ENV, "0")
    compute = PricedFake(usd_per_hour=36.0)
    job = _job(_sleep, compute, tmp_path, 20.0, max_cost_usd=0.05, timeout=60)  # 0.10 projected at once
    started = time.monotonic()
    with pytest.raises(CostCapReached) as caught:
        job.run()
    assert time.monotonic() - started < 15, "stopped at the first check, not at the function's end"
    assert caught.value.cap_usd == 0.05 and caught.value.projected_usd > 0.05
    assert ("stop", 10.0) in compute.calls and compute.releases == 1


def test_a_job_under_its_cap_runs_to_its_end(tmp_path: Path) -> None:
    compute = PricedFake(usd_per_hour=1.0)
    assert _job(_sleep, compute, tmp_path, 0.2, max_cost_usd=5.0).run().values == [0.2]


# -- the setting ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1.5, float("inf"), float("nan"), "lots", True])
def test_max_cost_usd_is_a_positive_number_of_dollars(value: Any) -> None:
    from prefect_sgpu import distributed, gpu_task

    for make in (lambda: spec_mod.layer("call", max_cost_usd=value),
                 lambda: distributed(max_cost_usd=value)(_sleep), lambda: gpu_task(max_cost_usd=value)(_sleep)):
        with pytest.raises(SGPUConfigError) as caught:
            make()
        assert caught.value.field == "max_cost_usd"
        assert "positive, finite number of US dollars" in caught.value.allowed


def test_max_cost_usd_merges_as_the_other_fields_do(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect_sgpu import GPUTaskRunner

    runner = GPUTaskRunner(max_cost_usd=20)
    assert spec_mod.build(spec_mod.layer("task"), runner.layer).max_cost_usd == 20.0
    assert spec_mod.build(spec_mod.layer("task", max_cost_usd=2.5), runner.layer).max_cost_usd == 2.5
    monkeypatch.setenv("PREFECT_SGPU_MAX_COST_USD", "7.5")
    assert spec_mod.build().max_cost_usd == 7.5
    monkeypatch.setenv("PREFECT_SGPU_MAX_COST_USD", "none")
    assert spec_mod.build().max_cost_usd is None
    monkeypatch.setenv("PREFECT_SGPU_MAX_COST_USD", "-3")
    with pytest.raises(SGPUConfigError, match="PREFECT_SGPU_MAX_COST_USD"):
        spec_mod.build()


def test_max_cost_usd_is_a_job_variable_of_the_work_pool() -> None:
    from prefect_sgpu.adapters import pool_variables as pv
    from prefect_sgpu.adapters.worker import SGPUWorker

    properties = SGPUWorker.get_default_base_job_template()["variables"]["properties"]
    assert {"exclusiveMinimum": 0, "type": "number"} in properties["max_cost_usd"]["anyOf"]
    env = pv.gpu_defaults_env(pv.gpu_defaults({"max_cost_usd": 12.5}))
    assert env == {"PREFECT_SGPU_MAX_COST_USD": "12.5"}
    assert spec_mod.build(environ=env).max_cost_usd == 12.5
    with pytest.raises(SGPUConfigError) as info:
        pv.gpu_defaults({"max_cost_usd": -1})
    assert info.value.field == "job variable max_cost_usd" and "positive" in str(info.value)


def test_a_cap_on_a_compute_without_a_price_is_refused_before_anything_is_spent(tmp_path: Path) -> None:
    from prefect_sgpu.compute.local import LocalProcessCompute

    for compute in (LocalProcessCompute(), FakeCompute()):
        job = _job(_sleep, compute, tmp_path, 0.0, max_cost_usd=1.0)
        with pytest.raises(SGPUConfigError) as caught:
            job.prepare()
        assert caught.value.field == "max_cost_usd" and "has no price" in caught.value.allowed
        assert not (tmp_path / job.run_id).exists(), "nothing was written"


def test_the_final_checkpoint_wait_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cost_cap.FINAL_CHECKPOINT_ENV, "soon")
    with pytest.raises(SGPUConfigError, match=cost_cap.FINAL_CHECKPOINT_ENV):
        cost_cap.final_checkpoint_s()
    monkeypatch.setenv(cost_cap.FINAL_CHECKPOINT_ENV, "30")
    assert cost_cap.final_checkpoint_s() == 30.0


# -- the ask: heartbeat -> node file -> checkpointer ---------------------------------------


def test_the_heartbeat_carries_the_ask_for_a_final_checkpoint(tmp_path: Path) -> None:
    folder = JobFolder(LocalStore(tmp_path), "job-1", new_key())
    beat = DriverHeartbeat(folder, interval=60.0).start()
    try:
        assert folder.heartbeat().checkpoint == ""  # type: ignore[union-attr]
        assert b"checkpoint" not in LocalStore(tmp_path).get("job-1", "heartbeat"), "unasked: the beat as before"
        beat.ask_checkpoint("cost cap")
        assert folder.heartbeat().checkpoint == "cost cap"  # type: ignore[union-attr]
    finally:
        beat.stop()


def test_a_checkpointer_saves_once_when_the_driver_asks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    monkeypatch.setenv("SGPU_JOB_DIR", str(job_dir))
    steps = SealedSteps(tmp_path / "ckpt")
    assert not steps.reclaim_due(3)
    (job_dir / runtime.FINAL_CHECKPOINT_FILE).write_text("cost cap")
    assert runtime.final_checkpoint_requested() == "cost cap" and not runtime.preemption_requested()
    assert steps.reclaim_due(4) and steps.preempted_at == 4
    assert not steps.reclaim_due(5), "one save for one ask"


def test_the_markers_of_a_location_in_the_job_store_are_listed_through_it(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("run", "checkpoints/step-00000003/COMPLETE", b"m")
    store.put("run", "checkpoints/step-00000004/part", b"x")
    assert cost_cap.marker_steps(store, store.uri("run", "checkpoints")) == [3]


# -- the UI ---------------------------------------------------------------------------------


def test_the_cost_artifact_is_updated_at_most_every_30_seconds_and_always_at_the_cap(tmp_path: Path) -> None:
    now = [0.0]
    progress = CostProgress(_job(_sleep, FakeCompute(), tmp_path, 0.0), clock=lambda: now[0])
    shown = []
    for t, reached in ((0, False), (10, False), (29, False), (31, False), (40, True), (45, False), (71, False)):
        now[0] = float(t)
        if progress.due(reached):  # what update() shows (inside a flow run: the progress artifact)
            shown.append(t)
            progress.shown_at = now[0]
    assert shown == [0, 31, 40, 71]
