"""The doctor's store lifecycle check: a bucket without a rule that aborts the store's incomplete multipart
uploads is a warning with the fix. Against moto behind the fault proxy and the IAM gate (which judges
``s3:GetLifecycleConfiguration`` as AWS does), through real boto3 clients; the check writes nothing."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from prefect_sgpu.compute.ec2 import doctor, roles, setup
from prefect_sgpu.compute.ec2.doctor_checks import abort_rule_for
from prefect_sgpu.compute.ec2.settings import EC2Settings
from support.aws_fixtures import REGION, MotoAWS, iam_user_session
from support.iam_gate import ACCOUNT, IAMGate

BOUNDARY = f"arn:aws:iam::{ACCOUNT}:policy/prefect-sgpu-node-boundary"
ABORT = {"AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 3}}


@pytest.mark.parametrize("rule, covers", [
    ({"ID": "all", "Status": "Enabled", "Filter": {}, **ABORT}, True),
    ({"ID": "all-old", "Status": "Enabled", "Prefix": "", **ABORT}, True),
    ({"ID": "parent", "Status": "Enabled", "Filter": {"Prefix": "team/"}, **ABORT}, True),
    ({"ID": "same", "Status": "Enabled", "Filter": {"Prefix": "team/jobs/"}, **ABORT}, True),
    ({"ID": "and", "Status": "Enabled", "Filter": {"And": {"Prefix": "team"}}, **ABORT}, True),
    ({"ID": "other", "Status": "Enabled", "Filter": {"Prefix": "logs/"}, **ABORT}, False),
    ({"ID": "deeper", "Status": "Enabled", "Filter": {"Prefix": "team/jobs/run-1/"}, **ABORT}, False),
    ({"ID": "off", "Status": "Disabled", "Filter": {}, **ABORT}, False),
    ({"ID": "tagged", "Status": "Enabled", "Filter": {"Tag": {"Key": "k", "Value": "v"}}, **ABORT}, False),
    ({"ID": "expiry", "Status": "Enabled", "Filter": {}, "Expiration": {"Days": 30}}, False),
])
def test_which_rules_abort_the_stores_incomplete_uploads(rule: dict[str, Any], covers: bool) -> None:
    assert (abort_rule_for([rule], "team/jobs/") is not None) == covers


def _driver(aws: MotoAWS, *policies: dict[str, Any]) -> tuple[str, Any]:
    return iam_user_session(aws, *policies, prefix="sgpu-lifecycle")


def _check(aws: MotoAWS, store: str, session: Any | None = None) -> doctor.Check:
    made = doctor.Doctor(EC2Settings(region=REGION, endpoint_url=aws.endpoint_url, store_uri=store),
                         session=session or aws.session())
    return made.store_lifecycle()


def test_a_bucket_without_an_abort_rule_for_the_store_warns_with_the_fix(aws_env: MotoAWS, aws_faults: Any) -> None:
    bucket = f"sgpu-lifecycle-{uuid.uuid4().hex[:8]}"
    store = f"s3://{bucket}/team/jobs"
    s3 = aws_env.client("s3")
    s3.create_bucket(Bucket=bucket)
    gate = IAMGate(REGION)
    user, session = _driver(aws_env, roles.driver_policy(store, REGION, ACCOUNT, BOUNDARY),
                            roles.doctor_policy(store, REGION, ACCOUNT))
    gate.watch_user(user)
    aws_faults.iam_gate = gate
    try:
        before = len(aws_faults.requests)
        bare = _check(aws_env, store, session)
        others = [{"ID": "logs", "Status": "Enabled", "Filter": {"Prefix": "logs/"}, **ABORT}]
        s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": others})
        elsewhere = _check(aws_env, store, session)
        setup.AWSSetup(store, REGION, session=aws_env.session(), endpoint_url=aws_env.endpoint_url).bucket_steps()
        fixed = _check(aws_env, store, session)
        checked = [r for r in aws_faults.requests[before:] if r.service == "rest" and "lifecycle" in r.path
                   and r.method == "GET"]
    finally:
        aws_faults.iam_gate = None
    assert bare.status == "warn" and "has no lifecycle rule" in bare.detail, bare
    assert f"s3://{bucket}/team/jobs/" in bare.detail and "billed" in bare.detail
    assert f"prefect-sgpu setup aws --store {store} --region {REGION}" in bare.fix, bare.fix
    rule = json.loads(bare.fix[bare.fix.index("{"):])
    assert rule["Filter"] == {"Prefix": "team/jobs/"} and abort_rule_for([rule], "team/jobs/") == rule
    assert elsewhere.status == "warn" and "1 lifecycle rule(s), none" in elsewhere.detail, elsewhere
    assert fixed.status == "ok" and setup.LIFECYCLE_RULE_ID in fixed.detail, fixed
    assert checked and not [r for r in checked if r.error == "AccessDenied"], "the doctor policy allows the read"
    rules = s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
    assert {r["ID"] for r in rules} == {"logs", setup.LIFECYCLE_RULE_ID}, "the check changed nothing; setup kept 'logs'"


def test_a_driver_without_the_doctor_policy_is_told_what_to_allow(aws_env: MotoAWS, aws_faults: Any) -> None:
    bucket = f"sgpu-lifecycle-{uuid.uuid4().hex[:8]}"
    store = f"s3://{bucket}/jobs"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    gate = IAMGate(REGION)
    user, session = _driver(aws_env, roles.driver_policy(store, REGION, ACCOUNT, BOUNDARY))
    gate.watch_user(user)
    aws_faults.iam_gate = gate
    try:
        check = _check(aws_env, store, session)
    finally:
        aws_faults.iam_gate = None
    assert check.status == "warn" and "AccessDenied" in check.detail, check
    assert "s3:GetLifecycleConfiguration" in check.fix


def test_the_doctor_spends_nothing_on_the_check(aws_env: MotoAWS, aws_faults: Any) -> None:
    bucket = f"sgpu-lifecycle-{uuid.uuid4().hex[:8]}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    before = len(aws_faults.requests)
    assert _check(aws_env, f"s3://{bucket}").status == "warn"
    sent = [(r.method, r.path) for r in aws_faults.requests[before:] if r.service == "rest"]
    assert sent == [("GET", f"/{bucket}?lifecycle")], sent


def test_setup_for_a_second_store_of_a_bucket_keeps_the_first_stores_abort_rule(aws_env: MotoAWS,
                                                                                aws_faults: Any) -> None:
    bucket = f"sgpu-lifecycle-{uuid.uuid4().hex[:8]}"
    first, second = f"s3://{bucket}/jobs", f"s3://{bucket}/other"
    for store in (first, second, first):  # the third run changes nothing
        setup.AWSSetup(store, REGION, session=aws_env.session(), endpoint_url=aws_env.endpoint_url).bucket_steps()
    rules = aws_env.client("s3").get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
    assert sorted(r["Filter"]["Prefix"] for r in rules) == ["jobs/", "other/"], rules
    assert [_check(aws_env, store).status for store in (first, second)] == ["ok", "ok"]
