"""A run's groups after its instances ended: EC2 keeps them in use for a while (moto server behind the
fault proxy, real boto3 clients, the retry helper on a virtual clock).

The proxy's :meth:`~support.aws_fault_proxy.AWSFaultProxy.hold_groups` answers ``DependencyViolation``
to ``DeleteSecurityGroup`` and ``InvalidPlacementGroup.InUse`` to ``DeletePlacementGroup`` for the set
seconds after the group's last instance was terminated, as EC2 does.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest

from prefect_sgpu import spec
from prefect_sgpu.compute.ec2 import request as rq
from prefect_sgpu.compute.ec2.cleanup import GROUP_DELETE_BUDGET_S
from prefect_sgpu.compute.ec2.instances import EC2Provisioner
from prefect_sgpu.compute.ec2.settings import EC2Settings
from prefect_sgpu.compute.remote.sweep import Sweeper
from prefect_sgpu.store.s3 import S3Store

pytestmark = pytest.mark.usefixtures("no_leaked_instances")

USER_DATA = "#!/bin/bash\necho node-bootstrap\n"


def _settings(aws_env: Any, aws_network: Any) -> dict[str, Any]:
    return {"region": aws_env.region, "subnet_ids": aws_network.subnet_ids,
            "instance_profile": aws_env.instance_profile(), "ami_id": aws_env.image_id(),
            "endpoint_url": aws_env.endpoint_url, "max_attempts": 2, "waiter_delay_s": 0.2,
            "running_timeout_s": 30, "placement_group": "cluster"}  # g5.xlarge gets a group only when forced


def _groups(aws_env: Any, run_id: str) -> dict[str, list[str]]:
    ec2 = aws_env.client("ec2")
    run_filter = [{"Name": f"tag:{rq.RUN_ID_TAG}", "Values": [run_id]}]
    return {"security group": [g["GroupId"] for g in
                               ec2.describe_security_groups(Filters=run_filter)["SecurityGroups"]],
            "placement group": [g["GroupName"] for g in
                                ec2.describe_placement_groups(Filters=run_filter)["PlacementGroups"]]}


def _answers(faults: Any, action: str) -> list[str | None]:
    return [c.error for c in faults.calls(action)]


def test_groups_in_use_for_minutes_after_termination_are_waited_out_on_the_retry_clock(
        aws_env: Any, aws_network: Any, aws_faults: Any, virtual_clock: Any) -> None:
    """Two minutes of DependencyViolation and twenty seconds of InvalidPlacementGroup.InUse after the
    instances ended: terminate retries both (the virtual clock lets the minutes pass) and deletes both."""
    aws_faults.hold_groups(security_group_s=120.0, placement_group_s=20.0)
    prov = EC2Provisioner(EC2Settings(**_settings(aws_env, aws_network)))
    run_id = f"r-held-{uuid.uuid4().hex[:6]}"
    instances = prov.provision(run_id, spec.plan_remote(spec.JobSpec(gpus=2, gpu_type="A10", remote=True)), USER_DATA)
    (sg,) = _groups(aws_env, run_id)["security group"]

    gone = prov.terminate(run_id)

    assert sorted(gone) == sorted([i.id for i in instances] + [f"security group {sg}",
                                                             f"placement group sgpu-{run_id}"])
    assert _groups(aws_env, run_id) == {"security group": [], "placement group": []}
    sg_answers = _answers(aws_faults, "DeleteSecurityGroup")
    pg_answers = _answers(aws_faults, "DeletePlacementGroup")
    assert sg_answers[-1] is None and set(sg_answers[:-1]) == {"DependencyViolation"} and len(sg_answers) > 2
    assert pg_answers[-1] is None and set(pg_answers[:-1]) == {"InvalidPlacementGroup.InUse"}
    # the two minutes passed on the virtual clock (the real seconds of the test count toward them too)
    assert virtual_clock.waited_s >= 100.0


def test_a_group_still_in_use_past_the_budget_is_logged_left_and_removed_by_the_sweeper_once_free(
        aws_env: Any, aws_network: Any, aws_faults: Any, virtual_clock: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """EC2 keeps the security group in use for an hour: terminate does not raise, waits its budget,
    logs which group of which run is left and why; a sweep while EC2 still refuses leaves it (no
    error); once EC2 lets go, the next sweep removes it."""
    hold_s = 3600.0
    aws_faults.hold_groups(security_group_s=hold_s, placement_group_s=0.0)
    bucket = f"sgpu-groups-{uuid.uuid4().hex[:10]}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    store = S3Store(f"s3://{bucket}/jobs", session=aws_env.session(), endpoint_url=aws_env.endpoint_url)
    prov = EC2Provisioner(EC2Settings(**_settings(aws_env, aws_network)), session=aws_env.session(),
                          run_tags=rq.run_tags(store.root_uri, 60.0))
    run_id = f"r-left-{uuid.uuid4().hex[:6]}"
    prov.provision(run_id, spec.plan_remote(spec.JobSpec(gpus=1, gpu_type="A10", remote=True)), USER_DATA)
    (sg,) = _groups(aws_env, run_id)["security group"]

    with caplog.at_level(logging.INFO, logger="prefect_sgpu.compute.ec2.cleanup"):
        gone = prov.terminate(run_id)  # what release calls: it must not raise

    assert f"security group {sg}" not in gone and f"placement group sgpu-{run_id}" in gone
    assert _groups(aws_env, run_id)["security group"] == [sg]
    left = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(sg in m and run_id in m and "left for the sweeper" in m and "DependencyViolation" in m
               for m in left), left
    budget = GROUP_DELETE_BUDGET_S["security group"]
    assert budget - 10 <= virtual_clock.waited_s <= budget  # the budget, on the virtual clock

    sweeper = Sweeper(store, ttl_s=60.0, cloud=EC2Provisioner(EC2Settings(region=aws_env.region,
                                                                          endpoint_url=aws_env.endpoint_url),
                                                              session=aws_env.session()))
    early = sweeper.sweep()
    assert [x.name for x in early.found] == [sg] and early.removed == [] and early.errors == []

    virtual_clock.advance(aws_faults.group_free_in("security group", sg) + 1)
    later = sweeper.sweep()
    assert [x.name for x in later.removed] == [sg] and later.errors == []
    assert _groups(aws_env, run_id)["security group"] == []
