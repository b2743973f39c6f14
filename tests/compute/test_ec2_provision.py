"""EC2 provisioning against moto (server mode) through real boto3 clients.

Faults come from the proxy in front of moto (tests/aws_fault_proxy.py): real AWS
error responses on the wire, so botocore's own retries and error parsing run.
Every test ends with no instance alive in moto (``no_leaked_instances``).
"""

from __future__ import annotations

import base64
import itertools
import json
from typing import Any

import boto3
import pytest

from prefect_sgpu import spec
from prefect_sgpu.compute.ec2.instances import EC2Provisioner, EC2Settings, Instance
from prefect_sgpu.errors import LaunchTimeout, ProvisioningError, SGPUConfigError

pytestmark = pytest.mark.usefixtures("no_leaked_instances")

USER_DATA = "#!/bin/bash\necho node-bootstrap\n"


def make_plan(gpus: int = 2, gpu_type: str = "A10") -> spec.Plan:
    return spec.plan_remote(spec.JobSpec(gpus=gpus, gpu_type=gpu_type, remote=True))


@pytest.fixture
def settings(aws_env: Any, aws_network: Any) -> dict[str, Any]:
    """Launchable settings against moto; fast waiters, few retries (tests only)."""
    return {
        "region": aws_env.region,
        "subnet_ids": aws_network.subnet_ids,
        "instance_profile": aws_env.instance_profile(),
        "ami_id": aws_env.image_id(),
        "endpoint_url": aws_env.endpoint_url,
        "volume_size_gb": 123,
        "owner": "alice",
        "tags": {"team": "ml"},
        "max_attempts": 2,
        "waiter_delay_s": 0.2,
        "running_timeout_s": 30,
    }


def provisioner(values: dict[str, Any], **overrides: Any) -> EC2Provisioner:
    return EC2Provisioner(EC2Settings(**{**values, **overrides}))


def by_run(aws_env: Any, run_id: str) -> list[dict[str, Any]]:
    return aws_env.live_instances([{"Name": "tag:sgpu:run-id", "Values": [run_id]}])


def tags_of(resource: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in resource.get("Tags", [])}


def assert_cleaned(aws_env: Any, run_id: str) -> None:
    ec2 = aws_env.client("ec2")
    run_filter = [{"Name": "tag:sgpu:run-id", "Values": [run_id]}]
    assert by_run(aws_env, run_id) == []
    assert ec2.describe_security_groups(Filters=run_filter)["SecurityGroups"] == []
    assert ec2.describe_placement_groups(Filters=run_filter)["PlacementGroups"] == []


def run_instances_calls(faults: Any) -> list[dict[str, str]]:
    return [c.params for c in faults.calls("RunInstances")]


# -- settings: bad input fails before any call ------------------------------------------


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"market": "cheap"}, "market"),
        ({"market": "reserved"}, "capacity_reservation_id"),
        ({"capacity_reservation_id": "res-1"}, "capacity_reservation_id"),
        ({"instance_types": {"TPU": "g5.xlarge"}}, "gpu_type"),
        ({"instance_types": {"A10": "p5.48xlarge"}}, "instance_types[A10]"),
        ({"subnet_ids": ["subnet-1"]}, "subnet_ids"),
        ({"subnet_ids": ["subnet-0123456789abcdef0", "subnet-0123456789abcdef0"]}, "subnet_ids"),
        ({"security_group_id": "default"}, "security_group_id"),
        ({"ami_id": "ubuntu"}, "ami_id"),
        ({"region": "mars-1"}, "region"),
        ({"tags": {"aws:owner": "x"}}, "tags"),
        ({"tags": {"sgpu:run-id": "x"}}, "tags"),
        ({"volume_size_gb": 2}, "volume_size_gb"),
        ({"not_a_field": 1}, "not_a_field"),
        ({"rendezvous_port": 80}, "rendezvous_port"),
        ({"keep_warm": -1}, "keep_warm"),
        ({"bucket_owner": "not-an-account"}, "bucket_owner"),
        ({"agent_timeout_s": 0}, "agent_timeout_s"),
    ],
)
@pytest.mark.parametrize("make", ["EC2Settings", "EC2Compute block"])
def test_bad_settings_are_config_errors(values: dict[str, Any], field: str, make: str) -> None:
    """The settings and the block are one schema: the same bad value, the same error, before any call."""
    from prefect_sgpu.blocks import EC2Compute

    with pytest.raises(SGPUConfigError) as info:
        (EC2Settings if make == "EC2Settings" else EC2Compute)(**values)
    assert info.value.field == field
    assert info.value.allowed


def test_launch_needs_subnets_and_profile_before_any_call(aws_env: Any, aws_faults: Any) -> None:
    plan = make_plan()
    with pytest.raises(SGPUConfigError) as info:
        EC2Provisioner(EC2Settings(instance_profile="p", endpoint_url=aws_env.endpoint_url)).provision(
            "r-nosub", plan, USER_DATA
        )
    assert info.value.field == "subnet_ids"
    with pytest.raises(SGPUConfigError) as info:
        EC2Provisioner(
            EC2Settings(subnet_ids=["subnet-0123456789abcdef0"], endpoint_url=aws_env.endpoint_url)
        ).provision("r-noprof", plan, USER_DATA)
    assert info.value.field == "instance_profile"
    assert aws_faults.requests == []


def test_markets_reservation_by_default_and_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFECT_SGPU_SKIP_RESERVATION", raising=False)
    assert EC2Settings(market="spot").markets() == ["spot"]
    assert EC2Settings(market="spot", fallback_to_on_demand=True).markets() == ["spot", "on-demand"]
    reserved = {"capacity_reservation_id": "cr-0123456789abcdef0"}
    assert EC2Settings(**reserved).markets() == ["reserved"]
    assert EC2Settings(**reserved, market="spot").markets() == ["reserved", "spot"]
    assert EC2Settings(**reserved, market="reserved", fallback_to_on_demand=True).markets() == [
        "reserved",
        "on-demand",
    ]
    monkeypatch.setenv("PREFECT_SGPU_SKIP_RESERVATION", "1")
    assert EC2Settings(**reserved).markets() == ["on-demand"]
    assert EC2Settings(**reserved, market="reserved").markets() == ["on-demand"]
    assert EC2Settings(**reserved, market="spot").markets() == ["spot"]


# -- the request (what a dry run shows) -------------------------------------------------


@pytest.mark.parametrize(
    ("gpu_type", "gpus", "expected"),
    [
        ("A10", 1, "g5.xlarge"),
        ("A10G", 8, "g5.48xlarge"),
        ("L4", 4, "g6.12xlarge"),
        ("L40S", 8, "g6e.48xlarge"),
        ("A100", 8, "p4d.24xlarge"),
        ("A100-80GB", 16, "p4de.24xlarge"),
        ("H100", 16, "p5.48xlarge"),
        ("H200", 8, "p5en.48xlarge"),
    ],
)
def test_instance_type_from_catalog(gpu_type: str, gpus: int, expected: str) -> None:
    prov = EC2Provisioner(EC2Settings())
    assert prov.instance_type_for(make_plan(gpus, gpu_type)) == expected


def test_instance_type_override_and_request_shape() -> None:
    prov = EC2Provisioner(
        EC2Settings(
            subnet_ids=["subnet-0123456789abcdef0", "subnet-0123456789abcdef1"],
            instance_profile="arn:aws:iam::123456789012:instance-profile/nodes",
            instance_types={"a10g": "g5.12xlarge"},
            market="spot",
        )
    )
    plan = make_plan(8, "A10")  # catalog: 1 x g5.48xlarge; the override needs 4-GPU nodes
    with pytest.raises(SGPUConfigError, match="4 GPUs|8 GPUs"):
        prov.instance_type_for(plan)
    plan = spec.Plan(
        nodes=2, procs_per_node=4, device="cuda", instance_type=make_plan(4, "A10").instance_type
    )
    request = prov.run_instances_request("r-shape", plan, USER_DATA, "subnet-0123456789abcdef1")
    assert request["InstanceType"] == "g5.12xlarge"
    assert request["MinCount"] == request["MaxCount"] == 2
    assert request["SubnetId"] == "subnet-0123456789abcdef1"
    assert request["ImageId"].startswith("resolve:ssm:/aws/service/deeplearning/")
    assert request["MetadataOptions"]["HttpTokens"] == "required"
    assert request["IamInstanceProfile"] == {"Arn": "arn:aws:iam::123456789012:instance-profile/nodes"}
    assert request["InstanceMarketOptions"]["MarketType"] == "spot"
    assert "Placement" not in request  # no EFA: no cluster placement group (placement_group="auto")
    assert "KeyName" not in request
    assert "NetworkInterfaces" not in request  # g5.12xlarge has no EFA
    # one token per (run, attempt): stable on retry, distinct across attempts
    again = prov.run_instances_request("r-shape", plan, USER_DATA, "subnet-0123456789abcdef1")
    other = prov.run_instances_request("r-shape", plan, USER_DATA, "subnet-0123456789abcdef0", attempt=1)
    assert request["ClientToken"] == again["ClientToken"] != other["ClientToken"]
    assert len(request["ClientToken"]) <= 64


def test_efa_instance_types_get_efa_interfaces() -> None:
    prov = EC2Provisioner(
        EC2Settings(subnet_ids=["subnet-0123456789abcdef0"], security_group_id="sg-0123456789abcdef0")
    )
    request = prov.run_instances_request("r-efa", make_plan(16, "A100"), USER_DATA)
    assert "SubnetId" not in request and "SecurityGroupIds" not in request
    nics = request["NetworkInterfaces"]
    assert [n["NetworkCardIndex"] for n in nics] == [0, 1, 2, 3]  # p4d.24xlarge: 4 EFA cards
    assert [n["DeviceIndex"] for n in nics] == [0, 1, 1, 1]
    assert {n["InterfaceType"] for n in nics} == {"efa"}
    assert {n["SubnetId"] for n in nics} == {"subnet-0123456789abcdef0"}
    assert all(n["Groups"] == ["sg-0123456789abcdef0"] for n in nics)


def test_request_refuses_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    session = boto3.Session(
        aws_access_key_id="AKIAIOSFODNN7EXAMPLE", aws_secret_access_key=secret, region_name="us-east-1"
    )
    monkeypatch.setenv("PREFECT_API_KEY", "pnu_0123456789abcdefghijklmnopqrstuvwxyz")
    prov = EC2Provisioner(EC2Settings(subnet_ids=["subnet-0123456789abcdef0"]), session=session)
    clean = prov.run_instances_request("r-sec", make_plan(), USER_DATA)
    text = json.dumps(clean)
    for value in ("AKIAIOSFODNN7EXAMPLE", secret, "pnu_0123456789abcdefghijklmnopqrstuvwxyz"):
        assert value not in text
    for leaked in (
        f"export AWS_SECRET_ACCESS_KEY={secret}",
        "PREFECT_API_KEY=pnu_0123456789abcdefghijklmnopqrstuvwxyz",
    ):
        with pytest.raises(SGPUConfigError, match="no credentials"):
            prov.run_instances_request("r-sec", make_plan(), USER_DATA + leaked)
    with pytest.raises(SGPUConfigError, match="no credentials"):
        EC2Provisioner(
            EC2Settings(subnet_ids=["subnet-0123456789abcdef0"], tags={"note": "AKIAIOSFODNN7EXAMPLE"}),
            session=session,
        ).run_instances_request("r-sec", make_plan(), USER_DATA)


@pytest.mark.parametrize("leak", [
    "export AWS_ACCESS_KEY_ID=AKIA" + "Z" * 16,  # written in two: this file itself must not hold one
    "aws configure set aws_secret_access_key=whatever",
    "echo pnb_abcdefghijklmnopqrstuvwxyz0123456789 > key",
    "cat <<EOF > id\n-----BEGIN OPENSSH " + "PRIVATE KEY-----\nEOF",
])
def test_a_credential_of_anyone_in_setup_commands_is_refused_before_launch(leak: str) -> None:
    """Not only the caller's own keys: anything shaped like a credential stays out of user-data."""
    prov = EC2Provisioner(EC2Settings(subnet_ids=["subnet-0123456789abcdef0"]), session=None)
    with pytest.raises(SGPUConfigError, match="no credentials") as raised:
        prov.run_instances_request("r-sec", make_plan(), USER_DATA + leak)
    assert "AKIAZZ" not in str(raised.value) and "pnb_" not in str(raised.value)
    prov.run_instances_request("r-sec", make_plan(), USER_DATA + "pip install prefect-sgpu")  # no false alarm


# -- moto: happy paths -------------------------------------------------------------------


@pytest.mark.parametrize("market", ["on-demand", "spot", "reserved"])
def test_provision_and_terminate(
    market: str, settings: dict[str, Any], aws_env: Any, aws_faults: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREFECT_SGPU_SKIP_RESERVATION", raising=False)
    extra: dict[str, Any] = {"market": market, "placement_group": "cluster"}  # forced: g5.xlarge gets none
    if market == "reserved":
        extra["capacity_reservation_id"] = aws_faults.add_capacity_reservation("g5.xlarge", "us-east-1a", 2)
    prov = provisioner(settings, **extra)
    run_id = f"r-happy-{market}"
    messages: list[str] = []
    instances = prov.provision(run_id, make_plan(2, "A10"), USER_DATA, progress=messages.append)

    assert [i.launch_index for i in instances] == [0, 1]
    assert all(isinstance(i, Instance) and i.market == market for i in instances)
    assert {i.subnet_id for i in instances} == {settings["subnet_ids"][0]}
    assert {i.availability_zone for i in instances} == {"us-east-1a"}
    assert all(i.private_ip for i in instances)
    assert any("run_instances 2 x g5.xlarge" in m for m in messages)

    ec2 = aws_env.client("ec2")
    live = by_run(aws_env, run_id)
    assert sorted(i["InstanceId"] for i in live) == sorted(i.id for i in instances)
    for inst in live:
        assert inst["State"]["Name"] == "running"
        assert inst["InstanceType"] == "g5.xlarge"
        assert inst["ImageId"] == settings["ami_id"]
        assert inst["MetadataOptions"]["HttpTokens"] == "required"
        assert "KeyName" not in inst
        assert inst.get("InstanceLifecycle") == ("spot" if market == "spot" else None)
        tags = tags_of(inst)
        assert tags["sgpu:run-id"] == run_id and tags["sgpu:owner"] == "alice" and tags["team"] == "ml"
        assert tags["Name"] == f"sgpu-{run_id}" and tags["sgpu:ttl"].endswith("Z")
        volume_id = inst["BlockDeviceMappings"][0]["Ebs"]["VolumeId"]
        assert ec2.describe_volumes(VolumeIds=[volume_id])["Volumes"][0]["Size"] == 123
        (group,) = inst["SecurityGroups"]
        assert group["GroupName"] == f"sgpu-{run_id}"

    # moto 5.2 associates the profile with the first instance of a launch only
    profiles = {i["IamInstanceProfile"]["Arn"] for i in live if "IamInstanceProfile" in i}
    assert profiles == {f"arn:aws:iam::123456789012:instance-profile/{settings['instance_profile']}"}

    # what crossed the wire: one gang launch in the placement group, reservation targeted
    (call,) = run_instances_calls(aws_faults)
    assert call["IamInstanceProfile.Name"] == settings["instance_profile"]
    assert call["MinCount"] == call["MaxCount"] == "2"
    assert call["Placement.GroupName"] == f"sgpu-{run_id}"
    assert call["MetadataOptions.HttpTokens"] == "required"
    assert base64.b64decode(call["UserData"]).decode() == USER_DATA
    if market == "reserved":
        assert (
            call["CapacityReservationSpecification.CapacityReservationTarget.CapacityReservationId"]
            == (extra["capacity_reservation_id"])
        )
    else:
        assert not any(k.startswith("CapacityReservationSpecification") for k in call)
    (pg,) = ec2.describe_placement_groups(Filters=[{"Name": "tag:sgpu:run-id", "Values": [run_id]}])[
        "PlacementGroups"
    ]
    assert pg["Strategy"] == "cluster"
    (sg,) = ec2.describe_security_groups(Filters=[{"Name": "tag:sgpu:run-id", "Values": [run_id]}])[
        "SecurityGroups"
    ]
    assert [
        (p["IpProtocol"], [g["GroupId"] for g in p["UserIdGroupPairs"]], p["IpRanges"])
        for p in sg["IpPermissions"]
    ] == [("-1", [sg["GroupId"]], [])]

    prov.terminate(run_id)
    assert_cleaned(aws_env, run_id)
    prov.terminate(run_id)  # idempotent


def test_reservation_zone_full_reservation_and_opt_out(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREFECT_SGPU_SKIP_RESERVATION", raising=False)
    first, second = settings["subnet_ids"]
    # a reservation in the second zone: the first subnet is never tried for it
    in_b = aws_faults.add_capacity_reservation("g5.xlarge", "us-east-1b", 2)
    prov = provisioner(settings, capacity_reservation_id=in_b)
    try:
        instances = prov.provision("r-res-b", make_plan(2, "A10"), USER_DATA)
        assert {(i.subnet_id, i.market) for i in instances} == {(second, "reserved")}
        assert [c["SubnetId"] for c in run_instances_calls(aws_faults)] == [second]
    finally:
        prov.terminate("r-res-b")
    # the reservation is now used up: with fallback the gang goes on-demand, first zone first
    aws_faults.reset()
    prov = provisioner(settings, capacity_reservation_id=in_b, fallback_to_on_demand=True)
    try:
        instances = prov.provision("r-res-full", make_plan(2, "A10"), USER_DATA)
        assert {(i.subnet_id, i.market) for i in instances} == {(first, "on-demand")}
        assert [c.error for c in aws_faults.calls("RunInstances")] == ["ReservationCapacityExceeded", None]
    finally:
        prov.terminate("r-res-full")
    # opting out skips the reservation entirely
    aws_faults.reset()
    monkeypatch.setenv("PREFECT_SGPU_SKIP_RESERVATION", "1")
    prov = provisioner(settings, capacity_reservation_id=in_b)
    try:
        instances = prov.provision("r-res-skip", make_plan(2, "A10"), USER_DATA)
        assert {i.market for i in instances} == {"on-demand"}
        assert aws_faults.calls("DescribeCapacityReservations") == []
        assert not any(
            k.startswith("CapacityReservation") for c in run_instances_calls(aws_faults) for k in c
        )
    finally:
        prov.terminate("r-res-skip")


@pytest.mark.parametrize(
    ("reservation", "field"),
    [
        (("g5.48xlarge", "us-east-1a", 4), "capacity_reservation_id"),  # another instance type
        (("g5.xlarge", "us-east-1c", 4), "subnet_ids"),  # no subnet in its zone
        (None, "capacity_reservation_id"),  # does not exist
    ],
)
def test_unusable_reservation_is_a_config_error(
    reservation: Any,
    field: str,
    settings: dict[str, Any],
    aws_env: Any,
    aws_faults: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PREFECT_SGPU_SKIP_RESERVATION", raising=False)
    rid = aws_faults.add_capacity_reservation(*reservation) if reservation else "cr-0123456789abcdef0"
    with pytest.raises(SGPUConfigError) as info:
        provisioner(settings, capacity_reservation_id=rid).provision(
            "r-badres", make_plan(2, "A10"), USER_DATA
        )
    assert info.value.field == field
    assert run_instances_calls(aws_faults) == []
    assert_cleaned(aws_env, "r-badres")


def test_efa_gang_fails_over_with_its_interfaces(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    first, second = settings["subnet_ids"]
    aws_faults.fail(
        "RunInstances",
        "InsufficientInstanceCapacity",
        where=lambda p: p.get("NetworkInterface.1.SubnetId") == first,
    )
    prov = provisioner(settings, max_attempts=1)
    try:
        instances = prov.provision("r-efa", make_plan(16, "A100"), USER_DATA)
        assert [i.instance_type for i in instances] == ["p4d.24xlarge"] * 2
        assert {i.subnet_id for i in instances} == {second}
        call = run_instances_calls(aws_faults)[-1]
        assert "SubnetId" not in call and "SecurityGroupId.1" not in call
        assert [call[f"NetworkInterface.{n}.InterfaceType"] for n in range(1, 5)] == ["efa"] * 4
        assert {call[f"NetworkInterface.{n}.SubnetId"] for n in range(1, 5)} == {second}
    finally:
        prov.terminate("r-efa")
    assert_cleaned(aws_env, "r-efa")


def test_ami_from_ssm_parameter(settings: dict[str, Any], aws_env: Any, aws_faults: Any) -> None:
    ami = aws_env.image_id()
    aws_env.client("ssm").put_parameter(
        Name="/sgpu-test/dlami/latest/ami-id", Value=ami, Type="String", Overwrite=True
    )
    prov = provisioner(settings, ami_id=None, ami_ssm_parameter="/sgpu-test/dlami/latest/ami-id")
    try:
        instances = prov.provision("r-ssm", make_plan(1, "A10"), USER_DATA)
        assert len(instances) == 1
        assert run_instances_calls(aws_faults)[0]["ImageId"] == ami
    finally:
        prov.terminate("r-ssm")
    missing = provisioner(settings, ami_id=None, ami_ssm_parameter="/sgpu-test/no-such-parameter")
    with pytest.raises(SGPUConfigError) as info:
        missing.provision("r-ssm2", make_plan(1, "A10"), USER_DATA)
    assert info.value.field == "ami_ssm_parameter"
    assert run_instances_calls(aws_faults) and len(run_instances_calls(aws_faults)) == 1


def test_terminate_finds_instances_by_tag(settings: dict[str, Any], aws_env: Any) -> None:
    """A fresh provisioner (say, after a driver crash) cleans up by the run-id tag alone."""
    first = provisioner(settings)
    first.provision("r-crash", make_plan(2, "A10"), USER_DATA)
    provisioner(settings).terminate("r-crash")
    assert_cleaned(aws_env, "r-crash")


# -- moto + faults -----------------------------------------------------------------------


def test_capacity_error_fails_over_to_next_zone(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    first, second = settings["subnet_ids"]
    aws_faults.fail(
        "RunInstances",
        "InsufficientInstanceCapacity",
        message="We currently do not have sufficient g5.xlarge capacity in us-east-1a.",
        where=lambda p: p.get("SubnetId") == first,
    )
    prov = provisioner(settings)
    messages: list[str] = []
    try:
        instances = prov.provision("r-failover", make_plan(2, "A10"), USER_DATA, progress=messages.append)
        assert {i.subnet_id for i in instances} == {second}
        assert {i.availability_zone for i in instances} == {"us-east-1b"}
        assert any(
            f"no capacity in {first} (us-east-1a, on-demand): InsufficientInstanceCapacity" in m
            for m in messages
        )
        calls = run_instances_calls(aws_faults)
        subnets = [c["SubnetId"] for c in calls]
        assert subnets[-1] == second and set(subnets[:-1]) == {first}
        tokens = [c["ClientToken"] for c in calls]  # one token per attempt, reused by retries
        assert set(tokens[:-1]) == {prov.client_token("r-failover", 0)}
        assert tokens[-1] == prov.client_token("r-failover", 1)
        assert len(by_run(aws_env, "r-failover")) == 2
    finally:
        prov.terminate("r-failover")
    assert_cleaned(aws_env, "r-failover")


def test_all_zones_fail_lists_every_attempt_and_leaves_nothing(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    aws_faults.fail("RunInstances", "InsufficientInstanceCapacity", message="no g5 capacity")
    aws_faults.fail(
        "RunInstances", "SpotMaxPriceTooLow", message="spot price too low"
    )  # never reached: first rule wins
    prov = provisioner(settings, market="spot", fallback_to_on_demand=True, max_attempts=1)
    with pytest.raises(ProvisioningError) as info:
        prov.provision("r-nocap", make_plan(2, "A10"), USER_DATA)
    # EC2 answers capacity errors with HTTP 500; botocore leaves them to the failover (aws.NOT_RETRIED)
    assert len(run_instances_calls(aws_faults)) == 4
    text = str(info.value)
    first, second = settings["subnet_ids"]
    for subnet, zone in ((first, "us-east-1a"), (second, "us-east-1b")):
        for market in ("spot", "on-demand"):
            assert f"{subnet} ({zone}, {market}): InsufficientInstanceCapacity" in text
    assert [(a["subnet_id"], a["market"]) for a in info.value.attempts] == [
        (first, "spot"),
        (second, "spot"),
        (first, "on-demand"),
        (second, "on-demand"),
    ]
    assert_cleaned(aws_env, "r-nocap")


def test_spot_capacity_falls_back_to_on_demand(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    aws_faults.fail(
        "RunInstances",
        "MaxSpotInstanceCountExceeded",
        where=lambda p: p.get("InstanceMarketOptions.MarketType") == "spot",
    )
    prov = provisioner(settings, market="spot", fallback_to_on_demand=True)
    try:
        instances = prov.provision("r-fallback", make_plan(2, "A10"), USER_DATA)
        assert {i.market for i in instances} == {"on-demand"}
        live = by_run(aws_env, "r-fallback")
        assert len(live) == 2 and all("InstanceLifecycle" not in i for i in live)
        assert all(tags_of(i)["sgpu:market"] == "on-demand" for i in live)
        markets = [
            c.get("InstanceMarketOptions.MarketType", "on-demand") for c in run_instances_calls(aws_faults)
        ]
        assert markets == ["spot", "on-demand"]  # a regional quota: the other zone's spot is not tried
    finally:
        prov.terminate("r-fallback")


VCPU_LIMIT = ("You have requested more vCPU capacity than your current vCPU limit of 0 allows for the instance "
              "bucket that the specified instance type belongs to.")


def test_a_vcpu_quota_error_names_the_quota_and_skips_the_other_zones_of_that_market(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    """The quota is regional: one VcpuLimitExceeded per market, never one per zone; spot's own quota
    full, the on-demand one still takes the launch."""
    first, _ = settings["subnet_ids"]
    aws_faults.fail("RunInstances", "VcpuLimitExceeded", message=VCPU_LIMIT, status=400,
                    where=lambda p: p.get("InstanceMarketOptions.MarketType") == "spot")
    prov = provisioner(settings, market="spot", fallback_to_on_demand=True)
    messages: list[str] = []
    try:
        instances = prov.provision("r-quota", make_plan(2, "A10"), USER_DATA, progress=messages.append)
        assert {i.market for i in instances} == {"on-demand"} and {i.subnet_id for i in instances} == {first}
        markets = [c.get("InstanceMarketOptions.MarketType", "on-demand") for c in run_instances_calls(aws_faults)]
        assert markets == ["spot", "on-demand"], "the second zone's spot launch was not tried"
        assert any('"All G and VT Spot Instance Requests" (L-3819A6DF)' in m for m in messages), messages
    finally:
        prov.terminate("r-quota")
    assert_cleaned(aws_env, "r-quota")


def test_every_market_over_its_vcpu_quota_fails_naming_the_quotas_to_raise(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    aws_faults.fail("RunInstances", "VcpuLimitExceeded", message=VCPU_LIMIT, status=400)
    prov = provisioner(settings, market="spot", fallback_to_on_demand=True)
    with pytest.raises(ProvisioningError) as info:
        prov.provision("r-noquota", make_plan(2, "A10"), USER_DATA)
    text = str(info.value)
    assert "(L-3819A6DF)" in text and '"Running On-Demand G and VT instances" (L-DB2E81BA)' in text, text
    assert "2 x g5.xlarge" in text and "raise it in Service Quotas" in text, text
    assert len(run_instances_calls(aws_faults)) == 2, "one try per market"
    assert_cleaned(aws_env, "r-noquota")


def test_spot_failure_without_fallback_raises(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    aws_faults.fail("RunInstances", "SpotMaxPriceTooLow")
    prov = provisioner(settings, market="spot")
    with pytest.raises(ProvisioningError, match="SpotMaxPriceTooLow"):
        prov.provision("r-spotfail", make_plan(2, "A10"), USER_DATA)
    assert len(info_calls := run_instances_calls(aws_faults)) == 2 and all(
        c["InstanceMarketOptions.MarketType"] == "spot" for c in info_calls
    )
    assert_cleaned(aws_env, "r-spotfail")


def test_other_errors_are_not_retried_across_zones(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    aws_faults.fail(
        "RunInstances", "UnauthorizedOperation", message="You are not authorized to perform this operation."
    )
    prov = provisioner(settings)
    with pytest.raises(ProvisioningError, match="UnauthorizedOperation.*not a capacity error"):
        prov.provision("r-auth", make_plan(2, "A10"), USER_DATA)
    assert [c["SubnetId"] for c in run_instances_calls(aws_faults)] == [settings["subnet_ids"][0]]
    assert_cleaned(aws_env, "r-auth")


def test_unknown_ami_fails_before_launch(settings: dict[str, Any], aws_env: Any, aws_faults: Any) -> None:
    prov = provisioner(settings, ami_id="ami-0000000000deadbee")
    with pytest.raises(SGPUConfigError) as info:
        prov.provision("r-badami", make_plan(2, "A10"), USER_DATA)
    assert info.value.field == "ami_id"
    assert run_instances_calls(aws_faults) == []
    assert_cleaned(aws_env, "r-badami")


def test_throttling_is_retried_by_botocore(settings: dict[str, Any], aws_env: Any, aws_faults: Any) -> None:
    for action in ("DescribeSubnets", "CreateSecurityGroup", "CreatePlacementGroup"):
        aws_faults.fail(action, "RequestLimitExceeded", message="Request limit exceeded.", times=1)
    aws_faults.fail("RunInstances", "RequestLimitExceeded", message="Request limit exceeded.", times=2)
    prov = provisioner(settings, max_attempts=4, placement_group="cluster")
    try:
        instances = prov.provision("r-throttle", make_plan(2, "A10"), USER_DATA)
        assert len(instances) == 2
        calls = aws_faults.calls("RunInstances")
        assert [c.error for c in calls] == ["RequestLimitExceeded", "RequestLimitExceeded", None]
        assert len({c.params["ClientToken"] for c in calls}) == 1
        for action in ("DescribeSubnets", "CreateSecurityGroup", "CreatePlacementGroup"):
            assert [c.error for c in aws_faults.calls(action)] == ["RequestLimitExceeded", None]
    finally:
        prov.terminate("r-throttle")
    assert_cleaned(aws_env, "r-throttle")


def test_client_token_makes_a_retried_launch_idempotent(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    """The launch happens but its response is lost; botocore retries with the same token."""
    aws_faults.fail("RunInstances", "Unavailable", times=1, after_forward=True)
    prov = provisioner(settings)
    try:
        instances = prov.provision("r-token", make_plan(2, "A10"), USER_DATA)
        calls = aws_faults.calls("RunInstances")
        assert [c.error for c in calls] == ["Unavailable", None]
        # botocore resends the request as serialised; the token is ours, one per (run, attempt)
        assert (
            calls[0].params["ClientToken"]
            == calls[1].params["ClientToken"]
            == prov.client_token("r-token", 0)
        )
        live = by_run(aws_env, "r-token")
        assert len(live) == 2  # not 4
        assert sorted(i["InstanceId"] for i in live) == sorted(i.id for i in instances)
    finally:
        prov.terminate("r-token")
    assert_cleaned(aws_env, "r-token")


def test_cost_counts_instance_hours_at_catalog_prices() -> None:
    prov = EC2Provisioner(EC2Settings())
    nodes = [
        Instance(f"i-{n}", "10.0.0.1", "subnet-1", "us-east-1a", n, "p5.48xlarge", "on-demand")
        for n in range(2)
    ]
    cost = prov.cost(nodes, started=1000.0, ended=1000.0 + 1800.0)
    assert cost["instance_hours"] == pytest.approx(1.0)
    assert cost["usd"] == pytest.approx(55.040)
    assert cost["usd_per_hour"] == pytest.approx(110.08)
    assert cost["price_source"] == "fallback-table"  # moto has no Price List API: the table, labelled
    odd = prov.cost([Instance("i-x", "", "", "", 0, "x9.huge", "spot")], 0.0, 3600.0)
    assert odd["unpriced_instance_types"] == ["x9.huge"] and odd["usd"] == 0.0


def test_instances_never_running_time_out_and_are_cleaned(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    """EC2 keeps saying the new ids are unknown (eventual consistency, stuck capacity)."""
    aws_faults.fail(
        "DescribeInstances",
        "InvalidInstanceID.NotFound",
        message="The instance IDs do not exist",
        times=5,  # every poll of the waiter: running_timeout_s / waiter_delay_s
        where=lambda p: "InstanceId.1" in p,
    )
    prov = provisioner(settings, running_timeout_s=1.0, waiter_delay_s=0.2)
    with pytest.raises(LaunchTimeout) as info:
        prov.provision("r-stuck", make_plan(2, "A10"), USER_DATA)
    assert info.value.phase == "provisioning"
    answers = [c.error for c in aws_faults.calls("DescribeInstances")]
    polls = list(itertools.takewhile(lambda error: error == "InvalidInstanceID.NotFound", answers))
    # the waiter polled as often as running_timeout_s allows (fewer on a loaded machine), each time
    # told "unknown", and gave up; the cleanup's calls come after
    assert 1 <= len(polls) <= 5, answers
    assert_cleaned(aws_env, "r-stuck")


def test_instances_ec2_does_not_know_yet_while_terminating_still_get_their_groups_deleted(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    """Eventual consistency during the cleanup: DescribeInstances says the ids are unknown a few
    times after the terminate. The wait goes on (botocore's waiter would fail at once) and the
    run's security and placement groups are deleted."""
    prov = provisioner(settings, waiter_delay_s=0.2)
    prov.provision("r-unknown-at-end", make_plan(2, "A10"), USER_DATA)
    aws_faults.fail("DescribeInstances", "InvalidInstanceID.NotFound", message="The instance IDs do not exist",
                    times=3, where=lambda p: "InstanceId.1" in p)
    prov.terminate("r-unknown-at-end")
    answers = [c.error for c in aws_faults.calls("DescribeInstances")]
    assert answers.count("InvalidInstanceID.NotFound") == 3, answers
    assert_cleaned(aws_env, "r-unknown-at-end")


def test_cancel_while_instances_start_terminates_them(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    """The running-wait polls one at a time and gives up, cleaning up, once told to stop."""
    from prefect_sgpu.errors import JobCancelled

    cancelled: list[bool] = []
    aws_faults.fail(  # the new ids stay unknown until the cancel, so the instances never run
        "DescribeInstances",
        "InvalidInstanceID.NotFound",
        message="The instance IDs do not exist",
        times=1000,
        where=lambda p: "InstanceId.1" in p and not cancelled,
    )

    def should_stop() -> bool:
        if len(aws_faults.calls("DescribeInstances")) >= 3:
            cancelled.append(True)
        return bool(cancelled)

    prov = provisioner(settings, running_timeout_s=600.0, waiter_delay_s=0.2)
    with pytest.raises(JobCancelled, match="cancelled while its instances started"):
        prov.provision("r-cancel", make_plan(2, "A10"), USER_DATA, should_stop=should_stop)
    assert len(run_instances_calls(aws_faults)) == 1
    assert_cleaned(aws_env, "r-cancel")


def test_cancel_before_launch_spends_nothing(settings: dict[str, Any], aws_env: Any, aws_faults: Any) -> None:
    from prefect_sgpu.errors import JobCancelled

    prov = provisioner(settings)
    with pytest.raises(JobCancelled):
        prov.provision("r-cancel0", make_plan(2, "A10"), USER_DATA, should_stop=lambda: True)
    assert run_instances_calls(aws_faults) == []
    assert_cleaned(aws_env, "r-cancel0")
