"""The launch on AWS's bad days: IAM late, launches that die pending, ids EC2 forgot, quotas, capacity errors
botocore must not sit on. Against moto through the fault proxy (``support/launch_faults.py`` models what moto
lacks), real boto3 clients, and the virtual clock for the minutes IAM may take.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from prefect_sgpu import spec
from prefect_sgpu.compute.ec2.instances import EC2Provisioner, EC2Settings
from prefect_sgpu.compute.ec2.launch_outcomes import PROFILE_PROPAGATION_S, DiedPending
from prefect_sgpu.errors import ProvisioningError

pytestmark = pytest.mark.usefixtures("no_leaked_instances")

USER_DATA = "#!/bin/bash\necho node-bootstrap\n"
ICE = "We currently do not have sufficient g5.xlarge capacity in the Availability Zone you requested (us-east-1a)."


def make_plan(gpus: int = 2) -> spec.Plan:
    return spec.plan_remote(spec.JobSpec(gpus=gpus, gpu_type="A10", remote=True))


@pytest.fixture
def settings(aws_env: Any, aws_network: Any) -> dict[str, Any]:
    return {
        "region": aws_env.region,
        "subnet_ids": aws_network.subnet_ids,
        "instance_profile": aws_env.instance_profile(),
        "ami_id": aws_env.image_id(),
        "endpoint_url": aws_env.endpoint_url,
        "max_attempts": 3,
        "waiter_delay_s": 0.2,
        "running_timeout_s": 30,
    }


def provisioner(values: dict[str, Any], **overrides: Any) -> EC2Provisioner:
    return EC2Provisioner(EC2Settings(**{**values, **overrides}))


def live_of(aws_env: Any, run_id: str) -> list[dict[str, Any]]:
    return aws_env.live_instances([{"Name": "tag:sgpu:run-id", "Values": [run_id]}])


def launches(faults: Any) -> list[tuple[str, str, str | None]]:
    """(subnet, market, error) of every RunInstances that crossed the proxy."""
    return [(c.params.get("SubnetId", ""), c.params.get("InstanceMarketOptions.MarketType", "on-demand"), c.error)
            for c in faults.calls("RunInstances")]


# -- botocore and capacity ---------------------------------------------------------------------------


def test_botocore_leaves_capacity_errors_to_the_failover_and_still_retries_throttling(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    """EC2 answers InsufficientInstanceCapacity with HTTP 500; botocore's standard mode would retry it
    ``max_attempts`` times with backoff (minutes at the default of 8) before the next zone is tried."""
    first, second = settings["subnet_ids"]
    aws_faults.fail("RunInstances", "InsufficientInstanceCapacity", message=ICE, where=lambda p: p["SubnetId"] == first)
    aws_faults.fail("RunInstances", "RequestLimitExceeded", message="Request limit exceeded.", times=1,
                    where=lambda p: p["SubnetId"] == second)
    prov = provisioner(settings)
    try:
        instances = prov.provision("r-ice-once", make_plan(), USER_DATA)
        assert {i.subnet_id for i in instances} == {second}
        assert launches(aws_faults) == [(first, "on-demand", "InsufficientInstanceCapacity"),
                                        (second, "on-demand", "RequestLimitExceeded"), (second, "on-demand", None)]
    finally:
        prov.terminate("r-ice-once")


def test_max_spot_instance_count_is_a_quota_not_capacity(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    """The spot quota is regional: one try per market, never one per zone; named in the error."""
    aws_faults.fail("RunInstances", "MaxSpotInstanceCountExceeded", message="Max spot instance count exceeded",
                    where=lambda p: p.get("InstanceMarketOptions.MarketType") == "spot")
    with pytest.raises(ProvisioningError) as info:
        provisioner(settings, market="spot").provision("r-spotquota", make_plan(), USER_DATA)
    assert '"All G and VT Spot Instance Requests" (L-3819A6DF)' in str(info.value), info.value
    assert "raise it in Service Quotas" in str(info.value)
    assert launches(aws_faults) == [(settings["subnet_ids"][0], "spot", "MaxSpotInstanceCountExceeded")]

    aws_faults.requests.clear()
    prov = provisioner(settings, market="spot", fallback_to_on_demand=True)
    try:
        instances = prov.provision("r-spotquota-fb", make_plan(), USER_DATA)
        assert {i.market for i in instances} == {"on-demand"}
        assert [m for _, m, _ in launches(aws_faults)] == ["spot", "on-demand"]
    finally:
        prov.terminate("r-spotquota-fb")


# -- IAM late ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", ["InvalidParameterValue", "UnauthorizedOperation"])
def test_a_jobs_new_instance_profile_is_waited_for_in_the_same_subnet(
    code: str, settings: dict[str, Any], aws_env: Any, aws_faults: Any, virtual_clock: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """IAM takes 90 (virtual) seconds to show EC2 the profile the job just made: the launch waits in its
    first subnet, with backoff, and says how long it waited; no other zone is tried for it."""
    run_id = f"r-late-{code[:5].lower()}"
    aws_faults.launch_faults.clock = virtual_clock
    aws_faults.launch_faults.late_profile(f"sgpu-{run_id}", 90.0, code=code)
    aws_env.instance_profile(f"sgpu-{run_id}")  # what roles.create makes before the launch
    prov = provisioner(settings, instance_profile=None, job_roles=True)
    caplog.set_level(logging.INFO, logger="prefect_sgpu.compute.ec2.gang_launch")
    try:
        instances = prov.provision(run_id, make_plan(), USER_DATA)
        first = settings["subnet_ids"][0]
        assert {i.subnet_id for i in instances} == {first}
        calls = launches(aws_faults)
        assert {subnet for subnet, _, _ in calls} == {first}
        assert [error for _, _, error in calls] == [code] * (len(calls) - 1) + [None] and len(calls) >= 3, calls
        # virtual seconds slept (the real seconds the calls took count too, so a little under 90)
        assert 80.0 <= virtual_clock.waited_s < 90.0 + 20.0, virtual_clock.slept
        assert any("succeeded after waiting" in r.getMessage() and f"sgpu-{run_id}" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        prov.terminate(run_id)
        aws_env.client("iam").delete_instance_profile(InstanceProfileName=f"sgpu-{run_id}")


def test_a_profile_ec2_never_sees_fails_after_the_budget_naming_it(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any, virtual_clock: Any
) -> None:
    run_id = "r-late-never"
    aws_faults.launch_faults.clock = virtual_clock
    aws_faults.launch_faults.late_profile(f"sgpu-{run_id}", 3600.0)
    aws_env.instance_profile(f"sgpu-{run_id}")
    prov = provisioner(settings, instance_profile=None, job_roles=True)
    try:
        with pytest.raises(ProvisioningError) as info:
            prov.provision(run_id, make_plan(), USER_DATA)
        text = str(info.value)
        assert f"instance profile sgpu-{run_id} within {PROFILE_PROPAGATION_S:.0f} s" in text, text
        assert "Not retried in other zones" in text
        assert {subnet for subnet, _, _ in launches(aws_faults)} == {settings["subnet_ids"][0]}
        assert PROFILE_PROPAGATION_S - 10 <= virtual_clock.waited_s <= PROFILE_PROPAGATION_S
        assert live_of(aws_env, run_id) == []
    finally:
        aws_env.client("iam").delete_instance_profile(InstanceProfileName=f"sgpu-{run_id}")


# -- launches that die pending ------------------------------------------------------------------------


@pytest.mark.parametrize(("market", "reason"), [
    ("on-demand", "Server.InsufficientInstanceCapacity"),
    ("spot", "Server.SpotInstanceTermination"),
])
def test_instances_ended_while_pending_for_capacity_fail_over_like_an_ice(
    market: str, reason: str, settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    """EC2 accepts the gang in the first zone, then ends its second instance while pending: that attempt's
    instances are terminated and the next subnet is tried, as after InsufficientInstanceCapacity."""
    first, second = settings["subnet_ids"]
    aws_faults.launch_faults.die_pending(reason, f"{reason}: no capacity for this launch", nth=2,
                                         where=lambda p: p["SubnetId"] == first)
    prov = provisioner(settings, market=market)
    run_id = f"r-pending-{market}"
    messages: list[str] = []
    try:
        instances = prov.provision(run_id, make_plan(), USER_DATA, progress=messages.append)
        assert {i.subnet_id for i in instances} == {second} and len(instances) == 2
        assert [s for s, _, _ in launches(aws_faults)] == [first, second]
        live = live_of(aws_env, run_id)
        assert sorted(i["InstanceId"] for i in live) == sorted(i.id for i in instances), "the first gang is gone"
        assert any(f"instances ended while pending in {first}" in m and reason in m for m in messages), messages
    finally:
        prov.terminate(run_id)


def test_client_internal_error_while_pending_names_the_ebs_kms_key_and_is_not_retried(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    aws_faults.launch_faults.die_pending("Client.InternalError", "Client.InternalError: Client error on launch",
                                         count=2)
    prov = provisioner(settings)
    with pytest.raises(DiedPending) as info:
        prov.provision("r-kms", make_plan(), USER_DATA)
    text = str(info.value)
    assert "Client.InternalError" in text and "KMS key" in text and "kms:CreateGrant" in text, text
    assert "get-ebs-default-kms-key-id --region us-east-1" in text, text
    assert info.value.codes == ["Client.InternalError"] and not info.value.capacity
    assert len(launches(aws_faults)) == 1, "no other zone: the same key is used everywhere"
    assert live_of(aws_env, "r-kms") == []


# -- ids EC2 no longer knows ----------------------------------------------------------------------------


def test_an_id_ec2_forgot_reads_terminated_and_the_others_keep_their_states(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any
) -> None:
    ec2 = aws_env.client("ec2")
    made = ec2.run_instances(ImageId=settings["ami_id"], MinCount=2, MaxCount=2, InstanceType="g5.xlarge",
                             SubnetId=settings["subnet_ids"][0])
    gone, kept = [i["InstanceId"] for i in made["Instances"]]
    try:
        aws_faults.launch_faults.forget(gone)
        with pytest.raises(ec2.exceptions.ClientError, match="InvalidInstanceID.NotFound"):
            ec2.describe_instances(InstanceIds=[gone, kept])  # the model: the whole call fails
        prov = provisioner(settings)
        assert prov.instance_states([gone, kept, ""]) == {gone: "terminated", kept: "running"}
        assert prov.instance_states([kept]) == {kept: "running"}
    finally:
        aws_faults.launch_faults.reset()
        ec2.terminate_instances(InstanceIds=[gone, kept])


def test_under_the_shipped_driver_policy_the_late_profile_wait_needs_no_more_permissions(
    settings: dict[str, Any], aws_env: Any, aws_faults: Any, virtual_clock: Any
) -> None:
    """The job's role and profile made and launched by a driver user under ``driver-policy.json``, each call
    judged by the IAM gate, while IAM is late for 40 (virtual) seconds: the retried RunInstances are the same
    request, and the gate refuses nothing."""
    import json
    import uuid

    import boto3

    from prefect_sgpu.compute.ec2 import request as rq
    from prefect_sgpu.compute.ec2 import roles
    from prefect_sgpu.store import store_scope
    from support.iam_gate import ACCOUNT, IAMGate

    iam = aws_env.client("iam")
    store_uri, tag = "s3://sgpu-gate-late/jobs", uuid.uuid4().hex[:8]
    boundary = iam.create_policy(PolicyName=f"sgpu-node-boundary-{tag}", PolicyDocument=json.dumps(
        roles.node_boundary(store_uri, aws_env.region, ACCOUNT)))["Policy"]["Arn"]
    user = f"sgpu-driver-{tag}"
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="prefect-sgpu-driver", PolicyDocument=json.dumps(
        roles.driver_policy(store_uri, aws_env.region, ACCOUNT, boundary)))
    keys = iam.create_access_key(UserName=user)["AccessKey"]
    driver = boto3.Session(aws_access_key_id=keys["AccessKeyId"], aws_secret_access_key=keys["SecretAccessKey"],
                           region_name=aws_env.region)
    gate = IAMGate(aws_env.region)
    gate.watch_user(user)
    gate.watch_roles_matching("sgpu-*")
    run_id = f"r-late-gated-{tag}"
    run_tags = rq.run_tags(store_uri, 600)
    prov = EC2Provisioner(EC2Settings(**{**settings, "instance_profile": None, "job_roles": True,
                                         "node_permissions_boundary": boundary}), session=driver, run_tags=run_tags)
    aws_faults.iam_gate = gate
    aws_faults.launch_faults.clock = virtual_clock
    aws_faults.launch_faults.late_profile(roles.role_name(run_id), 40.0)
    try:
        policy = roles.node_policy(run_id, aws_env.region, ACCOUNT, [f"{store_uri}/{run_id}"], store_scope(store_uri))
        roles.create(prov.client("iam"), run_id, policy, {rq.RUN_ID_TAG: run_id, **run_tags}, store_scope(store_uri),
                     boundary)
        instances = prov.provision(run_id, make_plan(), USER_DATA)
        assert len(instances) == 2
        errors = [error for _, _, error in launches(aws_faults)]
        assert errors[-1] is None and set(errors[:-1]) == {"InvalidParameterValue"}, errors
        assert aws_faults.launch_faults.refused_profile(roles.role_name(run_id)) == len(errors) - 1
        assert gate.denied == [], gate.denied
        judged = {action for _, action in gate.allowed}
        assert {"ec2:RunInstances", "iam:PassRole", "iam:CreateInstanceProfile"} <= judged, judged
    finally:
        try:
            prov.terminate(run_id)
            roles.delete(prov.client("iam"), run_id)
        finally:
            aws_faults.iam_gate = None
