"""A first real EC2 run's remaining traps, against moto (server mode) behind the fault proxy, through
real boto3 clients: multi-NIC types (no public IPv4) in subnets without a way out, one AMI per job,
and cluster placement groups only where they help."""

from __future__ import annotations

import threading
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

from prefect_sgpu import spec
from prefect_sgpu.compute.ec2 import doctor, egress
from prefect_sgpu.compute.ec2 import request as rq
from prefect_sgpu.compute.ec2.compute import EC2Allocation, EC2InstanceCompute
from prefect_sgpu.compute.ec2.instances import EC2Provisioner
from prefect_sgpu.compute.ec2.settings import EC2Settings
from prefect_sgpu.errors import SGPUConfigError
from support.aws_fixtures import REGION, create_network

pytestmark = pytest.mark.usefixtures("no_leaked_instances")

USER_DATA = "#!/bin/bash\necho node-bootstrap\n"


def _plan(gpus: int, gpu_type: str) -> spec.Plan:
    return spec.plan_remote(spec.JobSpec(gpus=gpus, gpu_type=gpu_type, remote=True))


def _settings(aws_env: Any, subnet_ids: list[str], **extra: Any) -> EC2Settings:
    return EC2Settings(**{"region": aws_env.region, "subnet_ids": subnet_ids,
                          "instance_profile": aws_env.instance_profile(), "ami_id": aws_env.image_id(),
                          "endpoint_url": aws_env.endpoint_url, "max_attempts": 2, "waiter_delay_s": 0.2,
                          "running_timeout_s": 30, **extra})


def _sent(faults: Any, action: str) -> list[dict[str, str]]:
    return [c.params for c in faults.calls(action)]


# -- no public IPv4 on multi-NIC launches ------------------------------------------------------------


def test_p4d_in_a_subnet_whose_only_way_out_is_an_internet_gateway_is_refused_before_anything_is_spent(
        aws_env: Any, aws_faults: Any) -> None:
    network = create_network(aws_env, egress="igw")
    prov = EC2Provisioner(_settings(aws_env, network.subnet_ids[:1]))
    with pytest.raises(SGPUConfigError) as info:
        prov.provision("r-igw-p4d", _plan(16, "A100"), USER_DATA)
    error = info.value
    assert error.field == "subnet_ids" and network.subnet_ids[0] in str(error)
    assert "p4d.24xlarge" in str(error) and "4 network interfaces" in str(error)
    assert "internet gateway igw-" in str(error) and "NAT gateway" in str(error)
    assert "S3 gateway endpoint" in str(error) and "SSM interface endpoint" in str(error)
    for action in ("RunInstances", "CreateSecurityGroup", "CreatePlacementGroup"):
        assert _sent(aws_faults, action) == [], action


def test_p4d_in_a_nat_subnet_launches_into_its_placement_group(aws_env: Any, aws_faults: Any) -> None:
    nat = create_network(aws_env, egress="nat")
    prov = EC2Provisioner(_settings(aws_env, nat.subnet_ids))
    run_id = f"r-nat-p4d-{uuid.uuid4().hex[:6]}"
    try:
        instances = prov.provision(run_id, _plan(16, "A100"), USER_DATA)
        assert len(instances) == 2
        (call,) = _sent(aws_faults, "RunInstances")
        assert call["InstanceType"] == "p4d.24xlarge"
        assert call["Placement.GroupName"] == f"sgpu-{run_id}"
        assert len(_sent(aws_faults, "CreatePlacementGroup")) == 1
    finally:
        prov.terminate(run_id)


def test_a_subnet_without_a_way_out_is_skipped_when_another_has_one(aws_env: Any, aws_faults: Any) -> None:
    network = create_network(aws_env, egress="none")
    ec2 = aws_env.client("ec2")
    cidr = ec2.describe_vpcs(VpcIds=[network.vpc_id])["Vpcs"][0]["CidrBlock"]
    routed = ec2.create_subnet(VpcId=network.vpc_id, CidrBlock=cidr.replace("0.0/16", "7.0/24"),
                               AvailabilityZone=network.availability_zones[1])["Subnet"]["SubnetId"]
    table = ec2.create_route_table(VpcId=network.vpc_id)["RouteTable"]["RouteTableId"]
    ec2.associate_route_table(RouteTableId=table, SubnetId=routed)
    allocation = ec2.allocate_address(Domain="vpc")["AllocationId"]
    nat = ec2.create_nat_gateway(SubnetId=routed, AllocationId=allocation)["NatGateway"]["NatGatewayId"]
    ec2.create_route(RouteTableId=table, DestinationCidrBlock="0.0.0.0/0", NatGatewayId=nat)
    subnets = {s["SubnetId"]: s for s in ec2.describe_subnets(SubnetIds=[network.subnet_ids[0], routed])["Subnets"]}
    usable = egress.subnets_with_way_out(ec2, REGION, "p4d.24xlarge", 4, subnets, needs_index=True)
    assert usable == {routed}


def test_s3_and_ssm_endpoints_suffice_only_when_the_image_has_the_environment(aws_env: Any) -> None:
    network = create_network(aws_env, egress="igw")
    ec2 = aws_env.client("ec2")
    subnets = {s["SubnetId"]: s for s in ec2.describe_subnets(SubnetIds=network.subnet_ids[:1])["Subnets"]}
    (table,) = ec2.describe_route_tables(Filters=[{"Name": "vpc-id", "Values": [network.vpc_id]}])["RouteTables"]
    ec2.create_vpc_endpoint(VpcId=network.vpc_id, ServiceName=f"com.amazonaws.{REGION}.s3",
                            VpcEndpointType="Gateway", RouteTableIds=[table["RouteTableId"]])
    with pytest.raises(SGPUConfigError, match="no an SSM interface endpoint|no an SSM"):
        egress.subnets_with_way_out(ec2, REGION, "p5.48xlarge", 32, subnets, needs_index=False)
    ec2.create_vpc_endpoint(VpcId=network.vpc_id, ServiceName=f"com.amazonaws.{REGION}.ssm",
                            VpcEndpointType="Interface", SubnetIds=network.subnet_ids[:1])
    assert egress.subnets_with_way_out(ec2, REGION, "p5.48xlarge", 32, subnets, needs_index=False) == set(subnets)
    with pytest.raises(SGPUConfigError, match="package index"):
        egress.subnets_with_way_out(ec2, REGION, "p5.48xlarge", 32, subnets, needs_index=True)


def test_a_single_nic_type_in_an_internet_gateway_subnet_launches_without_a_placement_group(
        aws_env: Any, aws_faults: Any) -> None:
    network = create_network(aws_env, egress="igw")
    prov = EC2Provisioner(_settings(aws_env, network.subnet_ids[:1]))
    run_id = f"r-igw-g5-{uuid.uuid4().hex[:6]}"
    looked = len(_sent(aws_faults, "DescribeRouteTables"))  # the network's own set-up
    try:
        assert len(prov.provision(run_id, _plan(2, "A10"), USER_DATA)) == 2
        (call,) = _sent(aws_faults, "RunInstances")
        assert call["InstanceType"] == "g5.xlarge" and "Placement.GroupName" not in call
        assert _sent(aws_faults, "CreatePlacementGroup") == []
        assert len(_sent(aws_faults, "DescribeRouteTables")) == looked  # one interface: nothing to check
    finally:
        prov.terminate(run_id)


def test_doctor_fails_a_multi_nic_type_in_an_internet_gateway_subnet_and_passes_a_nat_one(aws_env: Any) -> None:
    p4d = doctor.Wanted.of("A100", 16, None)
    igw, nat = create_network(aws_env, egress="igw"), create_network(aws_env, egress="nat")
    made = doctor.Doctor(_settings(aws_env, igw.subnet_ids[:1]), session=aws_env.session())
    check = made.subnet_egress(p4d.instance_type)
    assert check.status == "fail" and igw.subnet_ids[0] in check.detail and "no public IPv4" in check.detail, check
    assert "NAT gateway" in check.fix
    made = doctor.Doctor(_settings(aws_env, nat.subnet_ids[:1]), session=aws_env.session())
    assert made.subnet_egress(p4d.instance_type).status == "ok"
    made = doctor.Doctor(_settings(aws_env, igw.subnet_ids[:1]), session=aws_env.session())
    assert made.subnet_egress(doctor.Wanted.of("A10", 1, None).instance_type).status == "ok"


# -- cluster placement groups only where they help ---------------------------------------------------


@pytest.mark.parametrize("gpus, gpu_type, choice, grouped", [
    (2, "A10", "auto", False),     # 2 x g5.xlarge: no EFA, nothing to gain
    (16, "A100", "auto", True),    # 2 x p4d.24xlarge: EFA between nodes
    (8, "A100", "auto", False),    # 1 x p4d.24xlarge: one node talks to no other
    (2, "A10", "cluster", True),   # forced
    (16, "A100", "none", False),   # forbidden
])
def test_the_rendered_launch_has_a_placement_group_only_where_it_helps(
        gpus: int, gpu_type: str, choice: str, grouped: bool) -> None:
    settings = EC2Settings(subnet_ids=["subnet-0123456789abcdef0"], placement_group=choice)
    request = rq.run_instances_request(settings, "r-pg", _plan(gpus, gpu_type), USER_DATA, "2030-01-01T00:00:00Z")
    assert ("Placement" in request) is grouped, request.get("Placement")
    if grouped:
        assert request["Placement"] == {"GroupName": "sgpu-r-pg"}


def test_a_bad_placement_group_choice_is_a_config_error() -> None:
    with pytest.raises(SGPUConfigError) as info:
        EC2Settings(placement_group="spread")
    assert info.value.field == "placement_group" and "spread" in str(info.value)


# -- one AMI per job ---------------------------------------------------------------------------------


def test_the_ami_is_resolved_once_per_job_and_a_replacement_and_a_new_gang_boot_the_pinned_one(
        aws_env: Any, aws_faults: Any, aws_network: Any) -> None:
    ec2, ssm = aws_env.client("ec2"), aws_env.client("ssm")
    parameter = f"/sgpu-test/{uuid.uuid4().hex[:8]}/latest/ami-id"
    first = aws_env.image_id()
    ssm.put_parameter(Name=parameter, Value=first, Type="String")
    bucket = f"sgpu-ami-{uuid.uuid4().hex[:8]}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    settings = _settings(aws_env, aws_network.subnet_ids, ami_id=None, ami_ssm_parameter=parameter,
                         store_uri=f"s3://{bucket}/jobs")
    compute = EC2InstanceCompute(settings, session=aws_env.session())
    run_id = f"r-ami-{uuid.uuid4().hex[:6]}"
    request = compute.plan(spec.JobSpec(gpus=2, gpu_type="A10", remote=True), run_id)
    assert request.run_instances[0].params["ImageId"] == f"resolve:ssm:{parameter}"
    assert parameter in request.describe()["image"] and "pinned" in request.describe()["image"]
    messages: list[str] = []

    def allocation_for(req: Any, gang: int) -> EC2Allocation:
        return EC2Allocation(request=req, folder=SimpleNamespace(gang=gang), nodes=[],
                             progress=lambda phase, text: messages.append(text))

    deadline = time.monotonic() + 120
    try:
        allocation = allocation_for(request, 0)
        compute._provision(allocation, run_id, deadline, threading.Event())
        # AWS publishes a newer image under the same parameter while the job runs
        newer = ec2.copy_image(SourceImageId=first, SourceRegion=REGION, Name=f"newer-{run_id}")["ImageId"]
        ssm.put_parameter(Name=parameter, Value=newer, Type="String", Overwrite=True)
        assert newer != first
        compute._provision_node(allocation, 1, deadline, threading.Event())  # node 1 lost: replaced alone
        gang1 = compute.replan(request, 1)  # the whole gang lost: a new one
        compute._provision(allocation_for(gang1, 1), run_id, deadline, threading.Event())
        launched = _sent(aws_faults, "RunInstances")
        assert [c["ImageId"] for c in launched] == [first, first, first]
        assert [c["MinCount"] for c in launched] == ["2", "1", "2"]
        assert any(f"AMI {first}, pinned" in m for m in messages)
        assert len(_sent(aws_faults, "GetParameter")) == 1, "resolved once for the job"
        # another job resolves afresh and gets the newer image
        other = f"r-ami2-{uuid.uuid4().hex[:6]}"
        compute._provision(allocation_for(compute.plan(spec.JobSpec(gpus=1, gpu_type="A10", remote=True), other), 0),
                           other, deadline, threading.Event())
        assert _sent(aws_faults, "RunInstances")[-1]["ImageId"] == newer
        compute.provisioner.terminate(other)
    finally:
        compute.provisioner.terminate(run_id)
