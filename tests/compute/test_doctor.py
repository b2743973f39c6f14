"""``prefect-sgpu doctor`` against moto (behind the proxy, which answers IAM's policy simulator and
EC2's Service Quotas from moto's own IAM state and the test's quotas), through real boto3 clients."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from prefect_sgpu import cli
from prefect_sgpu.compute.ec2 import roles
from prefect_sgpu.store import store_scope
from support.aws_fixtures import REGION
from support.iam_gate import ACCOUNT

G_ON_DEMAND = "L-DB2E81BA"


def _driver(aws: Any, store_uri: str, policy: dict[str, Any] | None) -> dict[str, str]:
    """An IAM user with ``policy`` (none: no policy at all); returns its keys as environment variables."""
    iam = aws.client("iam")
    user = f"sgpu-doctor-{uuid.uuid4().hex[:8]}"
    iam.create_user(UserName=user)
    if policy is not None:
        iam.put_user_policy(UserName=user, PolicyName="prefect-sgpu-driver", PolicyDocument=json.dumps(policy))
    keys = iam.create_access_key(UserName=user)["AccessKey"]
    return {"AWS_ACCESS_KEY_ID": keys["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": keys["SecretAccessKey"]}


def _as(monkeypatch: pytest.MonkeyPatch, keys: dict[str, str]) -> None:
    for name in ("AWS_SECURITY_TOKEN", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in keys.items():
        monkeypatch.setenv(name, value)


def _doctor(capsys: pytest.CaptureFixture[str], aws: Any, *args: str) -> tuple[int, dict[str, dict[str, str]]]:
    code = cli.main(["doctor", "--region", REGION, "--endpoint-url", aws.endpoint_url, "--json", *args])
    checks = json.loads(capsys.readouterr().out)
    return code, {c["name"]: c for c in checks}


@pytest.fixture
def store(aws_env: Any) -> str:
    bucket = f"sgpu-doctor-{uuid.uuid4().hex[:8]}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/jobs"


def test_an_account_ready_for_a_first_job_passes_every_check(
        aws_env: Any, aws_faults: Any, store: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    boundary = f"arn:aws:iam::{ACCOUNT}:policy/prefect-sgpu-node-boundary"
    _as(monkeypatch, _driver(aws_env, store, roles.driver_policy(store, REGION, ACCOUNT, boundary)))
    aws_faults.ec2_quotas[G_ON_DEMAND] = 64.0
    code, checks = _doctor(capsys, aws_env, "--store", store, "--ami-id", aws_env.image_id(), "--gpu-type", "A10",
                           "--gpus", "2")
    assert {name: c["status"] for name, c in checks.items()} == {
        "credentials": "ok", "region": "ok", "store": "ok", "store lifecycle": "warn", "image": "ok", "instances": "ok", "GPU quota": "ok",
        "driver policy": "ok", "security group": "skip", "EBS key": "ok", "subnet addresses": "skip",
        "subnet egress": "skip", "shared profile": "skip", "job role key": "skip", "launch (dry run)": "ok"}, checks
    assert code == 0
    assert "need 8 of 64 vCPUs" in checks["GPU quota"]["detail"] and G_ON_DEMAND in checks["GPU quota"]["detail"]
    assert "g5.xlarge" in checks["instances"]["detail"]
    assert store in checks["driver policy"]["detail"]
    bucket = store.split("/")[2]
    assert aws_env.client("s3").list_objects_v2(Bucket=bucket).get("KeyCount") == 0, "the probe is deleted"


def test_what_a_first_job_lacks_is_named_with_what_to_do(
        aws_env: Any, aws_faults: Any, store: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    boundary = f"arn:aws:iam::{ACCOUNT}:policy/prefect-sgpu-node-boundary"
    policy = roles.driver_policy(store, REGION, ACCOUNT, boundary)
    policy["Statement"] = [s for s in policy["Statement"] if not s["Sid"].startswith("PassJobRoles")]
    _as(monkeypatch, _driver(aws_env, store, policy))
    aws_faults.ec2_quotas[G_ON_DEMAND] = 4.0
    code, checks = _doctor(capsys, aws_env, "--store", store.replace("sgpu-doctor-", "sgpu-missing-"),
                           "--ami-id", "ami-0000000000000dead", "--gpu-type", "A10", "--gpus", "2", "--nodes", "2")
    assert code == 1
    assert checks["credentials"]["status"] == "ok"
    assert checks["store"]["status"] == "fail" and "does not exist" in checks["store"]["detail"]
    assert checks["image"]["status"] == "fail" and "ami-0000000000000dead" in checks["image"]["detail"]
    quota = checks["GPU quota"]
    assert quota["status"] == "fail" and "2 x g5.xlarge need 8 vCPUs" in quota["detail"] and "has 4" in quota["detail"]
    assert f"--quota-code {G_ON_DEMAND} --desired-value 8" in quota["fix"]
    # the policy check simulates the policy of the store asked about, which this driver was never given
    policy_check = checks["driver policy"]
    assert policy_check["status"] == "fail" and "iam:PassRole" in policy_check["detail"]
    assert "s3:PutObject" in policy_check["detail"], "another store's objects are refused"

    # the same driver, asked about its own store: only the missing statement is named
    code, checks = _doctor(capsys, aws_env, "--store", store)
    policy_check = checks["driver policy"]
    assert policy_check["status"] == "fail", policy_check
    refused = policy_check["detail"].split(": ", 1)[1].split("; ")
    scope = store_scope(store)
    assert refused == [f"iam:PassRole on arn:aws:iam::{ACCOUNT}:role/prefect-sgpu/{scope}/prefect-sgpu-doctor "
                       "(implicitDeny)"]
    assert checks["GPU quota"]["status"] == "skip", "no --gpu-type: nothing to check"

    # as a person reads it: a line a check, and what to do under each failure
    assert cli.main(["doctor", "--region", REGION, "--endpoint-url", aws_env.endpoint_url, "--store", store]) == 1
    lines = capsys.readouterr().out.splitlines()
    failed = next(i for i, line in enumerate(lines) if line.startswith("FAIL  driver policy"))
    assert "-> attach the driver policy for this store" in lines[failed + 1]
    assert any(line.startswith("OK    store") for line in lines), lines


def test_without_credentials_only_that_is_checked(
        aws_env: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SECURITY_TOKEN", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to fall back on here
    code, checks = _doctor(capsys, aws_env, "--store", "s3://any-bucket/jobs")
    assert code == 1
    assert checks["credentials"]["status"] == "fail" and "credentials" in checks["credentials"]["detail"].lower()
    assert {c["status"] for name, c in checks.items() if name != "credentials"} == {"skip"}


@pytest.mark.parametrize(("args", "named"), [
    (["--gpus", "2"], "--gpu-type"),
    (["--gpu-type", "A10", "--gpus", "3", "--nodes", "2"], "gpus"),
    (["--gpu-type", "Z99"], "gpu"),
])
def test_bad_arguments_exit_2_naming_them_before_any_call(
        args: list[str], named: str, aws_env: Any, aws_faults: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["doctor", "--endpoint-url", aws_env.endpoint_url, *args])
    assert code == 2
    assert named in capsys.readouterr().err
    assert aws_faults.requests == [], "nothing asked of AWS"


def test_a_bucket_in_another_region_fails_when_nodes_build_the_environment_from_it(
        aws_env: Any, aws_faults: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect_sgpu.compute.ec2 import doctor
    from prefect_sgpu.compute.ec2.settings import EC2Settings
    from prefect_sgpu.environment import ENVIRONMENT_ENV

    bucket = f"sgpu-doctor-{uuid.uuid4().hex[:8]}"
    aws_env.client("s3").create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    settings = EC2Settings(region=REGION, store_uri=f"s3://{bucket}/jobs", endpoint_url=aws_env.endpoint_url)
    monkeypatch.delenv(ENVIRONMENT_ENV, raising=False)
    built = doctor.Doctor(settings, session=aws_env.session()).store()  # environment mode 'driver', the default
    assert built.status == "fail" and "eu-west-1" in built.detail and REGION in built.detail, built
    assert f"--region {REGION}" in built.fix and "region=eu-west-1" in built.fix, built
    baked = doctor.Doctor(settings, session=aws_env.session(), builds_on_nodes=False).store()
    assert baked.status == "warn", baked
