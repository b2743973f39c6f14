"""Two things a first real EC2 run needs of the shipped policies, judged per resource by the IAM gate:

- a job role reads its key without a store KMS key: SSM decrypts a SecureString under the account's
  AWS-managed ``aws/ssm`` key on the caller's behalf, so the role (and its boundary) must allow
  ``kms:Decrypt`` through SSM for its own parameters, and no others;
- a driver whose block names a shared ``instance_profile`` may pass that profile's role to EC2, and
  only when its driver policy is rendered for that role.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import boto3

from prefect_sgpu.compute.ec2 import request as rq
from prefect_sgpu.compute.ec2 import roles
from prefect_sgpu.protocol.jobfolder import ssm_key_parameter
from prefect_sgpu.store import store_scope
from support.aws_fixtures import MotoAWS
from support.iam_gate import ACCOUNT, IAMGate, outcome_of


def _job_role(aws: MotoAWS, store: str, run: str, boundary: str) -> Any:
    """Run ``run``'s role as ``roles.create`` makes it (node policy, boundary), as its node holds it."""
    iam = aws.client("iam")
    policy = roles.node_policy(run, aws.region, ACCOUNT, [f"{store}/{run}"], store_scope(store))
    roles.create(iam, run, policy, {rq.RUN_ID_TAG: run, rq.STORE_TAG: store}, store_scope(store), boundary)
    creds = aws.client("sts").assume_role(RoleArn=iam.get_role(RoleName=roles.role_name(run))["Role"]["Arn"],
                                          RoleSessionName="node")["Credentials"]
    return boto3.Session(aws_access_key_id=creds["AccessKeyId"], aws_secret_access_key=creds["SecretAccessKey"],
                         aws_session_token=creds["SessionToken"], region_name=aws.region)


def test_without_a_store_key_a_job_role_decrypts_its_own_key_through_ssm_and_no_other(
        aws_env: MotoAWS, aws_faults: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    store = f"s3://sgpu-kms-{tag}/jobs"
    scope = store_scope(store)
    iam, ssm = aws_env.client("iam"), aws_env.client("ssm")
    boundary = iam.create_policy(PolicyName=f"sgpu-boundary-{tag}", PolicyDocument=json.dumps(
        roles.node_boundary(store, aws_env.region, ACCOUNT)))["Policy"]["Arn"]
    mine, theirs = f"run-a-{tag}", f"run-b-{tag}"
    for run in (mine, theirs):  # as the driver writes them: SecureStrings under the default aws/ssm key
        ssm.put_parameter(Name=ssm_key_parameter(run, scope), Value=uuid.uuid4().hex, Type="SecureString")
    node = _job_role(aws_env, store, mine, boundary).client("ssm")
    gate = IAMGate(aws_env.region)
    gate.kms_via_ssm = True
    gate.watch_role(roles.role_name(mine))
    aws_faults.iam_gate = gate
    try:
        own = outcome_of(lambda: node.get_parameter(Name=ssm_key_parameter(mine, scope), WithDecryption=True))
        other = outcome_of(lambda: node.get_parameter(Name=ssm_key_parameter(theirs, scope), WithDecryption=True))
    finally:
        aws_faults.iam_gate = None
        roles.delete(iam, mine)
        for run in (mine, theirs):
            ssm.delete_parameter(Name=ssm_key_parameter(run, scope))
        iam.delete_policy(PolicyArn=boundary)
    assert own == "allowed", gate.denied
    assert other == "AccessDeniedException"
    assert (f"role/{roles.role_name(mine)}", "kms:Decrypt") in gate.allowed, "the key was asked for, and allowed"
    assert [d.action for d in gate.denied] == ["ssm:GetParameter"], gate.denied


def test_the_ssm_key_statement_is_there_only_without_a_store_key() -> None:
    store = "s3://b/jobs"
    for document in (roles.node_policy("r", "eu-west-1", "210987654321", [f"{store}/r"], store_scope(store)),
                     roles.node_boundary(store, "eu-west-1", "210987654321"),
                     roles.job_access_policy("r", "eu-west-1", "210987654321", [f"{store}/r"], store_scope(store))):
        (statement,) = [s for s in document["Statement"] if s["Sid"].endswith("ParametersKey")]
        assert statement["Action"] == "kms:Decrypt"
        assert statement["Resource"] == "arn:aws:kms:eu-west-1:210987654321:key/*"
        assert statement["Condition"]["StringEquals"] == {"kms:ViaService": "ssm.eu-west-1.amazonaws.com"}
        context = statement["Condition"]["StringLike"]["kms:EncryptionContext:PARAMETER_ARN"]
        assert context.startswith(f"arn:aws:ssm:eu-west-1:210987654321:parameter/prefect-sgpu/{store_scope(store)}/")
    with_key = roles.node_policy("r", "eu-west-1", "210987654321", [f"{store}/r"], store_scope(store), kms_key_id="k1")
    assert not [s for s in with_key["Statement"] if s["Sid"].endswith("ParametersKey")], "the store key covers it"


def test_a_driver_passes_a_shared_profiles_role_only_when_its_policy_names_it(
        aws_env: MotoAWS, aws_faults: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    store = f"s3://sgpu-shared-{tag}/jobs"
    iam = aws_env.client("iam")
    role = iam.create_role(RoleName=f"shared-nodes-{tag}", AssumeRolePolicyDocument=json.dumps(
        roles.NODE_TRUST_POLICY))["Role"]["Arn"]
    iam.create_instance_profile(InstanceProfileName=f"shared-nodes-{tag}")
    iam.add_role_to_instance_profile(InstanceProfileName=f"shared-nodes-{tag}", RoleName=f"shared-nodes-{tag}")
    boundary = f"arn:aws:iam::{ACCOUNT}:policy/prefect-sgpu-node-boundary"
    gate = IAMGate(aws_env.region)
    launched: list[str] = []
    codes = {}
    for named in (None, role):
        user = f"sgpu-driver-{tag}-{'named' if named else 'plain'}"
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName="driver", PolicyDocument=json.dumps(
            roles.driver_policy(store, aws_env.region, ACCOUNT, boundary, shared_profile_role_arn=named)))
        keys = iam.create_access_key(UserName=user)["AccessKey"]
        ec2 = boto3.Session(aws_access_key_id=keys["AccessKeyId"], aws_secret_access_key=keys["SecretAccessKey"],
                            region_name=aws_env.region).client("ec2", endpoint_url=aws_env.endpoint_url)
        gate.watch_user(user)
        aws_faults.iam_gate = gate
        try:
            codes[bool(named)] = outcome_of(lambda: launched.extend(i["InstanceId"] for i in ec2.run_instances(
                ImageId=aws_env.image_id(), MinCount=1, MaxCount=1, InstanceType="t3.micro",
                IamInstanceProfile={"Name": f"shared-nodes-{tag}"}, TagSpecifications=[
                    {"ResourceType": kind, "Tags": [{"Key": rq.STORE_TAG, "Value": store}]}
                    for kind in ("instance", "volume")])["Instances"]))
        finally:
            aws_faults.iam_gate = None
    if launched:
        aws_env.client("ec2").terminate_instances(InstanceIds=launched)
    iam.remove_role_from_instance_profile(InstanceProfileName=f"shared-nodes-{tag}", RoleName=f"shared-nodes-{tag}")
    iam.delete_instance_profile(InstanceProfileName=f"shared-nodes-{tag}")
    assert codes == {False: "UnauthorizedOperation", True: "allowed"}, codes
    assert [(d.action, d.resource) for d in gate.denied] == [("iam:PassRole", role)], gate.denied
    policy = roles.driver_policy(store, aws_env.region, ACCOUNT, boundary, shared_profile_role_arn=role)
    (passing,) = [s for s in policy["Statement"] if s["Sid"] == "PassTheSharedProfileRole"]
    assert passing["Condition"] == {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}}
