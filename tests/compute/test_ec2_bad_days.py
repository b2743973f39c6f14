"""A job on AWS's bad day, end to end: a bare node whose instance profile's credentials IMDS serves 90 s
late while S3 throttles the node's first reads. The node's retry helper runs on a clock 30 times faster
(``support/node_clock``; its IMDS counts lateness on the same scale), so the 90 s pass in about 3."""

from __future__ import annotations

import json
import uuid

import pytest

from prefect_sgpu import distributed
from support.conformance_ec2 import EC2Env

pytestmark = pytest.mark.e2e


def _square(x: int) -> dict[str, int]:
    from prefect_sgpu import runtime

    return {"rank": runtime.rank(), "value": x * x}


def _profile_with_a_role(ec2: EC2Env) -> str:
    """An instance profile with a role: its nodes get their credentials from IMDS, not the environment."""
    iam, name = ec2.aws.client("iam"), f"sgpu-late-{uuid.uuid4().hex[:8]}"
    trust = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]}
    iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust))
    iam.create_instance_profile(InstanceProfileName=name)
    iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)
    return name


def test_late_credentials_and_s3_slowdown_on_a_bare_node_still_return_the_values(ec2: EC2Env) -> None:
    assert ec2.proxy is not None
    ec2.simulator.clock_scale = 30.0
    ec2.simulator.credentials_late_s = 90.0
    # the node's stage (urllib) reading the environment: the driver's own requests pass
    slow = ec2.proxy.fail_http(rf"^/{ec2.bucket}/jobs/\.environments/[0-9a-f]{{64}}/manifest-", "SlowDown",
                               method="GET", times=3, client="Python-urllib")
    compute = ec2.compute(instance_profile=_profile_with_a_role(ec2))
    fn = distributed(gpus=1, gpu_type="A10", remote=True, compute=compute, mlflow=False, timeout=600)(_square)
    result = fn.job(7).run()

    assert result.values == [{"rank": 0, "value": 49}]
    assert slow.hits == 3
    (node,) = ec2.simulator.nodes.values()
    console = ec2.simulator.console(node.instance_id)
    assert node.imds.late_answers >= 1, console
    assert "the instance profile's credentials (IMDS)" in console and "succeeded after waiting" in console, console
    assert "SlowDown" in console and "environment setup failed" not in console, console
    assert ec2.simulator.shutdowns(node.instance_id) == "", "the node did not power itself off"
