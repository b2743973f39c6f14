"""A store key given as a KMS alias is resolved to its key ARN before any policy names it (issue 49, part B).

IAM authorizes KMS's cryptographic calls against the key's own ARN; an alias ARN in a policy's Resource
matches only the alias operations ("Using aliases to control access to KMS keys",
https://docs.aws.amazon.com/kms/latest/developerguide/alias-authorization.html). A node policy and
boundary rendered with ``kms_key_id="alias/..."`` therefore allowed nothing with the key: a job role
could not decrypt its own job key. Judged here by the IAM gate (``kms_via_ssm``: SSM decrypts a
SecureString with ``kms:Decrypt`` on the key; ``kms_resources``: the driver's DescribeKey on the key
the alias names), against moto server through real boto3 clients.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import boto3
import pytest

from prefect_sgpu.compute.ec2 import request as rq
from prefect_sgpu.compute.ec2 import roles
from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.protocol.jobfolder import ssm_key_parameter
from prefect_sgpu.store import store_scope
from support.aws_fixtures import MotoAWS
from support.iam_gate import ACCOUNT, IAMGate, outcome_of


def _session_of(creds: dict[str, str], region: str) -> Any:
    return boto3.Session(aws_access_key_id=creds["AccessKeyId"], aws_secret_access_key=creds["SecretAccessKey"],
                         aws_session_token=creds.get("SessionToken"), region_name=region)


def test_an_alias_store_key_is_resolved_once_and_a_job_role_decrypts_its_key_under_it(
        aws_env: MotoAWS, aws_faults: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    store, run = f"s3://sgpu-kms-alias-{tag}/jobs", f"run-{tag}"
    scope = store_scope(store)
    iam, ssm, kms = aws_env.client("iam"), aws_env.client("ssm"), aws_env.client("kms")
    key = kms.create_key(Description=f"sgpu store {tag}")["KeyMetadata"]
    alias = f"alias/sgpu-store-{tag}"
    kms.create_alias(AliasName=alias, TargetKeyId=key["KeyId"])

    # a policy naming the alias allows nothing with the key: refused where it would be rendered
    with pytest.raises(SGPUConfigError, match=r"kms_key_id='alias/sgpu-store-.*never matches an alias"):
        roles.node_policy(run, aws_env.region, ACCOUNT, [f"{store}/{run}"], scope, kms_key_id=alias)

    # the driver: an IAM user holding the shipped driver policy, rendered for the key the alias names
    boundary_doc = roles.node_boundary(store, aws_env.region, ACCOUNT, roles.resolve_kms_key(kms, alias))
    boundary = iam.create_policy(PolicyName=f"sgpu-boundary-{tag}",
                                 PolicyDocument=json.dumps(boundary_doc))["Policy"]["Arn"]
    user = f"sgpu-kms-driver-{tag}"
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="driver", PolicyDocument=json.dumps(roles.driver_policy(
        store, aws_env.region, ACCOUNT, boundary, kms_key_id=key["Arn"])))
    driver = _session_of(iam.create_access_key(UserName=user)["AccessKey"], aws_env.region)
    compute = EC2InstanceCompute.from_settings({"region": aws_env.region, "endpoint_url": aws_env.endpoint_url,
                                                "store_uri": store, "kms_key_id": alias}, session=driver)
    gate = IAMGate(aws_env.region)
    gate.kms_via_ssm = gate.kms_resources = True
    gate.watch_user(user)
    gate.watch_role(roles.role_name(run))
    aws_faults.iam_gate = gate
    asked = len(aws_faults.calls("DescribeKey"))
    try:
        resolved = compute.policy_kms_key()
        assert compute.policy_kms_key() == resolved == key["Arn"]
        assert len(aws_faults.calls("DescribeKey")) == asked + 1, "asked once"
        policy = roles.node_policy(run, aws_env.region, ACCOUNT, [f"{store}/{run}"], scope, resolved)
        roles.create(iam, run, policy, {rq.RUN_ID_TAG: run, rq.STORE_TAG: store}, scope, boundary)
        # the job key as the driver writes it: a SecureString under the store's key, named by its alias
        ssm.put_parameter(Name=ssm_key_parameter(run, scope), Value=uuid.uuid4().hex, Type="SecureString",
                          KeyId=alias)
        creds = aws_env.client("sts").assume_role(RoleArn=iam.get_role(RoleName=roles.role_name(run))["Role"]["Arn"],
                                                  RoleSessionName="node")["Credentials"]
        node = _session_of(creds, aws_env.region).client("ssm", endpoint_url=aws_env.endpoint_url)
        own = outcome_of(lambda: node.get_parameter(Name=ssm_key_parameter(run, scope), WithDecryption=True))
    finally:
        aws_faults.iam_gate = None
        for cleanup in (lambda: roles.delete(iam, run), lambda: ssm.delete_parameter(Name=ssm_key_parameter(run, scope)),
                        lambda: iam.delete_user_policy(UserName=user, PolicyName="driver")):
            outcome_of(cleanup)
    assert own == "allowed", gate.denied
    assert (f"role/{roles.role_name(run)}", "kms:Decrypt") in gate.allowed, "decrypted under the key, and allowed"
    assert (f"user/{user}", "kms:DescribeKey") in gate.allowed
    assert gate.denied == []


def test_an_alias_that_names_no_key_is_refused_naming_it(aws_env: MotoAWS, aws_faults: Any) -> None:
    missing = f"alias/sgpu-none-{uuid.uuid4().hex[:8]}"
    compute = EC2InstanceCompute.from_settings({"region": aws_env.region, "endpoint_url": aws_env.endpoint_url,
                                                "store_uri": "s3://sgpu-kms-none/jobs", "kms_key_id": missing},
                                               session=aws_env.session())
    with pytest.raises(SGPUConfigError) as raised:
        compute.policy_kms_key()
    assert raised.value.field == "kms_key_id" and raised.value.value == missing
    assert "NotFoundException" in str(raised.value) and "exists" in str(raised.value)
    # a key id or key ARN needs no call
    arn = f"arn:aws:kms:{aws_env.region}:{ACCOUNT}:key/1234abcd-12ab-34cd-56ef-1234567890ab"
    assert roles.resolve_kms_key(None, arn) == arn and roles.resolve_kms_key(None, "1234abcd") == "1234abcd"


def test_setup_aws_renders_the_key_an_alias_names_and_refuses_an_unknown_alias_before_writing(
        aws_env: MotoAWS, aws_faults: Any) -> None:
    from prefect_sgpu.compute.ec2 import setup

    tag = uuid.uuid4().hex[:8]
    kms = aws_env.client("kms")
    key = kms.create_key(Description=f"sgpu store {tag}")["KeyMetadata"]
    alias = f"alias/sgpu-setup-{tag}"
    kms.create_alias(AliasName=alias, TargetKeyId=key["KeyId"])
    store = f"s3://sgpu-kms-setup-{tag}/jobs"

    before = len(aws_faults.requests)
    dry = setup.AWSSetup(store, aws_env.region, session=aws_env.session(), endpoint_url=aws_env.endpoint_url,
                         kms_key_id=alias, dry_run=True).run()
    assert any(c.startswith("kms.describe_key ") and alias in c for c in dry.calls)
    assert aws_faults.requests[before:] == [], "a dry run asks nothing"

    missing = setup.AWSSetup(store, aws_env.region, session=aws_env.session(), endpoint_url=aws_env.endpoint_url,
                             kms_key_id=f"alias/sgpu-none-{tag}", name_suffix=f"-n{tag}")
    with pytest.raises(SGPUConfigError, match="NotFoundException"):
        missing.run()
    assert [r.action for r in aws_faults.requests[before:] if r.method in ("PUT", "POST")
            and r.action not in ("GetCallerIdentity", "DescribeKey")] == [], "nothing written"

    made = setup.AWSSetup(store, aws_env.region, session=aws_env.session(), endpoint_url=aws_env.endpoint_url,
                          kms_key_id=alias, name_suffix=f"-{tag}")
    outcome = made.run()
    iam = aws_env.client("iam")
    try:
        for arn in (outcome.block["node_permissions_boundary"], *outcome.attach[:1]):
            version = iam.get_policy(PolicyArn=arn)["Policy"]["DefaultVersionId"]
            document = iam.get_policy_version(PolicyArn=arn, VersionId=version)["PolicyVersion"]["Document"]
            document = json.loads(document) if isinstance(document, str) else document
            (statement,) = [s for s in document["Statement"] if s["Sid"] == "StoreKey"]
            assert statement["Resource"] == key["Arn"], statement
    finally:
        for arn in (*outcome.attach, outcome.block["node_permissions_boundary"]):
            outcome_of(lambda: iam.delete_policy(PolicyArn=arn))
        s3 = aws_env.client("s3")
        outcome_of(lambda: s3.delete_bucket(Bucket=f"sgpu-kms-setup-{tag}"))
