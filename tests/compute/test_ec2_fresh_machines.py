"""A job that asks for fresh machines (``fresh_machines=True``) runs on none of a warm lease's, even
where its compute keeps machines warm: the jobs one lease serves are one principal (docs/security.md),
and such a job shares its machines with no other job's code. Checked where it is decided, in the plan,
before anything is spent (what ``dry_run`` shows is what ``acquire`` launches)."""

from __future__ import annotations

from typing import Any

import pytest

from prefect_sgpu import spec
from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute
from prefect_sgpu.compute.ec2.settings import EC2Settings
from prefect_sgpu.compute.remote.lease import lease_id
from prefect_sgpu.errors import SGPUConfigError

BASE = dict(region="us-east-1", store_uri="s3://bucket/jobs", subnet_ids=["subnet-0123456789abcdef0"],
            instance_profile="nodes", ami_id="ami-0123456789abcdef0")


def test_a_job_that_asks_for_fresh_machines_takes_no_warm_lease_and_leaves_none(aws_env: Any) -> None:
    compute = EC2InstanceCompute(EC2Settings(**BASE, keep_warm=300))
    shared = compute.plan(spec.JobSpec(gpus=2, gpu_type="A10", remote=True), "r-shared")
    assert shared.lease_id == lease_id("r-shared") and shared.keep_warm == 300
    assert "--lease" in shared.user_data and "keep_warm" in shared.describe()

    fresh = compute.plan(spec.JobSpec(gpus=2, gpu_type="A10", remote=True, fresh_machines=True), "r-fresh")
    # a cold job's request: acquire takes no lease from the pool, launches machines for this run and
    # terminates them at release, so no job ran on them before and none runs after
    assert fresh.lease_id == "" and fresh.keep_warm == 0
    assert "--lease" not in fresh.user_data and "--run-id=r-fresh" in fresh.user_data
    assert "keep_warm" not in fresh.describe()


def test_fresh_machines_is_a_job_option_of_every_layer_and_a_bad_value_names_the_field() -> None:
    assert spec.build(environ={}).fresh_machines is False
    assert spec.build(environ={"PREFECT_SGPU_FRESH_MACHINES": "true"}).fresh_machines is True
    assert spec.build(spec.layer("task", fresh_machines=False),
                      environ={"PREFECT_SGPU_FRESH_MACHINES": "1"}).fresh_machines is False
    with pytest.raises(SGPUConfigError) as info:
        spec.build(environ={"PREFECT_SGPU_FRESH_MACHINES": "sometimes"})
    assert info.value.field == "PREFECT_SGPU_FRESH_MACHINES" and info.value.value == "sometimes", info.value
