"""A job's timeline: the recorder, what the driver and a remote compute add to it, and a real local run."""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
from pathlib import Path

import pytest

from prefect_sgpu import distributed, runtime
from prefect_sgpu import spec as spec_mod
from prefect_sgpu.compute.local import LocalProcessCompute
from prefect_sgpu.compute.remote.nodes import Progress
from prefect_sgpu.driver.job import Job
from prefect_sgpu.driver.results import RankReport
from prefect_sgpu.protocol import rank_progress
from prefect_sgpu.observe import timeline
from prefect_sgpu.observe.progress_watch import StragglerWatch, first_step_time
from prefect_sgpu.protocol import payload
from prefect_sgpu.store import LocalStore
from support.fake_compute import FakeCompute


def test_phases_come_in_time_order_with_seconds_since_the_job_began() -> None:
    line = timeline.Timeline(began=1000.0)
    line.mark("acquired", at=1002.0)
    line.mark("launch requested", at=1000.5)
    line.mark("agent up", 1, at=1002.0, detail="i-1")  # a tie keeps the order it was recorded in
    assert line.once("agent up", 1, at=1009.0) is False, "once per phase, node and gang"
    line.gang = 1
    assert line.once("agent up", 1, at=1010.0) is True, "the next gang records its own"

    phases = line.phases()
    assert [(p.phase, p.node, p.seconds, p.gang) for p in phases] == [
        ("launch requested", None, 0.5, 0), ("acquired", None, 2.0, 0), ("agent up", 1, 2.0, 0),
        ("agent up", 1, 10.0, 1)]
    assert phases[2].as_row() == {"phase": "agent up", "node": 1, "seconds": 2.0, "gang": 0, "detail": "i-1"}
    assert phases[0].as_row()["node"] == "all"
    assert pickle.loads(pickle.dumps(phases)) == phases, "a result's timeline travels (Prefect results, Ray)"
    data = json.loads(line.to_json())
    assert data["began"] == 1000.0 and [p["phase"] for p in data["phases"]][:2] == ["launch requested", "acquired"]


def test_record_reaches_only_the_timeline_of_a_job_this_process_drives() -> None:
    line = timeline.Timeline()
    timeline.record("job-a", "agent up", 0)  # nobody drives it: nothing, no error
    timeline.active("job-a", line)
    try:
        timeline.record("job-a", "agent up", 0, detail="i-0")
        timeline.record("job-b", "agent up", 1)
    finally:
        timeline.active("job-a", None)
    timeline.record("job-a", "agent up", 2)
    assert [(p.phase, p.node, p.detail) for p in line.phases()] == [("agent up", 0, "i-0")]


def test_a_remote_computes_progress_lines_become_phases_of_the_job() -> None:
    line = timeline.Timeline()
    timeline.active("job-p", line)
    try:
        progress = Progress("ec2", "job-p")
        progress("requested", "2 node(s)")  # the driver records its own request
        progress("running", "i-0 (10.0.0.1), i-1 (10.0.0.2)")
        progress("agent up", "node 1 on i-1 (1/2)", 1)
        progress("rendezvous", "c10d on node 0")  # the ranks' own start says when it was done
        progress("terminated", "")
    finally:
        timeline.active("job-p", None)
    assert [(p.phase, p.node) for p in line.phases()] == [("instances running", None), ("agent up", 1)]
    assert set(timeline.PROGRESS.values()) <= set(timeline.PHASES)


def test_rendezvous_and_first_step_are_each_nodes_earliest_rank() -> None:
    line = timeline.Timeline(began=100.0)
    timeline.note_ranks(line, [RankReport(0, 0, "h", 0, 1.0, 105.0), RankReport(1, 0, "h", 0, 1.0, 104.0),
                               RankReport(2, 1, "h", 0, 1.0, 106.0), RankReport(3, 1, "h", 0, 1.0, 0.0)])
    timeline.note_first_steps(line, {0: 110.0, 1: 109.0, 2: 111.0, 3: 112.0}, lambda rank: rank // 2)
    assert [(p.phase, p.node, p.seconds, p.detail) for p in line.phases()] == [
        ("rendezvous", 0, 4.0, ""), ("rendezvous", 1, 6.0, ""), ("first step", 0, 9.0, "rank 1"),
        ("first step", 1, 11.0, "rank 2")]


def _as_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rank: int, key: str) -> None:
    """This process writes progress as ``rank`` of job ``run-1`` in ``tmp_path``, sealed with ``key``'s
    progress key, its first step not yet taken."""
    monkeypatch.setenv("SGPU_JOB_DIR", str(tmp_path / "run-1"))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr(runtime, "_first_step", [0.0])
    monkeypatch.setattr(runtime, "_last_progress", [0.0])
    monkeypatch.setenv(rank_progress.KEY_ENV, rank_progress.progress_key(key))


def test_the_straggler_watch_keeps_each_ranks_first_step_from_its_own_progress_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = "ab" * 32
    _as_rank(monkeypatch, tmp_path, 1, key)
    before = time.time()
    runtime.progress(1, total=10, force=True)
    first = time.time()
    time.sleep(0.05)
    runtime.progress(7, force=True)  # the watch reads only now: the file still says when step 1 was
    fields = (tmp_path / "run-1" / runtime.PROGRESS_DIR / "rank-1").read_text().splitlines()[0].split()
    assert fields[1] == "7" and before - 0.001 <= float(fields[4]) <= first + 0.001 < float(fields[3])

    watch = StragglerWatch(LocalStore(tmp_path), "run-1", 2, 2.0, 3, key=key)
    watch.poll()
    assert list(watch.first_steps) == [1] and watch.first_steps[1] == float(fields[4])
    assert first_step_time(b"123 4 0 99.5", 42.0) == 42.0, "a rank that wrote four fields: the read's time"
    assert first_step_time(b"garbage x y z w", 42.0) == 42.0


def test_a_rank_that_stepped_between_two_reads_still_has_its_first_step_at_the_gangs_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = "cd" * 32
    _as_rank(monkeypatch, tmp_path, 0, key)
    watch = StragglerWatch(LocalStore(tmp_path), "run-1", 2, 2.0, 3, key=key, interval=3600.0)
    watch.poll()  # read before any step: nothing yet, and no read again within the interval
    runtime.progress(1, total=2, force=True)
    watch.poll()
    assert watch.first_steps == {}, "the interval kept the watch from reading"
    watch.read_at_end()
    assert list(watch.first_steps) == [0], "rank 0's first step, read once at the end; rank 1 reported none"
    runtime.progress(2, force=True)
    watch.first_steps = {}
    watch.read_at_end()
    assert watch.first_steps == {}, "read once per gang"


def _identity(x: int) -> int:
    return x


def test_a_recovered_job_records_the_loss_and_the_next_gangs_phases(tmp_path: Path) -> None:
    compute = FakeCompute(nodes=2, lose_node=1, lose_times=1)
    spec = spec_mod.merge(spec_mod.layer("call", mlflow=False, gpus=2, timeout=60))
    job = Job(payload.FunctionCall(_identity, (3,)), spec, compute, LocalStore(tmp_path))
    result = job.run()
    assert result.values == [3, 3]
    seen = [(p.phase, p.node, p.gang) for p in result.timeline]
    assert seen.index(("launch requested", None, 0)) < seen.index(("recovery", 1, 0)) \
        < seen.index(("launch requested", None, 1)) < seen.index(("release", None, 1)), seen
    assert ("rendezvous", 0, 1) in seen and ("rendezvous", 1, 1) in seen, "the last gang's ranks"
    assert "node 1 vanished" in next(p.detail for p in result.timeline if p.phase == "recovery")
    assert timeline._ACTIVE.get(job.run_id) is None, "forgotten when the job ends"


def _steps(n: int) -> int:
    for step in range(1, n + 1):
        time.sleep(0.4)
        runtime.progress(step, total=n)
    return runtime.rank()


@pytest.mark.e2e
def test_a_local_distributed_result_carries_its_phases_in_order() -> None:
    """``.run()`` is ``.distributed()`` with the whole report: two local nodes, real torch elastic agents."""
    fn = distributed(gpus=2, nodes=2, mlflow=False, compute=LocalProcessCompute(keep_warm=0), timeout=120)(_steps)
    result = fn.run(6)
    assert result.values == [0, 1]
    first = {}
    for p in result.timeline:  # each phase of each node, the first time it was recorded
        first.setdefault((p.phase, p.node), p.at)
    order = [("launch requested", None), ("acquired", None), ("started", None)]
    for node in (0, 1):
        steps = [*order, ("agent up", node), ("rendezvous", node), ("first step", node), ("ranks done", node),
                 ("release", None)]
        missing = [s for s in steps if s not in first]
        assert not missing, (missing, result.timeline)
        times = [first[s] for s in steps]
        assert times == sorted(times), list(zip(steps, times))
    assert [p.at for p in result.timeline] == sorted(p.at for p in result.timeline)
    assert all(p.gang == 0 for p in result.timeline) and result.timeline[0].phase == "launch requested"
    assert 0 <= result.timeline[0].seconds < result.timeline[-1].seconds <= result.duration_s + 5
    assert {p.phase for p in result.timeline} <= set(timeline.PHASES)


class _Running:
    """Machines that all run (the provider's part of the wait for agents)."""

    dead_states = ("terminated",)

    def instance_states(self, ids: list[str]) -> dict[str, str]:
        return {i: "running" for i in ids}


def test_environment_ready_is_a_phase_of_machines_booted_for_the_job_only(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from prefect_sgpu.compute.remote.allocation import RemoteRequest
    from prefect_sgpu.compute.remote.nodes import RemoteNodeCompute
    from prefect_sgpu.protocol.jobfolder import Alive, JobFolder, new_key
    from prefect_sgpu.protocol.versions import runtime_versions
    from prefect_sgpu.spec import Plan

    store = LocalStore(tmp_path)
    folder = JobFolder(store, "run-e", new_key())
    class Compute(RemoteNodeCompute):
        name = "fake"

        def plan(self, spec, run_id):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    compute = Compute(_Running(), store)
    spec = spec_mod.merge(spec_mod.layer("call", gpus=2, mlflow=False))
    request = RemoteRequest(run_id="run-e", compute="fake", plan=Plan(nodes=2, procs_per_node=1, device="cpu"),
                            spec=spec, heartbeat_ttl_s=60.0)
    allocation = compute._new_allocation(request, folder)
    allocation.instances = [SimpleNamespace(id="m-0", private_ip="10.0.0.1"),
                            SimpleNamespace(id="m-1", private_ip="10.0.0.2")]
    booted = {0: allocation.started + 1.5, 1: allocation.started - 300.0}  # node 1: a warm lease's, booted before
    for node, ready in booted.items():
        folder.put_alive(node, Alive(phase="waiting", seq=1, time=time.time(), versions=runtime_versions(),
                                     ready=ready), instance_id=f"m-{node}")
    line = timeline.Timeline(began=allocation.started)
    timeline.active("run-e", line)
    try:
        compute._wait_for_agents(allocation, time.monotonic() + 30, threading.Event())
    finally:
        timeline.active("run-e", None)
    seen = [(p.phase, p.node, p.seconds, p.detail) for p in line.phases()]
    assert ("environment ready", 0, 1.5, "m-0") in seen, seen
    assert not any(p == "environment ready" and n == 1 for p, n, _, _ in seen), "not a job's phase: seen before it"
    assert {(p, n) for p, n, _, _ in seen if p == "agent up"} == {("agent up", 0), ("agent up", 1)}
