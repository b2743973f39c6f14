"""Results are bound to the gang that wrote them: after a relaunch, a lost gang's sealed result that a
store writer kept and writes back is not the new gang's result. The driver against the fake compute
(real job folder on a local store, real sealing), and the rank's own side through ``rank_main``."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from prefect_sgpu import spec as spec_mod
from prefect_sgpu.protocol import jobfolder
from prefect_sgpu.protocol import payload
from prefect_sgpu.driver.job import Job
from prefect_sgpu.errors import DocumentRefused, RankFailedError
from prefect_sgpu.store import LocalStore
from support.fake_compute import FakeCompute

REPO = Path(__file__).resolve().parents[1]


def _identity(x: int) -> int:
    return x


class _ReplayingCompute(FakeCompute):
    """Node 1 is lost in the first gang; a store writer keeps rank 0's sealed result of that gang and,
    in the next gang, writes it in rank 0's place instead of the new one."""

    def __init__(self) -> None:
        super().__init__(nodes=2, lose_node=1, lose_times=1)
        self.kept: bytes | None = None
        self.first_kept = threading.Event()

    def _node(self, allocation: Any, node: int) -> None:
        folder = allocation.folder
        if node == 1 and self.acquired == 1:  # node 1 is lost only once node 0's first result is kept:
            self.first_kept.wait(60)          # else the relaunch may overtake it (its result then sealed for gang 1)
        if node == 0 and self.kept is not None:
            own_put = folder.put_result

            def put_result(rank: int, body: bytes) -> None:
                if rank == 0:
                    folder.store.put(folder.run_id, jobfolder.result_key(0), self.kept)
                else:
                    own_put(rank, body)

            folder.put_result = put_result
        super()._node(allocation, node)
        if node == 0 and self.kept is None:
            self.kept = folder.store.get(folder.run_id, jobfolder.result_key(0))
            self.first_kept.set()


def test_a_lost_gangs_result_written_back_after_the_relaunch_is_refused(tmp_path: Path) -> None:
    compute = _ReplayingCompute()
    spec = spec_mod.merge(spec_mod.layer("call", mlflow=False, gpus=2))
    job = Job(payload.FunctionCall(_identity, (7,)), spec, compute, LocalStore(tmp_path), cancel_event=None)
    with pytest.raises(RankFailedError, match=r"rank\(s\) \[0\] exited without a result"):
        job.run()
    assert compute.kept is not None and compute.acquired == 2, "the first gang's result was written back"


def test_a_relaunched_gangs_documents_are_bound_to_it(tmp_path: Path) -> None:
    """Each gang reads only its own results; the rank learns its gang from its environment."""
    store = LocalStore(tmp_path)
    folder = jobfolder.JobFolder(store, "run-g", jobfolder.new_key())
    folder.put_result(0, b"first gang")
    assert folder.results() == {0: b"first gang"}
    kept = store.get("run-g", jobfolder.result_key(0))
    folder.reset_for_relaunch(1)
    assert folder.gang == 1 and folder.results() == {}
    store.put("run-g", jobfolder.result_key(0), kept)
    assert folder.results() == {}, "the first gang's result counts in the second"
    with pytest.raises(DocumentRefused, match="gang=1"):
        jobfolder.unseal(kept, folder.key, "result", "run-g", rank=0, gang=1)

    # the rank's side: rank_main seals its result for the gang named in its environment
    job_dir = tmp_path / "node" / "run-g"
    job_dir.mkdir(parents=True)
    node = jobfolder.JobFolder.local(job_dir, folder.key)
    node.put_payload(payload.build(payload.FunctionCall(_identity, (3,))))
    env = {**os.environ, "SGPU_PAYLOAD_KEY": folder.key, "SGPU_JOB_DIR": str(job_dir), "RANK": "0",
           jobfolder.GANG_ENV: "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    done = subprocess.run([sys.executable, "-m", "prefect_sgpu.launch.rank_main"], env=env, timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, (done.stdout, done.stderr)
    node.gang = 1
    (body,) = node.results().values()
    assert payload.load_envelope(body).value() == 3


# -- the stop is bound to its gang, as results are ------------------------------------------------


def _node(store: LocalStore, run_id: str, key: str, tmp_path: Path, gang: int, lease: bool = False) -> Any:
    """A node's real bootstrap over the store, with the fake cloud's host (identity, secrets)."""
    from prefect_sgpu.launch.bootstrap import NodeBootstrap
    from prefect_sgpu.launch.node_host import NodeIdentity
    from support.fake_node_host import FakeNodeHost

    identity = NodeIdentity(f"fake-gang{gang}", 0, "127.0.0.1")
    machine = tmp_path / f"machine-{gang}-{lease}"
    machine.mkdir()
    host = FakeNodeHost(identity, machine, machine)
    return NodeBootstrap(store, run_id, identity, machine / "jobs", heartbeat_ttl=60.0, interval=0.05,
                         key=key, host=host, gang=gang, lease=lease)


def test_a_lost_gangs_stop_written_back_after_the_relaunch_stops_no_node_of_the_new_gang(tmp_path: Path) -> None:
    """The driver stops gang 0 (its node was lost) and relaunches; a store writer keeps gang 0's sealed stop
    and writes it back. Gang 1's node (its gang from its boot arguments) does not take it for its own
    stop; the stop the driver writes for gang 1 it obeys. Gang 0's stop is sealed as before gangs were bound."""
    store = LocalStore(tmp_path / "store")
    driver = jobfolder.JobFolder(store, "run-s", jobfolder.new_key())
    driver.beat()
    old = _node(store, "run-s", driver.key, tmp_path, gang=0)
    driver.put_stop(10.0, reason="stopped by the driver")
    kept = store.get("run-s", jobfolder.STOP)
    assert kept is not None and old.stop_requested(), "a node of gang 0 obeys gang 0's stop"
    # the first gang's stop carries no gang in its seal: what every earlier writer and reader used
    assert jobfolder.unseal(kept, driver.key, "stop", "run-s").startswith(b"{")

    driver.reset_for_relaunch(1)
    new = _node(store, "run-s", driver.key, tmp_path, gang=1)
    assert not new.stop_requested()
    store.put("run-s", jobfolder.STOP, kept)  # the store writer's replay
    assert driver.stop() is None, "the driver reads gang 0's stop as gang 1's"
    assert not new.stop_requested(), "gang 0's stop, written back, stops gang 1's node"
    with pytest.raises(DocumentRefused, match="gang=1"):
        jobfolder.unseal(kept, driver.key, "stop", "run-s", gang=1)

    # the node waits for its launch document past the replayed stop (as it waits past a forged one)
    waited: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: waited.update(doc=new.wait_for_launch()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while jobfolder.STOP not in new.folder._refused and time.monotonic() < deadline:
        time.sleep(0.02)
    assert jobfolder.STOP in new.folder._refused, "the node never read the replayed stop"
    assert thread.is_alive(), f"the node stopped waiting on gang 0's stop: {waited}"
    # gang 0's launch (bound to this node and instance, but of the lost gang) is waited past too
    driver.put_launches({0: (jobfolder.LaunchDocument(argv=["python", "-c", "pass"]), new.identity.instance_id)})
    time.sleep(1.0)
    assert thread.is_alive(), f"the node took gang 0's launch document: {waited}"
    doc = jobfolder.LaunchDocument(argv=["python", "-c", "pass"], gang=1)
    driver.put_launches({0: (doc, new.identity.instance_id)})
    thread.join(timeout=30)
    assert waited.get("doc") == doc

    driver.put_stop(10.0, reason="stopped by the driver")  # gang 1's own stop
    assert new.stop_requested() and not old.stop_requested()


def test_a_lease_node_obeys_only_the_stop_of_the_gang_its_assignment_names(tmp_path: Path) -> None:
    """On a warm lease the node learns the job's gang from its sealed assignment; the lease's own stop
    (the lease is closed) is gang 0's, in the lease's folder."""
    store = LocalStore(tmp_path / "store")
    lease = jobfolder.JobFolder(store, "run-l-lease1", jobfolder.new_key())
    job = jobfolder.JobFolder(store, "run-l", jobfolder.new_key())
    node = _node(store, lease.run_id, lease.key, tmp_path, gang=0, lease=True)
    lease.put_assignments({0: (jobfolder.Assign(run_id="run-l", seq=1, gang=1), node.identity.instance_id)})
    assigned = node.folder.assignment(0, instance_id=node.identity.instance_id)
    assert assigned is not None and assigned.gang == 1
    job.put_stop(10.0)  # gang 0's, kept by the store writer
    kept = store.get("run-l", jobfolder.STOP)
    job.reset_for_relaunch(1)
    store.put("run-l", jobfolder.STOP, kept)
    node.enter("run-l", job.key, assigned.gang)
    assert not node.stop_requested()
    job.put_stop(10.0)
    assert node.stop_requested()
    node.enter(lease.run_id, lease.key)  # back in the lease's folder: its stop is gang 0's
    assert not node.stop_requested()
    lease.put_stop(0.0, reason="the warm lease was closed")
    assert node.stop_requested()


def test_a_relaunched_ec2_gangs_user_data_names_its_gang(aws_env: Any) -> None:
    """EC2 nodes learn their gang from their user-data, which only the driver writes."""
    from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute
    from prefect_sgpu.launch.bootstrap import parse_args
    from prefect_sgpu.spec import JobSpec

    settings = {"store_uri": "s3://bucket/jobs", "subnet_ids": ["subnet-0123456789abcdef0"]}
    compute = EC2InstanceCompute.from_settings(settings, session=aws_env.session())
    first = compute.plan(JobSpec(gpus=1, gpu_type="A10", remote=True), "run-u")
    second = compute.replan(first, 1)

    def gang(user_data: str) -> int:
        line = next(x for x in user_data.splitlines() if "prefect_sgpu.launch.bootstrap" in x)
        return parse_args(shlex.split(line)[3:-1]).gang

    assert gang(first.user_data) == 0 and "--gang" not in first.user_data
    assert gang(second.user_data) == 1
    assert all(a.params["UserData"] == second.user_data for a in second.run_instances)
    assert {a.params["ClientToken"] for a in first.run_instances}.isdisjoint(
        a.params["ClientToken"] for a in second.run_instances)
