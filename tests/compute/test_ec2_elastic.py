"""Elastic jobs on EC2, ``nodes=(min, max)``: launch min to max, seek the rest while EC2 has no capacity,
join them at the next round, end everything with the job.

Against moto server through the fault proxy, whose ``capacity_later`` (``tests/support/capacity_later.py``)
answers ``InsufficientInstanceCapacity`` until capacity returns; minutes of backoff pass on the
``virtual_clock``. The unit tests write the nodes' sealed alive documents themselves (what a booted node
writes); the end-to-end test boots every instance with the simulator and runs real torch elastic.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from prefect_sgpu import distributed, runtime, spec
from prefect_sgpu.compute.base import AllocatedNode, JobLaunch, NodeCommand
from prefect_sgpu.compute.ec2.compute import EC2Allocation, EC2InstanceCompute
from prefect_sgpu.compute.ec2.settings import EC2Settings
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.protocol.jobfolder import Alive, JobFolder
from prefect_sgpu.protocol.versions import runtime_versions

ELASTIC = dict(gpus=3, gpu_type="A10", nodes=(2, 3), remote=True, mlflow=False)


@pytest.fixture
def settings(aws_env: Any, aws_network: Any) -> dict[str, Any]:
    return {"region": aws_env.region, "subnet_ids": aws_network.subnet_ids,
            "instance_profile": aws_env.instance_profile(), "ami_id": aws_env.image_id(),
            "endpoint_url": aws_env.endpoint_url, "max_attempts": 2, "waiter_delay_s": 0.2,
            "running_timeout_s": 30, "placement_group": "cluster", "store_uri": "s3://bucket/jobs"}


def launches(proxy: Any) -> list[tuple[str, str, str]]:
    """(MinCount, MaxCount, error or "") of every RunInstances, in order."""
    return [(c.params["MinCount"], c.params["MaxCount"], c.error or "") for c in proxy.calls("RunInstances")]


# -- the fault proxy's capacity that comes later ---------------------------------------------


@pytest.mark.usefixtures("no_leaked_instances")
def test_capacity_later_refuses_trims_and_returns_after_k_launches_or_a_virtual_time(
        aws_env: Any, aws_network: Any, aws_faults: Any, virtual_clock: Any) -> None:
    ec2 = aws_env.client("ec2", retries={"total_max_attempts": 1})  # each refusal counted once (no SDK retry)
    first, second = aws_network.subnet_ids
    kw = dict(ImageId=aws_env.image_id(), InstanceType="g5.xlarge", SubnetId=first)
    started: list[str] = []
    try:
        # off by default: any launch goes through
        started += [i["InstanceId"] for i in ec2.run_instances(MinCount=1, MaxCount=1, **kw)["Instances"]]
        aws_faults.capacity_later.short("g5.xlarge", zone="us-east-1a", available=2, refusals=2)
        with pytest.raises(ec2.exceptions.ClientError, match="InsufficientInstanceCapacity"):
            ec2.run_instances(MinCount=3, MaxCount=3, **kw)  # MinCount more than fits: none
        got = ec2.run_instances(MinCount=2, MaxCount=3, **kw)["Instances"]  # as many as fit, at least MinCount
        started += [i["InstanceId"] for i in got]
        assert len(got) == 2
        other = ec2.run_instances(MinCount=1, MaxCount=1, **{**kw, "SubnetId": second})["Instances"]
        started += [i["InstanceId"] for i in other]  # another zone has room
        with pytest.raises(ec2.exceptions.ClientError, match="InsufficientInstanceCapacity"):
            ec2.run_instances(MinCount=1, MaxCount=1, **kw)  # the second refusal: capacity returns after it
        started += [i["InstanceId"] for i in ec2.run_instances(MinCount=1, MaxCount=1, **kw)["Instances"]]
        # or once a virtual time passed
        aws_faults.capacity_later.short("g5.xlarge", available=0, after_s=600)
        with pytest.raises(ec2.exceptions.ClientError, match="InsufficientInstanceCapacity"):
            ec2.run_instances(MinCount=1, MaxCount=1, **kw)
        virtual_clock.advance(601)
        started += [i["InstanceId"] for i in ec2.run_instances(MinCount=1, MaxCount=1, **kw)["Instances"]]
    finally:
        if started:
            ec2.terminate_instances(InstanceIds=started)


@pytest.mark.usefixtures("no_leaked_instances")
def test_an_elastic_jobs_first_launch_gets_max_nodes_where_ec2_has_room_for_them(
        settings: dict[str, Any], aws_faults: Any, tmp_path: Any) -> None:
    # EC2 launches as many as fit from MinCount to MaxCount; moto, MinCount (support.capacity_later)
    aws_faults.capacity_later.up_to_max_count = True
    compute = EC2InstanceCompute(EC2Settings(**settings))
    allocation = _allocation(compute, tmp_path, f"r-room-{time.time_ns()}")
    try:
        allocation.instances = compute._provision(allocation, allocation.run_id, time.monotonic() + 300,
                                                  threading.Event())
        assert len(allocation.instances) == 3 and launches(aws_faults) == [("2", "3", "")]
        assert len({m.id for m in allocation.instances}) == 3
    finally:
        compute.release(allocation)


# -- the plan -------------------------------------------------------------------------------


def test_an_elastic_plan_launches_min_to_max_and_a_fixed_one_is_unchanged(settings: dict[str, Any]) -> None:
    compute = EC2InstanceCompute(EC2Settings(**settings))
    request = compute.plan(spec.JobSpec(**ELASTIC), "r-plan")
    assert (request.plan.nodes, request.plan.min_nodes, request.plan.elastic) == (3, 2, True)
    assert {(a.params["MinCount"], a.params["MaxCount"]) for a in request.run_instances} == {(2, 3)}
    assert request.describe()["run_instances"]["MinCount"] == 2  # what dry_run shows is what is sent
    fixed = compute.plan(spec.JobSpec(gpus=3, gpu_type="A10", remote=True, mlflow=False), "r-fixed")
    assert {(a.params["MinCount"], a.params["MaxCount"]) for a in fixed.run_instances} == {(3, 3)}
    warm = EC2InstanceCompute(EC2Settings(**settings, keep_warm=60))
    with pytest.raises(SGPUConfigError) as info:
        warm.plan(spec.JobSpec(**ELASTIC), "r-warm")
    assert info.value.field == "nodes" and "keep_warm=60" in str(info.value)
    assert warm.plan(spec.JobSpec(**ELASTIC, fresh_machines=True), "r-fresh").plan.elastic
    with pytest.raises(SGPUConfigError, match="elastic_seek_s=-1"):
        EC2Settings(**settings, elastic_seek_s=-1)


# -- the search for the missing nodes -------------------------------------------------------


def _allocation(compute: EC2InstanceCompute, tmp_path: Any, run_id: str) -> EC2Allocation:
    request = compute.plan(spec.JobSpec(**ELASTIC), run_id)
    return EC2Allocation(request=request, folder=JobFolder.local(tmp_path / run_id, "00" * 32), nodes=[],
                         started=time.time(), progress=lambda *args: None)


def _announce(allocation: EC2Allocation, node: int, instance_id: str) -> None:
    """What a booted node writes: its sealed alive document, bound to its node and instance."""
    allocation.folder.put_alive(node, Alive(phase="waiting", seq=1, time=time.time(), versions=runtime_versions()),
                                instance_id=instance_id)


def _acquired(compute: EC2InstanceCompute, allocation: EC2Allocation, deadline: float) -> None:
    """acquire's part up to its return: the first launch, the first nodes announced, the search opened."""
    allocation.instances = compute._provision(allocation, allocation.run_id, deadline, threading.Event())
    for node, machine in enumerate(allocation.instances):
        _announce(allocation, node, machine.id)
    compute._wait_for_agents(allocation, deadline, threading.Event())
    allocation.growth.open.set()


def _until(what: Any, seconds: float = 60.0) -> None:
    limit = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < limit, "timed out"
        time.sleep(0.05)


@pytest.mark.usefixtures("no_leaked_instances")
def test_the_missing_node_is_launched_when_capacity_returns_and_joins_the_running_job(
        settings: dict[str, Any], aws_faults: Any, virtual_clock: Any, tmp_path: Any) -> None:
    aws_faults.capacity_later.short("g5.xlarge", available=2, refusals=3)
    compute = EC2InstanceCompute(EC2Settings(**settings))
    allocation = _allocation(compute, tmp_path, "r-grow")
    deadline = time.monotonic() + 300
    began = virtual_clock.monotonic()
    try:
        _acquired(compute, allocation, deadline)
        assert [n.index for n in allocation.nodes] == [0, 1]  # the job starts on min
        commands: list[tuple[int, str]] = []

        def node_command(node: int, address: str) -> NodeCommand:
            commands.append((node, address))
            return NodeCommand(node, ["agent", f"--node-index={node}", f"--local-addr={address}"])

        compute.start(allocation, JobLaunch(env={"X": "1"}, rendezvous="r:1", node_command=node_command,
                                            commands=[NodeCommand(n.index, ["agent", f"--node-index={n.index}"])
                                                      for n in allocation.nodes]))
        _until(lambda: allocation.growth.pending is not None)
        late = allocation.growth.pending
        assert [n.index for n in allocation.nodes] == [0, 1], "a machine joins once its node announced itself"
        _announce(allocation, 2, late.id)
        _until(lambda: len(allocation.nodes) == 3)
        assert allocation.nodes[2] == AllocatedNode(2, late.private_ip, late.id, late.id)
        assert allocation.instances[2] is late and allocation.joined[late.id] >= allocation.started
        # its launch document, made by the driver's node_command, bound to node 2 and its instance
        assert commands == [(2, late.private_ip)]
        assert allocation.folder.launch(2, instance_id=late.id).argv[1] == "--node-index=2"
        assert allocation.folder.launch(0, instance_id=allocation.instances[0].id) is not None
        # the first launch got 2 of 3; node 2 alone was refused three times, then launched
        assert launches(aws_faults) == [("2", "3", ""), *[("1", "1", "InsufficientInstanceCapacity")] * 3,
                                        ("1", "1", "")]
        # at least 30 s apart on the virtual clock: the search sleeps in slices, and the real time between
        # them counts on that clock too, so the sum of its sleeps alone can fall short of 3 x 30 s
        assert virtual_clock.monotonic() - began >= 3 * 30.0
        # the search says so after its join returned (node 2 in the allocation): on a busy machine, later
        _until(lambda: bool(allocation.growth.outcome))
        assert allocation.growth.outcome.startswith("every node up"), allocation.growth.outcome
    finally:
        released = compute.release(allocation)
    assert len(released.cost["instances"]) == 3  # each instance priced from its own launch


@pytest.mark.usefixtures("no_leaked_instances")
def test_the_search_gives_up_at_elastic_seek_s_and_the_job_keeps_its_nodes(
        settings: dict[str, Any], aws_faults: Any, virtual_clock: Any, tmp_path: Any) -> None:
    aws_faults.capacity_later.short("g5.xlarge", available=2)  # no more until restored: never, here
    compute = EC2InstanceCompute(EC2Settings(**settings, elastic_seek_s=900))
    allocation = _allocation(compute, tmp_path, "r-give-up")
    try:
        _acquired(compute, allocation, time.monotonic() + 300)
        allocation.growth.thread.join(60)
        assert not allocation.growth.thread.is_alive()
        assert allocation.growth.outcome.startswith("gave up on node 2")
        assert 900 - 300 <= virtual_clock.waited_s <= 900 + 5
        refused = launches(aws_faults)[1:]
        assert refused and all(r == ("1", "1", "InsufficientInstanceCapacity") for r in refused)
        assert [n.index for n in allocation.nodes] == [0, 1]
    finally:
        compute.release(allocation)


@pytest.mark.usefixtures("no_leaked_instances")
def test_a_job_that_ends_while_its_late_node_boots_ends_that_instance_too_and_pays_for_it(
        settings: dict[str, Any], aws_faults: Any, aws_env: Any, virtual_clock: Any, tmp_path: Any) -> None:
    aws_faults.capacity_later.short("g5.xlarge", available=2, refusals=1)
    compute = EC2InstanceCompute(EC2Settings(**settings))
    allocation = _allocation(compute, tmp_path, "r-elastic-ends-early")
    try:
        _acquired(compute, allocation, time.monotonic() + 300)
        _until(lambda: allocation.growth.pending is not None)
        late = allocation.growth.pending
    finally:
        released = compute.release(allocation)
    assert late.id in released.gone and not allocation.growth.thread.is_alive()
    assert late.id in {i["id"] for i in released.cost["instances"]}
    states = aws_env.client("ec2").describe_instances(InstanceIds=[late.id])["Reservations"][0]["Instances"]
    assert states[0]["State"]["Name"] in ("shutting-down", "terminated")


# -- end to end -----------------------------------------------------------------------------


def _grow() -> dict:
    """Waits, in a world of two nodes, to be restarted when the third joins; then all-reduces."""
    import torch
    import torch.distributed as dist

    if runtime.world_size() < 3:
        until = time.monotonic() + 240
        while time.monotonic() < until:  # the joining node restarts these ranks in a larger world
            runtime.progress(0, force=True)
            time.sleep(0.2)
        return {"world": runtime.world_size()}
    runtime.init_process_group("gloo")
    t = torch.tensor([float(runtime.rank() + 1)])
    dist.all_reduce(t)
    return {"rank": runtime.rank(), "world": runtime.world_size(), "sum": t.item(),
            "changed": runtime.world_size_changed(), "previous": runtime.previous_world_size(),
            "round": runtime.membership_round()}


@pytest.mark.e2e
def test_a_three_node_elastic_job_starts_on_two_and_grows_to_three_when_capacity_returns(
        ec2: Any, virtual_clock: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_SGPU_ELASTIC_WAIT_S", "1")
    assert ec2.proxy is not None
    ec2.proxy.capacity_later.short("g5.xlarge", available=2)  # the third launch: no capacity until restored
    compute = ec2.compute(elastic_seek_s=86400)
    fn = distributed(**{**ELASTIC, "mlflow": False}, compute=compute, timeout=400)(_grow)
    job = fn.job()

    def restore_once_running() -> None:  # capacity returns once the job runs on its first two nodes
        store = ec2.store()
        _until(lambda: bool(store.get(job.run_id, "progress/rank-0")), 300)  # b"": not yet
        restored.append(time.monotonic())
        ec2.proxy.capacity_later.restore()

    restored: list[float] = []
    helper = threading.Thread(target=restore_once_running, daemon=True)
    helper.start()
    result = job.run()
    values = result.values
    refused = [c for c in ec2.proxy.calls("RunInstances") if c.error == "InsufficientInstanceCapacity"]
    seen = (ec2.proxy.capacity_later.seen, restored, job.allocation.growth.outcome, values)
    # the third instance was refused until the job's ranks ran in a world of two (only those write progress)
    assert refused and restored, seen
    assert [v["rank"] for v in values] == [0, 1, 2]  # then it grew: the last round's ranks, all three nodes
    assert all(v["world"] == 3 and v["sum"] == 6.0 for v in values), seen
    # the same gang, in its next round (no recovery relaunched it)
    assert all(v["changed"] is True and v["previous"] == 2 and v["round"] >= 1 for v in values), seen
    assert result.recoveries == [], result.recoveries
    assert job.allocation.growth.joined == [2] and job.allocation.growth.outcome.startswith("every node up")
    instances = ec2.instances(result.run_id)
    assert len(instances) == 3 and all(i["State"]["Name"] == "terminated" for i in instances)
    assert len(result.cost["instances"]) == 3
    late = next(i for i in instances if i["InstanceId"] == job.allocation.instances[2].id)
    assert {i["InstanceId"] for i in instances} <= set(result.released) and late


def _regrow() -> dict:
    """Reports its world as its step (rank 0's progress: 300 at three nodes, 200 at two) and waits to be
    restarted in the next round; once the world grew back from two to three, all-reduces."""
    import torch
    import torch.distributed as dist

    world = runtime.world_size()
    if not (world == 3 and runtime.previous_world_size() == 2):
        until = time.monotonic() + 300
        while time.monotonic() < until:  # a lost node, then its replacement, restarts these ranks
            runtime.progress(world * 100, force=True)
            time.sleep(0.2)
        return {"world": world}
    runtime.init_process_group("gloo")
    t = torch.tensor([float(runtime.rank() + 1)])
    dist.all_reduce(t)
    return {"rank": runtime.rank(), "world": world, "sum": t.item(), "previous": runtime.previous_world_size(),
            "round": runtime.membership_round()}


@pytest.mark.e2e
def test_a_three_node_elastic_job_losing_a_node_goes_on_at_two_and_grows_back_to_three(
        ec2: Any, virtual_clock: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect_sgpu.observe.progress_watch import parse_progress
    from prefect_sgpu.protocol.rank_progress import read_line

    # the first round waits for all three agents (it completes at once when the third joins; on a busy machine
    # it can come seconds after the others), the round after the loss 20 s
    monkeypatch.setenv("PREFECT_SGPU_ELASTIC_WAIT_S", "20")
    monkeypatch.setenv("PREFECT_SGPU_ELASTIC_LOST_AFTER_S", "3")
    assert ec2.proxy is not None
    ec2.proxy.capacity_later.up_to_max_count = True  # the first launch gets all three, as on EC2
    compute = ec2.compute(elastic_seek_s=86400)
    fn = distributed(**{**ELASTIC, "mlflow": False}, compute=compute, timeout=500)(_regrow)
    job = fn.job()
    seen: list[Any] = []

    def step() -> int:
        try:
            line = read_line(ec2.store(), job.run_id, 0, job.folder.key, job.folder.gang)
        except Exception:  # noqa: BLE001 - not there yet
            return 0
        found = parse_progress(line.encode() if line else None, time.time())
        return found[0] if found else 0

    def lose_node_2_then_restore() -> None:
        _until(lambda: step() == 300, 300)  # all three nodes up, ranks at world 3
        ec2.proxy.capacity_later.short("g5.xlarge", available=0)  # no machine for the replacement yet
        lost = job.allocation.instances[2].id
        seen.append(lost)
        ec2.aws.client("ec2").terminate_instances(InstanceIds=[lost])
        _until(lambda: step() == 200, 300)  # rank 0 went on at world 2
        seen.append(len([c for c in ec2.proxy.calls("RunInstances") if c.error == "InsufficientInstanceCapacity"]))
        ec2.proxy.capacity_later.restore()

    helper = threading.Thread(target=lose_node_2_then_restore, daemon=True)
    helper.start()
    began = time.time()
    result = job.run()
    wall = time.time() - began
    values = result.values
    assert len(seen) == 2 and seen[1] >= 1, (seen, values)  # the replacement was refused while the job ran at 2
    assert launches(ec2.proxy)[0] == ("2", "3", "") and job.allocation.growth is None  # three at once
    assert [v["rank"] for v in values] == [0, 1, 2], values
    assert all(v["world"] == 3 and v["sum"] == 6.0 and v["previous"] == 2 for v in values), values
    assert result.recoveries == [], result.recoveries  # no relaunch: the same gang went on, then grew
    rows = [(c.nodes, c.world_size, c.joined, c.left) for c in result.membership]
    assert rows == [([0, 1, 2], 3, [], []), ([0, 1], 2, [], [2]), ([0, 1, 2], 3, [2], [])], rows
    lost, back = seen[0], job.allocation.instances[2].id
    assert back != lost and lost in result.released
    instances = ec2.instances(result.run_id)
    assert len(instances) == 4 and all(i["State"]["Name"] == "terminated" for i in instances)
    assert {i["InstanceId"] for i in instances} <= set(result.released) | {lost}
    assert {i["id"] for i in result.cost["instances"]} >= {lost, back}
    # each priced for its own time: nodes 0 and 1 for the job, the lost one until it was replaced, the
    # replacement from its launch (which capacity held back), so less than three machines for the whole job
    assert result.cost["instance_hours"] * 3600 < 3 * wall, (result.cost["instance_hours"], wall)
