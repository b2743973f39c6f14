"""EC2 capacity as it really is: cluster placement groups bound to a zone, reservation slots that
come back minutes after a termination, Capacity Blocks, and boot times by instance family.

Against moto server through the fault proxy (``tests/support/aws_fault_proxy.py``), whose
``bind_placement_zones``, ``reservation_release_s`` and capacity-block reservations model what
moto lacks; minutes of waiting pass on the ``virtual_clock``.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import replace
from typing import Any

import pytest

from prefect_sgpu import spec
from prefect_sgpu.compute.ec2 import capacity
from prefect_sgpu.compute.ec2.instances import EC2Provisioner, EC2Settings
from prefect_sgpu.errors import ProvisioningError

pytestmark = pytest.mark.usefixtures("no_leaked_instances")

USER_DATA = "#!/bin/bash\necho node-bootstrap\n"


def make_plan(gpus: int = 2, gpu_type: str = "A10") -> spec.Plan:
    return spec.plan_remote(spec.JobSpec(gpus=gpus, gpu_type=gpu_type, remote=True))


@pytest.fixture
def settings(aws_env: Any, aws_network: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.delenv("PREFECT_SGPU_SKIP_RESERVATION", raising=False)
    return {
        "region": aws_env.region, "subnet_ids": aws_network.subnet_ids,
        "instance_profile": aws_env.instance_profile(), "ami_id": aws_env.image_id(),
        "endpoint_url": aws_env.endpoint_url, "max_attempts": 2, "waiter_delay_s": 0.2, "running_timeout_s": 30,
        "placement_group": "cluster",  # the cluster group's zone is the subject (auto leaves g5 without one)
    }


def one_node_attempts(prov: EC2Provisioner, run_id: str, node: int) -> tuple:
    """A lost node's replacement as the EC2 compute renders it: one instance, a token of its own."""
    from prefect_sgpu.compute.ec2 import request as rq

    one = replace(make_plan(2, "A10"), nodes=1)
    return one, tuple(replace(a, params={**a.params, "ClientToken": rq.client_token(run_id, i, 1, node)})
                      for i, a in enumerate(prov.attempts(run_id, one, USER_DATA)))


def live(aws_env: Any, ids: list[str]) -> set[str]:
    found = aws_env.client("ec2").describe_instances(InstanceIds=ids)["Reservations"]
    return {i["InstanceId"] for r in found for i in r["Instances"] if i["State"]["Name"] == "running"}


# -- boot times ----------------------------------------------------------------------------


def test_boot_timeout_scales_with_the_instance_family_and_shows_in_the_dry_run(aws_env: Any) -> None:
    assert capacity.boot_timeout_s("g5.xlarge") == capacity.boot_timeout_s("g6.12xlarge") == 900.0
    for big in ("p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge",
                "trn1.32xlarge", "trn2.48xlarge"):
        assert capacity.boot_timeout_s(big) >= 2 * capacity.boot_timeout_s("g5.xlarge"), big
    assert capacity.boot_timeout_s("x9.unknown") == capacity.DEFAULT_BOOT_TIMEOUT_S
    assert capacity.boot_timeout_s("p5.48xlarge", configured=120.0) == 120.0  # the user's own wins

    from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute

    base = dict(region="us-east-1", store_uri="s3://bucket/jobs", subnet_ids=["subnet-0123456789abcdef0"],
                instance_profile="nodes", ami_id="ami-0123456789abcdef0")
    compute = EC2InstanceCompute(EC2Settings(**base))
    p5 = compute.plan(spec.JobSpec(gpus=16, gpu_type="H100", remote=True), "r-p5").describe()
    g5 = compute.plan(spec.JobSpec(gpus=2, gpu_type="A10", remote=True), "r-g5").describe()
    assert (p5["run_instances"]["InstanceType"], p5["agent_timeout_s"]) == ("p5.48xlarge", 2700.0)
    assert (g5["run_instances"]["InstanceType"], g5["agent_timeout_s"]) == ("g5.xlarge", 900.0)
    mine = EC2InstanceCompute(EC2Settings(**base, agent_timeout_s=300.0))
    assert mine.plan(spec.JobSpec(gpus=16, gpu_type="H100", remote=True), "r").describe()["agent_timeout_s"] == 300.0


def test_the_agents_wait_the_requests_boot_time_counted_from_running(
    settings: dict[str, Any], aws_env: Any, tmp_path: Any
) -> None:
    """The wait for the agents is the request's (its instance type's boot time, not the compute's
    ``agent_timeout_s``), and starts once the instances run: provisioning's wait for ``running``
    is over before it."""
    import threading

    from prefect_sgpu.compute.ec2.compute import EC2Allocation, EC2InstanceCompute
    from prefect_sgpu.errors import LaunchTimeout
    from prefect_sgpu.protocol.jobfolder import JobFolder

    compute = EC2InstanceCompute(EC2Settings(**settings, store_uri="s3://bucket/jobs"))
    request = compute.plan(spec.JobSpec(gpus=2, gpu_type="A10", remote=True, mlflow=False), "r-boot")
    assert compute.agent_timeout_s == request.agent_timeout_s == 900.0
    request = replace(request, agent_timeout_s=2.0)  # a family's boot time, short enough to wait out here
    instances = compute.provisioner.provision("r-boot", request.plan, USER_DATA)
    try:
        assert live(aws_env, [i.id for i in instances]) == {i.id for i in instances}  # booted: running
        allocation = EC2Allocation(request=request, folder=JobFolder.local(tmp_path / "r-boot", "00" * 32),
                                   nodes=[], instances=instances, progress=lambda *_: None)
        started = time.monotonic()
        with pytest.raises(LaunchTimeout) as info:
            compute._wait_for_agents(allocation, time.monotonic() + 20.0, threading.Event())
        assert 2.0 <= time.monotonic() - started < 10.0
        assert info.value.phase == "agent start" and "2" in str(info.value)
    finally:
        compute.provisioner.terminate("r-boot")


# -- a cluster placement group is bound to a zone ---------------------------------------


def test_a_replacement_launches_in_the_kept_nodes_zone_and_a_failure_ends_only_its_own(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    first, second = settings["subnet_ids"]
    aws_faults.bind_placement_zones = True
    run_id = "r-bound"
    prov = EC2Provisioner(EC2Settings(**settings))
    kept = prov.provision(run_id, make_plan(2, "A10"), USER_DATA)
    try:
        assert {i.availability_zone for i in kept} == {"us-east-1a"}
        # the node's replacement with the second zone's subnet listed first (a block edited since)
        other = EC2Provisioner(EC2Settings(**{**settings, "subnet_ids": [second, first]}))
        one, attempts = one_node_attempts(other, run_id, node=1)
        ec2 = aws_env.client("ec2")
        # what AWS does with a launch into the group from the other zone
        from botocore.exceptions import ClientError

        with pytest.raises(ClientError, match="InvalidPlacementGroup.InUse"):
            ec2.run_instances(**{**attempts[0].resolved(settings["ami_id"], kept_group(aws_env, run_id),
                                                        "/dev/sda1"), "ClientToken": "t-other-zone"})
        aws_faults.reset()
        aws_faults.bind_placement_zones = True
        prov.terminate_machines([kept[1].id])
        (new,) = other.provision(run_id, one, USER_DATA, attempts=attempts, zone="us-east-1a", alone=True)
        assert new.availability_zone == "us-east-1a"
        assert [c.params["SubnetId"] for c in aws_faults.calls("RunInstances")] == [first]

        # a replacement that finds no capacity ends only what it launched: the kept node runs on
        aws_faults.fail("RunInstances", "InsufficientInstanceCapacity", message="no capacity")
        one, attempts = one_node_attempts(other, run_id, node=0)
        with pytest.raises(ProvisioningError, match="could not launch"):
            other.provision(run_id, one, USER_DATA, attempts=attempts, zone="us-east-1a", alone=True)
        assert live(aws_env, [kept[0].id, new.id]) == {kept[0].id, new.id}
        groups = ec2.describe_placement_groups(Filters=[{"Name": "tag:sgpu:run-id", "Values": [run_id]}])
        assert [g["GroupName"] for g in groups["PlacementGroups"]] == [f"sgpu-{run_id}"]
    finally:
        aws_faults.reset()
        prov.terminate(run_id)


def kept_group(aws_env: Any, run_id: str) -> str:
    groups = aws_env.client("ec2").describe_security_groups(
        Filters=[{"Name": "tag:sgpu:run-id", "Values": [run_id]}])["SecurityGroups"]
    return groups[0]["GroupId"]


# -- a reservation's slot comes back minutes after the termination ------------------------


def test_a_replacement_inside_a_reservation_waits_minutes_for_the_lost_slot(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any, virtual_clock: Any
) -> None:
    rid = aws_faults.add_capacity_reservation("g5.xlarge", "us-east-1a", 2)
    aws_faults.reservation_release_s = 240.0
    run_id = "r-slot"
    prov = EC2Provisioner(EC2Settings(**settings, capacity_reservation_id=rid))
    kept = prov.provision(run_id, make_plan(2, "A10"), USER_DATA)
    try:
        prov.terminate_machines([kept[1].id])
        aws_faults.requests.clear()
        one, attempts = one_node_attempts(prov, run_id, node=1)
        said: list[str] = []
        (new,) = prov.provision(run_id, one, USER_DATA, attempts=attempts, zone="us-east-1a", alone=True,
                                deadline=time.monotonic() + 3600, progress=said.append)
        assert new.market == "reserved"
        answers = [c.error for c in aws_faults.calls("RunInstances")]
        assert answers[0] == "ReservationCapacityExceeded" and answers[-1] is None, answers
        assert set(answers[:-1]) == {"ReservationCapacityExceeded"}
        assert 240.0 <= virtual_clock.waited_s <= 240.0 + capacity.SLOT_WAIT_CAP_S
        assert min(virtual_clock.slept) >= capacity.SLOT_WAIT_FLOOR_S
        assert any("succeeded after waiting" in line for line in said), said
        assert live(aws_env, [kept[0].id]) == {kept[0].id}
    finally:
        prov.terminate(run_id)


def test_a_slot_that_does_not_come_back_within_the_budget_fails_the_replacement_alone(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any, virtual_clock: Any
) -> None:
    rid = aws_faults.add_capacity_reservation("g5.xlarge", "us-east-1a", 2)
    aws_faults.reservation_release_s = 3600.0
    run_id = "r-slot-late"
    prov = EC2Provisioner(EC2Settings(**settings, capacity_reservation_id=rid, reservation_slot_wait_s=300.0))
    kept = prov.provision(run_id, make_plan(2, "A10"), USER_DATA)
    try:
        prov.terminate_machines([kept[1].id])
        one, attempts = one_node_attempts(prov, run_id, node=1)
        with pytest.raises(ProvisioningError, match="ReservationCapacityExceeded"):
            prov.provision(run_id, one, USER_DATA, attempts=attempts, zone="us-east-1a", alone=True)
        assert 290.0 <= virtual_clock.waited_s <= 300.0  # the budget, less the real time the calls took
        assert live(aws_env, [kept[0].id]) == {kept[0].id}
    finally:
        prov.terminate(run_id)


# -- Capacity Blocks ---------------------------------------------------------------------


def test_a_capacity_block_is_launched_as_one_into_its_placement_group_and_its_end_is_warned_of(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    ends = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=20)).strftime("%Y-%m-%dT%H:%M:%S.000Z")
    rid = aws_faults.add_capacity_reservation("g5.xlarge", "us-east-1a", 2, reservation_type="capacity-block",
                                              placement_group="cb-group-1", end_date=ends)
    ec2 = aws_env.client("ec2")
    (found,) = ec2.describe_capacity_reservations(CapacityReservationIds=[rid])["CapacityReservations"]
    block = capacity.reservation_of(found)
    assert (block.capacity_block, block.placement_group, block.zone) == (True, "cb-group-1", "us-east-1a")

    # what AWS answers a launch into the block without the capacity-block market type
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError, match="InvalidParameterValue.*market type"):
        ec2.run_instances(ImageId=settings["ami_id"], InstanceType="g5.xlarge", MinCount=1, MaxCount=1,
                          SubnetId=settings["subnet_ids"][0], Placement={"GroupName": "cb-group-1"},
                          CapacityReservationSpecification={"CapacityReservationTarget": {
                              "CapacityReservationId": rid}})

    run_id = "r-block"
    prov = EC2Provisioner(EC2Settings(**settings, capacity_reservation_id=rid))
    said: list[str] = []
    try:
        instances = prov.provision(run_id, make_plan(2, "A10"), USER_DATA, progress=said.append,
                                   deadline=time.monotonic() + 3600)
        assert {i.market for i in instances} == {"reserved"}
        (call,) = [c.params for c in aws_faults.calls("RunInstances")][-1:]
        assert call["InstanceMarketOptions.MarketType"] == "capacity-block"
        assert call["Placement.GroupName"] == "cb-group-1"
        assert any(line.startswith(f"warning: capacity block {rid} ends at") for line in said), said
    finally:
        prov.terminate(run_id)


def test_the_dry_run_says_what_a_reservation_decides_at_launch() -> None:
    from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute

    compute = EC2InstanceCompute(EC2Settings(
        region="us-east-1", store_uri="s3://bucket/jobs", subnet_ids=["subnet-0123456789abcdef0"],
        instance_profile="nodes", ami_id="ami-0123456789abcdef0", capacity_reservation_id="cr-0123456789abcdef0"))
    shown = compute.plan(spec.JobSpec(gpus=16, gpu_type="H100", remote=True), "r-dry").describe()
    assert shown["capacity_reservation"].startswith("cr-0123456789abcdef0: ")
    assert "capacity-block" in shown["capacity_reservation"] and "warned" in shown["capacity_reservation"]
    assert capacity.into_reservation(
        {"Placement": {"GroupName": "sgpu-r"}},
        capacity.Reservation("cr-1", "us-east-1a", "capacity-block", "cb-group-1"),
    ) == {"Placement": {"GroupName": "cb-group-1"}, "InstanceMarketOptions": {"MarketType": "capacity-block"}}



# -- end to end: a lost node inside a reservation whose placement group is bound to a zone ----


@pytest.mark.e2e
def test_a_lost_node_inside_a_reservation_is_replaced_in_its_zone_once_its_slot_is_free(
    ec2: Any, aws_faults: Any, virtual_clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EC2 frees the terminated node's slot four (virtual) minutes later, and the run's cluster
    placement group is bound to the zone of the kept node: the replacement waits for the slot in that
    zone and the job resumes on the kept node and the new one. (Before: the replacement failed at
    once with ReservationCapacityExceeded and its cleanup terminated the kept node too.)"""
    from support.recovery import has_checkpoint, node_instance, recovered_exactly_once
    from support.threads import drive
    from support.training import train_with_checkpoints as _train
    from prefect_sgpu import distributed

    monkeypatch.delenv("PREFECT_SGPU_SKIP_RESERVATION", raising=False)
    rid = aws_faults.add_capacity_reservation("g5.xlarge", "us-east-1a", 2)
    aws_faults.bind_placement_zones = True
    aws_faults.reservation_release_s = 240.0
    compute = ec2.compute(capacity_reservation_id=rid)
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=compute, mlflow=False, timeout=600)(_train)
    job = fn.job()
    thread, outcome = drive(job)
    deadline = time.monotonic() + 300
    while not has_checkpoint(ec2, job.run_id, 20) and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert has_checkpoint(ec2, job.run_id, 20), outcome
    node0, node1 = node_instance(ec2, job.run_id, 0), node_instance(ec2, job.run_id, 1)
    ec2.aws.client("ec2").terminate_instances(InstanceIds=[node1])
    thread.join(timeout=400)
    assert not thread.is_alive(), "the job did not finish"
    result = recovered_exactly_once(ec2, job, outcome, node1, node0)
    answers = [(c.params.get("SubnetId"), c.error) for c in aws_faults.calls("RunInstances")]
    assert {subnet for subnet, _ in answers} == {answers[0][0]}, "every launch went to the kept node's zone"
    assert ("ReservationCapacityExceeded" in {e for _, e in answers}) and answers[-1][1] is None, answers
    # the slot frees 240 s after the termination; the real seconds between the termination and the
    # replacement's first wait count on that clock but not in waited_s (seen: 237.5 s on a loaded machine)
    assert virtual_clock.waited_s >= 180.0, "the replacement waited minutes for the slot"
    assert result.recoveries[0].replaced == "nodes"
