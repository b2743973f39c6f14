"""The driver against a fake compute: the contract's calls, deadlines, failures and cleanup."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from prefect_sgpu import spec as spec_mod
from prefect_sgpu.protocol import jobfolder
from prefect_sgpu.protocol import payload
from prefect_sgpu.driver.job import Job
from prefect_sgpu.errors import InfrastructureLost, JobCancelled, LaunchTimeout, RankFailedError
from prefect_sgpu.store import LocalStore
from support.fake_compute import FakeCompute
from support.polling import poll


def _job(fn, compute: FakeCompute, tmp_path: Path, *args, cancel: threading.Event | None = None,
         **given) -> Job:
    spec = spec_mod.merge(spec_mod.layer("call", mlflow=False, **given))
    return Job(payload.FunctionCall(fn, args), spec, compute, LocalStore(tmp_path), cancel_event=cancel)


def _identity(x: int) -> int:
    return x


def test_values_in_rank_order_and_everything_released(tmp_path: Path) -> None:
    compute = FakeCompute(nodes=2)
    job = _job(_identity, compute, tmp_path, 7, gpus=4, timeout=30)
    before = time.monotonic()
    result = job.run()
    assert result.values == [7, 7, 7, 7]
    assert [r.rank for r in result.ranks] == [0, 1, 2, 3]
    assert result.released == ["2 fake node(s)"] and compute.releases == 1
    (_, deadline), = [c for c in compute.calls if c[0] == "acquire"]
    assert before + 30 - 1 < deadline <= time.monotonic() + 30, "acquire got the job's own deadline"
    left = sorted(p.name for p in (tmp_path / job.run_id).iterdir())
    assert "payload.bin" not in left and "results" not in left and "nodes" not in left


def test_timeout_while_acquiring_is_a_launch_timeout_and_releases_nothing(tmp_path: Path) -> None:
    compute = FakeCompute(acquire_blocks=True)
    job = _job(_identity, compute, tmp_path, 1, timeout=1)
    with pytest.raises(LaunchTimeout) as info:
        job.run()
    assert info.value.phase == "acquire"
    assert compute.releases == 0, "acquire gives back what it got; nothing was allocated"
    assert not (tmp_path / job.run_id / jobfolder.PAYLOAD).exists()


def test_cancel_while_acquiring(tmp_path: Path) -> None:
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    job = _job(_identity, FakeCompute(acquire_blocks=True), tmp_path, 1, cancel=cancel)
    with pytest.raises(JobCancelled):
        job.run()


def _boom() -> None:
    raise KeyError("missing column")


def test_a_failing_rank_raises_its_own_exception(tmp_path: Path) -> None:
    job = _job(_boom, FakeCompute(), tmp_path, gpus=2)
    with pytest.raises(KeyError, match="missing column") as info:
        job.run()
    assert info.value.sgpu_failure.rank in (0, 1)  # type: ignore[attr-defined]
    assert ("stop", 10.0) in job.compute.calls  # type: ignore[attr-defined]


def test_a_node_lost_more_often_than_max_recoveries_fails_the_job_naming_it(tmp_path: Path) -> None:
    compute = FakeCompute(nodes=2, lose_node=1, node_exit={1: 137})
    with pytest.raises(InfrastructureLost, match="node 1 vanished") as info:
        _job(_identity, compute, tmp_path, 1, gpus=2, max_recoveries=2).run()
    assert info.value.node == 1 and "max_recoveries=2" in str(info.value)
    assert [r["gang"] for r in info.value.recoveries] == [1, 2]
    assert compute.acquired == 3 and compute.releases == 3, "every gang's capacity was given back"


def test_max_recoveries_zero_fails_at_the_first_loss(tmp_path: Path) -> None:
    compute = FakeCompute(nodes=2, lose_node=1, node_exit={1: 137})
    with pytest.raises(InfrastructureLost, match="node 1 vanished"):
        _job(_identity, compute, tmp_path, 1, gpus=2, max_recoveries=0).run()
    assert compute.acquired == 1 and compute.releases == 1


def test_a_lost_node_is_recovered_on_new_capacity(tmp_path: Path) -> None:
    compute = FakeCompute(nodes=2, lose_node=1, lose_times=1)
    job = _job(_identity, compute, tmp_path, 5, gpus=2)
    result = job.run()
    assert result.values == [5, 5]
    (recovery,) = result.recoveries
    assert recovery.gang == 1 and recovery.nodes == {1: socket.gethostname()} and "node 1 vanished" in recovery.reason
    assert compute.acquired == 2 and compute.releases == 2
    assert result.released == ["2 fake node(s)", "2 fake node(s)"], "both gangs' capacity is listed"


class _SlowCompute(FakeCompute):
    """Every acquire, stop and release takes a while; the heartbeat's sequence is read before and after."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.beats: dict[str, list[int]] = {}

    def _slowly(self, what: str, folder) -> None:
        """Hold the call until the heartbeat moved three times (or 30 s passed: a loaded machine may
        stall one beat, never all of them), recording how far it moved."""
        before = folder.heartbeat().seq
        until = time.monotonic() + 30.0
        time.sleep(0.2)
        while folder.heartbeat().seq - before < 3 and time.monotonic() < until:
            time.sleep(0.05)
        self.beats.setdefault(what, []).append(folder.heartbeat().seq - before)

    def acquire(self, request, folder, deadline, cancel):
        self._slowly("acquire", folder)
        return super().acquire(request, folder, deadline, cancel)

    def stop(self, allocation, grace: float = 10.0) -> None:
        self._slowly("stop", allocation.folder)
        super().stop(allocation, grace)

    def release(self, allocation):
        self._slowly("release", allocation.folder)
        return super().release(allocation)


def test_the_driver_beats_through_acquire_stop_release_and_relaunch_and_stops_when_its_folder_goes(
        tmp_path: Path, monkeypatch) -> None:
    """The heartbeat is the driver's alone: no compute writes it, and it never pauses while a lost gang
    is stopped, released and acquired again (nodes and sweepers would take the run for dead)."""
    from prefect_sgpu.driver import heartbeat

    monkeypatch.setattr(heartbeat, "HEARTBEAT_INTERVAL_S", 0.05)
    compute = _SlowCompute(nodes=2, lose_node=1, lose_times=1)
    job = _job(_identity, compute, tmp_path, 5, gpus=2)
    assert job.run().values == [5, 5]
    assert len(compute.beats["acquire"]) == 2 and len(compute.beats["release"]) == 2
    for what, advanced in compute.beats.items():
        assert all(n >= 3 for n in advanced), (what, advanced)
    store = LocalStore(tmp_path)
    assert store.get(job.run_id, jobfolder.HEARTBEAT) is None, "the heartbeat went with the control files"
    time.sleep(0.3)
    assert store.get(job.run_id, jobfolder.HEARTBEAT) is None, "and nothing beats after the job"


def _fails_after_peer_loss() -> None:
    raise RuntimeError("Connection closed by peer")  # what a lost node's peers see in a collective


def test_a_peer_failure_explained_by_a_lost_node_is_infrastructure(tmp_path: Path) -> None:
    """Node 0 reports its collective error before node 1 is found lost: still a recovery, not a user error."""
    compute = FakeCompute(nodes=2, lose_node=1, node_exit={1: 137})
    with pytest.raises(InfrastructureLost):
        _job(_fails_after_peer_loss, compute, tmp_path, gpus=2, max_recoveries=0).run()


class _StaleHeartbeatCompute(FakeCompute):
    """In the first gang node 0 stops itself for a stale driver heartbeat (its status says so) while
    node 1's machine goes too (its own watchdog terminated it): a loss, on its face."""

    def _node(self, allocation, node):  # type: ignore[no-untyped-def]
        if node == 0 and self.acquired == 1:
            stopped = f"{jobfolder.HEARTBEAT_STOP} for 12s (ttl 10s)"
            allocation.folder.put_status(0, jobfolder.NodeStatus(node=0, host="fake", exit_code=143,
                                                                 stopped=stopped))
            allocation.codes[0] = 143
            return
        if node == 1 and self.acquired == 1:  # the loss comes after node 0 stopped itself, as described
            poll(lambda: 0 in allocation.codes, bool, "node 0's stop", timeout=30)
        super()._node(allocation, node)


def test_a_node_stopped_for_a_stale_heartbeat_fails_the_job_even_beside_a_lost_one(tmp_path: Path) -> None:
    """No relaunch: a new gang of the same driver would stop the same way. The error names the cause."""
    from prefect_sgpu.errors import HeartbeatExpired

    compute = _StaleHeartbeatCompute(nodes=2, lose_node=1, lose_times=1)
    with pytest.raises(HeartbeatExpired, match=r"node 0 stopped itself: no new driver heartbeat for 12s"):
        _job(_identity, compute, tmp_path, 3, gpus=2, max_recoveries=1).run()
    assert compute.acquired == 1 and compute.releases == 1


def test_a_forged_result_is_ignored(tmp_path: Path) -> None:
    """A rank's place filled with an envelope sealed by someone else is not a result."""

    class ForgingCompute(FakeCompute):
        def _node(self, allocation, node):  # type: ignore[no-untyped-def]
            forger = jobfolder.JobFolder(allocation.folder.store, allocation.run_id, jobfolder.new_key())
            env = payload.success_envelope({"rank": 1, "node": 0, "local_rank": 1, "host": "evil"}, "forged")
            own_put = allocation.folder.put_result

            def put_result(rank: int, body: bytes) -> None:  # rank 1's place is the forger's before any poll
                if rank == 1:
                    forger.put_result(1, payload.dump_envelope(env))
                else:
                    own_put(rank, body)

            allocation.folder.put_result = put_result
            super()._node(allocation, node)

    with pytest.raises(RankFailedError, match=r"rank\(s\) \[1\] exited without a result"):
        _job(_identity, ForgingCompute(), tmp_path, 1, gpus=2).run()


class _AgentDiesUnreported(FakeCompute):
    """Each node's agent dies before it can write a status (an import error on the node),
    leaving only what it printed."""

    def _node(self, allocation: Any, node: int) -> None:
        printed = "".join(f"line {i}\n" for i in range(40)) + (
            "Traceback (most recent call last):\n  File \"node_agent.py\", line 194, in run\n"
            "TypeError: LaunchConfig.__init__() got an unexpected keyword argument 'shutdown_timeout'\n")
        allocation.folder.store.put(allocation.run_id, jobfolder.agent_output_key(node), printed.encode())
        allocation.codes[node] = 1


def test_an_agent_that_dies_unreported_fails_the_job_with_the_end_of_its_output(tmp_path: Path) -> None:
    job = _job(_identity, _AgentDiesUnreported(), tmp_path, 1, gpus=1, timeout=30)
    with pytest.raises(RankFailedError) as info:
        job.run()
    text = str(info.value)
    assert "agent exited with code 1" in text
    assert "unexpected keyword argument 'shutdown_timeout'" in text, text
    assert "line 39" in text and "line 0\n" not in text, "only the end of the output, not all of it"
