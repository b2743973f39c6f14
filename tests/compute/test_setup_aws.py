"""``prefect-sgpu setup aws`` against moto (behind the fault proxy and the IAM gate), through real boto3
clients: a store's bucket, policies and shared profile made on an empty account, a second run that
writes nothing, a dry run that asks nothing, and the doctor green for a driver holding what it made."""

from __future__ import annotations

import json
import uuid
from typing import Any

import boto3
import pytest

from prefect_sgpu import cli
from prefect_sgpu.compute.ec2 import doctor, setup
from prefect_sgpu.compute.ec2.settings import EC2Settings
from support.aws_fixtures import REGION, MotoAWS
from support.iam_gate import ACCOUNT, IAMGate

G_ON_DEMAND = "L-DB2E81BA"
POLICIES = (setup.BOUNDARY_POLICY, setup.DRIVER_POLICY, setup.DOCTOR_POLICY)


def _setup(capsys: pytest.CaptureFixture[str], aws: MotoAWS, *args: str) -> tuple[int, dict[str, Any]]:
    code = cli.main(["setup", "aws", "--region", REGION, "--endpoint-url", aws.endpoint_url, "--json", *args])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


def _remove(aws: MotoAWS, bucket: str, profile: str | None, suffix: str = "") -> None:
    iam = aws.client("iam")
    for name in [*POLICIES, *(f"{n}{suffix}" for n in POLICIES if suffix)]:
        arn = f"arn:aws:iam::{ACCOUNT}:policy/{name}"
        try:
            for user in iam.list_entities_for_policy(PolicyArn=arn)["PolicyUsers"]:
                iam.detach_user_policy(UserName=user["UserName"], PolicyArn=arn)
            for version in iam.list_policy_versions(PolicyArn=arn)["Versions"]:
                if not version["IsDefaultVersion"]:
                    iam.delete_policy_version(PolicyArn=arn, VersionId=version["VersionId"])
            iam.delete_policy(PolicyArn=arn)
        except iam.exceptions.NoSuchEntityException:
            pass
    if profile:
        iam.remove_role_from_instance_profile(InstanceProfileName=profile, RoleName=profile)
        iam.delete_instance_profile(InstanceProfileName=profile)
        iam.delete_role_policy(RoleName=profile, PolicyName=setup.SHARED_PROFILE_POLICY)
        iam.delete_role(RoleName=profile)
    aws.client("s3").delete_bucket(Bucket=bucket)


def test_setup_makes_a_store_ready_once_and_the_doctor_finds_it_green(
        aws_env: MotoAWS, aws_faults: Any, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    tag = uuid.uuid4().hex[:8]
    bucket, profile = f"sgpu-setup-{tag}", f"sgpu-nodes-{tag}"
    store = f"s3://{bucket}/jobs"
    try:
        code, first = _setup(capsys, aws_env, "--store", store, "--instance-profile", profile,
                             "--abort-incomplete-uploads-days", "3")
        assert code == 0, first
        made = {s["name"]: s["status"] for s in first["steps"]}
        assert made == {"bucket": "created", "bucket encryption": "created", "bucket lifecycle": "created",
                        setup.BOUNDARY_POLICY: "created", f"role {profile}": "created",
                        f"role {profile} policy": "created", f"instance profile {profile}": "created",
                        setup.DRIVER_POLICY: "created", setup.DOCTOR_POLICY: "created", "network": "found"}, made
        s3 = aws_env.client("s3")
        rule = s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"][0]
        assert rule["ApplyServerSideEncryptionByDefault"] == {"SSEAlgorithm": "AES256"} and rule["BucketKeyEnabled"]
        (lifecycle,) = s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
        assert lifecycle["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 3}
        assert lifecycle["Filter"] == {"Prefix": "jobs/"}
        network = next(s for s in first["steps"] if s["name"] == "network")["detail"]
        assert "default VPC vpc-" in network and "NAT gateways: none" in network
        assert first["block"] == {"region": REGION, "store_uri": store, "instance_profile": profile}

        # again: every step reads, none writes
        code, second = _setup(capsys, aws_env, "--store", store, "--instance-profile", profile,
                              "--abort-incomplete-uploads-days", "3")
        assert code == 0
        assert {s["status"] for s in second["steps"]} <= {"unchanged", "found"}, second["steps"]
        assert [c for c in second["calls"] if c.split(".", 1)[1].startswith(setup.WRITES)] == []
        iam = aws_env.client("iam")
        assert [iam.get_policy(PolicyArn=f"arn:aws:iam::{ACCOUNT}:policy/{n}")["Policy"]["DefaultVersionId"]
                for n in POLICIES] == ["v1"] * 3

        # another store of the account: the first store's policies are not taken over; names of its own are fine
        assert cli.main(["setup", "aws", "--region", REGION, "--endpoint-url", aws_env.endpoint_url, "--store",
                         f"s3://{bucket}/other"]) == 2
        assert "--name-suffix" in capsys.readouterr().err
        code, other = _setup(capsys, aws_env, "--store", f"s3://{bucket}/other", f"--name-suffix=-{tag}")
        assert code == 0 and other["attach_to_driver"][0].endswith(f"policy/{setup.DRIVER_POLICY}-{tag}")

        # a driver holding the driver and doctor policies it made: every doctor check passes, every call judged
        user = f"sgpu-setup-driver-{tag}"
        iam.create_user(UserName=user)
        for arn in first["attach_to_driver"]:
            iam.attach_user_policy(UserName=user, PolicyArn=arn)
        keys = iam.create_access_key(UserName=user)["AccessKey"]
        session = boto3.Session(aws_access_key_id=keys["AccessKeyId"], aws_secret_access_key=keys["SecretAccessKey"],
                                region_name=REGION)
        gate = IAMGate(REGION)
        gate.watch_user(user)
        gate.kms_via_ssm = gate.encode_ec2_messages = True
        aws_faults.ec2_quotas[G_ON_DEMAND] = 64.0
        settings = EC2Settings(region=REGION, endpoint_url=aws_env.endpoint_url, store_uri=store,
                               ami_id=aws_env.image_id(), instance_profile=profile)
        aws_faults.iam_gate = gate
        try:
            checks = doctor.examine(settings, doctor.Wanted.of("A10", 1, None), session=session)
        finally:
            aws_faults.iam_gate = None
        statuses = {c.name: c.status for c in checks}
        assert {n for n, s in statuses.items() if s not in ("ok", "skip")} == set(), doctor.report(checks)
        assert statuses["shared profile"] == statuses["launch (dry run)"] == statuses["EBS key"] == "ok", \
            doctor.report(checks)
        # one refusal, on purpose: HeadBucket needs s3:ListBucket of the whole bucket, which a driver of one
        # prefix does not hold; the store check then reads the bucket's location (doctor policy)
        assert [(d.action, d.context) for d in gate.denied] == [("s3:ListBucket", {"s3:prefix": [""]})], gate.denied
        assert (f"user/{user}", "s3:GetBucketLocation") in gate.allowed
    finally:
        _remove(aws_env, bucket, profile, f"-{tag}")


def test_a_dry_run_asks_nothing_and_lists_every_call_of_a_first_run(
        aws_env: MotoAWS, aws_faults: Any, capsys: pytest.CaptureFixture[str]) -> None:
    store = f"s3://sgpu-setup-dry-{uuid.uuid4().hex[:8]}/jobs"
    code, out = _setup(capsys, aws_env, "--store", store, "--dry-run")
    assert code == 0
    assert aws_faults.requests == [], "no call reached AWS"
    operations = [c.split(" ", 1)[0] for c in out["calls"]]
    assert operations == ["sts.get_caller_identity", "s3.head_bucket", "s3.create_bucket", "s3.get_bucket_encryption",
                          "s3.put_bucket_encryption", "s3.get_bucket_lifecycle_configuration",
                          "s3.put_bucket_lifecycle_configuration", "iam.get_policy", "iam.create_policy",
                          "iam.get_policy", "iam.create_policy", "iam.get_policy", "iam.create_policy",
                          "ec2.describe_vpcs"], operations
    created = [json.loads(c.split(" ", 1)[1]) for c in out["calls"] if c.startswith("iam.create_policy")]
    assert [c["PolicyName"] for c in created] == list(POLICIES)
    assert isinstance(created[1]["PolicyDocument"], dict), "documents are shown whole, as JSON"
    assert {s["status"] for s in out["steps"]} == {"would", "found"}


@pytest.mark.parametrize(("args", "named"), [
    (["--store", "/local/folder"], "store_uri"),
    (["--store", "s3://b/jobs", "--abort-incomplete-uploads-days", "0"], "abort_after_days"),
    (["--store", "s3://b/jobs", "--instance-profile", "a/b"], "instance_profile"),
])
def test_bad_arguments_exit_2_naming_them_before_any_call(
        args: list[str], named: str, aws_env: MotoAWS, aws_faults: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["setup", "aws", "--endpoint-url", aws_env.endpoint_url, *args]) == 2
    assert named in capsys.readouterr().err
    assert aws_faults.requests == []
