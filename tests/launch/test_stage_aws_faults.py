"""The environment stage's own AWS requests on AWS's bad days: moto server behind the fault proxy (and the
IAM gate), a fake IMDSv2, the stage's transport (:mod:`prefect_sgpu.launch.ec2_stage`) as a node runs it,
and the retry helper's clock made virtual, so minutes of lateness pass at once."""

from __future__ import annotations

import json
import uuid
from typing import Any, Iterator

import pytest

from prefect_sgpu.launch import ec2_stage
from support.aws_fault_proxy import AWSFaultProxy
from support.ec2_simulator import FakeIMDS


@pytest.fixture
def bucket(aws_env: Any) -> str:
    name = f"sgpu-stage-{uuid.uuid4().hex[:10]}"
    aws_env.client("s3").create_bucket(Bucket=name)
    return name


@pytest.fixture
def imds(monkeypatch: pytest.MonkeyPatch, virtual_clock: Any) -> Iterator[FakeIMDS]:
    """An IMDSv2 whose lateness counts on the virtual clock; the node has no keys in its environment."""
    server = FakeIMDS({"instance-id": "i-0stage"}, clock=virtual_clock.monotonic)
    monkeypatch.setenv(ec2_stage.IMDS_ENV, server.url)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    yield server
    server.close()


def _transport(aws_env: Any, bucket: str, region: str | None = None) -> ec2_stage.S3StageTransport:
    return ec2_stage.S3StageTransport(f"s3://{bucket}/jobs", region or aws_env.region, aws_env.endpoint_url)


def test_s3_slowdown_three_times_then_the_object(aws_env: Any, aws_faults: AWSFaultProxy, bucket: str,
                                                  virtual_clock: Any) -> None:
    aws_env.client("s3").put_object(Bucket=bucket, Key="jobs/a/manifest.json", Body=b"{}")
    slow = aws_faults.fail_http(rf"^/{bucket}/jobs/a/manifest\.json", "SlowDown", method="GET", times=3)
    assert _transport(aws_env, bucket).get("a/manifest.json") == b"{}"
    assert slow.hits == 3 and len(virtual_clock.slept) == 3


def test_an_s3_500_and_a_reset_connection_on_put_are_retried(aws_env: Any, aws_faults: AWSFaultProxy,
                                                            bucket: str, virtual_clock: Any) -> None:
    reset = aws_faults.fail_http(rf"^/{bucket}/jobs/r1/setup/", method="PUT", reset=True, times=2)
    broken = aws_faults.fail_http(rf"^/{bucket}/jobs/r1/setup/", "InternalError", method="PUT", times=1)
    _transport(aws_env, bucket).put("r1/setup/i-1.log", b"what the stage said")
    assert reset.hits == 2 and broken.hits == 1
    body = aws_env.client("s3").get_object(Bucket=bucket, Key="jobs/r1/setup/i-1.log")["Body"].read()
    assert body == b"what the stage said"


def test_ssm_throttling_is_retried(aws_env: Any, aws_faults: AWSFaultProxy, bucket: str, virtual_clock: Any) -> None:
    aws_env.client("ssm").put_parameter(Name=f"/sgpu/{bucket}/secrets", Value="s3cret", Type="SecureString")
    busy = aws_faults.fail("GetParameter", "ThrottlingException", times=4)
    assert _transport(aws_env, bucket).read_secret(f"/sgpu/{bucket}/secrets") == "s3cret"
    assert busy.hits == 4


def test_a_request_that_stays_throttled_fails_after_the_budget(aws_env: Any, aws_faults: AWSFaultProxy,
                                                               bucket: str, virtual_clock: Any) -> None:
    aws_faults.fail_http(rf"^/{bucket}/jobs/gone", "SlowDown", method="GET")
    transport = _transport(aws_env, bucket)
    with pytest.raises(ec2_stage.TransportError, match="SlowDown"):
        transport.get("gone")
    assert ec2_stage.CLOUD_BUDGET_S - 1 <= virtual_clock.waited_s <= ec2_stage.CLOUD_BUDGET_S + 1


def test_credentials_late_in_imds_are_waited_for(aws_env: Any, aws_faults: AWSFaultProxy, bucket: str,
                                                 imds: FakeIMDS, virtual_clock: Any) -> None:
    imds.metadata.update(FakeIMDS.role_entries("sgpu-node", ("ASIALATE", "secret", "token"), 6 * 3600))
    imds.credentials_late_s = 90.0
    aws_env.client("s3").put_object(Bucket=bucket, Key="jobs/k", Body=b"v")
    transport = _transport(aws_env, bucket)
    assert transport.get("k") == b"v"
    assert imds.late_answers >= 2 and 90 <= virtual_clock.waited_s < ec2_stage.CLOUD_BUDGET_S


def test_credentials_about_to_expire_are_read_again_before_a_request(aws_env: Any, aws_faults: AWSFaultProxy,
                                                                     bucket: str, imds: FakeIMDS,
                                                                     virtual_clock: Any) -> None:
    imds.metadata.update(FakeIMDS.role_entries("sgpu-node", ("ASIAFIRST", "secret1", "token1"), 600))
    aws_env.client("s3").put_object(Bucket=bucket, Key="jobs/k", Body=b"v")
    transport = _transport(aws_env, bucket)
    assert transport.get("k") == b"v" and transport.creds[0] == "ASIAFIRST"
    # a long environment build later: EC2 serves rotated keys, and the first ones expire
    imds.metadata.update(FakeIMDS.role_entries("sgpu-node", ("ASIASECOND", "secret2", "token2"), 6 * 3600))
    aws_faults.expired_keys.add("ASIAFIRST")
    virtual_clock.advance(400)  # 200 s left of the first keys' 600
    assert transport.get("k") == b"v"
    assert not [r for r in aws_faults.requests if r.error == "ExpiredToken"]
    assert transport.creds[0] == "ASIASECOND"


def test_a_bucket_in_another_region_is_asked_there(aws_env: Any, aws_faults: AWSFaultProxy, bucket: str,
                                                   virtual_clock: Any) -> None:
    aws_env.client("s3").put_object(Bucket=bucket, Key="jobs/k", Body=b"v")
    aws_faults.bucket_regions[bucket] = "eu-west-1"
    before = len(aws_faults.requests)
    transport = _transport(aws_env, bucket)  # the job's region: us-east-1
    assert transport.get("k") == b"v" and transport.bucket_region == "eu-west-1"
    transport.put("k2", b"w")  # signed for the bucket's region from now on: no second redirect
    assert [r.error for r in aws_faults.requests[before:]] == ["PermanentRedirect", None, None]


def test_a_bucket_name_with_dots_is_addressed_path_style(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    dotted = ec2_stage.S3StageTransport("s3://data.example.com/jobs", "eu-west-1")
    request = dotted._request("GET", "r1/manifest.json")
    assert request.full_url == "https://s3.eu-west-1.amazonaws.com/data.example.com/jobs/r1/manifest.json"
    assert dotted._moved("us-west-2") and dotted.base == "https://s3.us-west-2.amazonaws.com"
    plain = ec2_stage.S3StageTransport("s3://data-example/jobs", "eu-west-1")
    assert plain._request("GET", "k").full_url == "https://data-example.s3.eu-west-1.amazonaws.com/jobs/k"


def test_a_job_roles_policy_not_yet_propagated_is_waited_for_then_a_missing_permission_is_named(
        aws_env: Any, aws_faults: AWSFaultProxy, bucket: str, imds: FakeIMDS, virtual_clock: Any) -> None:
    from support.iam_gate import IAMGate

    iam, role = aws_env.client("iam"), f"sgpu-job-{uuid.uuid4().hex[:8]}"
    gate = IAMGate(aws_env.region)
    gate.watch_role(role)
    gate.propagation_s, gate.clock = 60.0, virtual_clock.monotonic
    aws_faults.iam_gate = gate
    try:
        trust = {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]}
        arn = iam.create_role(RoleName=role, AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
        iam.put_role_policy(RoleName=role, PolicyName="node", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [
                {"Effect": "Allow", "Action": "s3:GetObject", "Resource": f"arn:aws:s3:::{bucket}/jobs/*"}]}))
        keys = aws_env.client("sts").assume_role(RoleArn=arn, RoleSessionName="i-0stage")["Credentials"]
        imds.metadata.update(FakeIMDS.role_entries(role, (keys["AccessKeyId"], keys["SecretAccessKey"],
                                                          keys["SessionToken"]), 6 * 3600))
        aws_env.client("s3").put_object(Bucket=bucket, Key="jobs/k", Body=b"v")
        transport = _transport(aws_env, bucket)
        assert transport.get("k") == b"v"  # refused until the policy took effect, 60 (virtual) s after it was written
        assert gate.denied and 60 <= virtual_clock.waited_s < ec2_stage.ROLE_PROPAGATION_S
        with pytest.raises(ec2_stage.TransportError, match=r"s3:PutObject on s3://.*/jobs/r1/x was refused "
                                                           r"\(AccessDenied\).*its role lacks s3:PutObject"):
            transport.put("r1/x", b"no")
        assert ec2_stage.ROLE_PROPAGATION_S <= virtual_clock.waited_s < ec2_stage.ROLE_PROPAGATION_S + 25
    finally:
        aws_faults.iam_gate = None


def test_the_bootstraps_ssm_client_made_before_credentials_existed_is_built_again(
        aws_env: Any, aws_faults: AWSFaultProxy, bucket: str, imds: FakeIMDS, virtual_clock: Any) -> None:
    from prefect_sgpu.launch.ec2_host import EC2NodeHost

    aws_env.client("ssm").put_parameter(Name=f"/sgpu/{bucket}/key", Value="k3y", Type="SecureString")
    imds.metadata.update(FakeIMDS.role_entries("sgpu-node", ("ASIABOOT", "secret", "token"), 6 * 3600))
    # the first four asks find no credentials yet: more than one client's tries (aws.METADATA_PATIENCE: 3)
    imds.credentials_late = lambda: imds.late_answers < 4
    host = EC2NodeHost(aws_env.region, aws_env.endpoint_url)
    assert host.read_secret(f"/sgpu/{bucket}/key") == "k3y"
    assert imds.late_answers == 4 and virtual_clock.slept
