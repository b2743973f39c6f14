"""Two stores in one AWS account: the shipped policies, rendered for each store, keep them apart.

A driver of store X (an IAM user holding exactly X's driver policy) and a job role of X (created
under X's permissions boundary with a policy that asks for everything) are each refused
everything of store Y: its job key and secrets in SSM, its job roles (edit, delete, pass to an
instance), its instances and its objects; the same calls on X's own are allowed. Every call is
judged per resource by ``support.iam_gate`` in front of moto, as AWS judges it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import boto3
import pytest

from prefect_sgpu.compute.ec2 import request as rq
from prefect_sgpu.compute.ec2 import roles
from prefect_sgpu.protocol.jobfolder import ssm_key_parameter, ssm_secrets_parameter
from prefect_sgpu.store import store_scope
from support.aws_fixtures import MotoAWS
from support.iam_gate import ACCOUNT, IAMGate, outcome_of

REFUSED = {"AccessDenied", "AccessDeniedException", "UnauthorizedOperation"}


class _Store:
    """One store's AWS side, made by the account's admin: its boundary, a job key and secrets, a job
    role under its boundary, an instance tagged as its node, an object in its folder."""

    def __init__(self, aws: MotoAWS, bucket: str, prefix: str, tag: str) -> None:
        self.uri = f"s3://{bucket}/{prefix}"
        self.scope = store_scope(self.uri)
        self.bucket, self.prefix = bucket, prefix
        self.run = f"{prefix}-run-{tag}"
        iam, ssm = aws.client("iam"), aws.client("ssm")
        self.boundary = iam.create_policy(PolicyName=f"sgpu-boundary-{prefix}-{tag}", PolicyDocument=json.dumps(
            roles.node_boundary(self.uri, aws.region, ACCOUNT)))["Policy"]["Arn"]
        for name in (ssm_key_parameter(self.run, self.scope), ssm_secrets_parameter(self.run, self.scope)):
            ssm.put_parameter(Name=name, Value=uuid.uuid4().hex, Type="SecureString")
        # a role of this store that asks for everything: only its boundary holds it
        everything = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        self.role = roles.create(iam, self.run, everything, {rq.RUN_ID_TAG: self.run, rq.STORE_TAG: self.uri},
                                 self.scope, self.boundary)
        image = aws.image_id()
        self.instance = aws.client("ec2").run_instances(
            ImageId=image, MinCount=1, MaxCount=1, InstanceType="t3.micro",
            TagSpecifications=[{"ResourceType": "instance", "Tags": [
                {"Key": rq.STORE_TAG, "Value": self.uri}, {"Key": rq.RUN_ID_TAG, "Value": self.run}]}],
        )["Instances"][0]["InstanceId"]
        self.group = aws.client("ec2").create_security_group(
            GroupName=f"sgpu-{self.run}", Description="a run's group",
            TagSpecifications=[{"ResourceType": "security-group", "Tags": [{"Key": rq.STORE_TAG, "Value": self.uri}]}],
        )["GroupId"]
        aws.client("s3").put_object(Bucket=bucket, Key=f"{prefix}/{self.run}/payload.bin", Body=b"payload")

    def close(self, aws: MotoAWS) -> None:
        roles.delete(aws.client("iam"), self.run)
        aws.client("ec2").terminate_instances(InstanceIds=[self.instance])
        outcome_of(lambda: aws.client("ec2").delete_security_group(GroupId=self.group))
        ssm = aws.client("ssm")
        for name in (ssm_key_parameter(self.run, self.scope), ssm_secrets_parameter(self.run, self.scope)):
            outcome_of(lambda n=name: ssm.delete_parameter(Name=n))


def _reach(session: Any, target: _Store, image: str, launched: list[str], own_store: str | None = None) -> dict[str, str]:
    """Every call an identity could make on ``target``'s things: its answer code, by what was tried
    (instances it managed to launch are added to ``launched``). ``own_store``: the caller's store, whose
    tag its launch of ``target``'s role carries (so that only passing the role is in question)."""
    ssm, iam, ec2, s3 = (session.client(s) for s in ("ssm", "iam", "ec2", "s3"))
    key, secrets = ssm_key_parameter(target.run, target.scope), ssm_secrets_parameter(target.run, target.scope)
    name = roles.role_name(target.run)
    theirs = [{"ResourceType": kind, "Tags": [{"Key": rq.STORE_TAG, "Value": target.uri}]}
              for kind in ("instance", "volume")]
    mine = [{"ResourceType": kind, "Tags": [{"Key": rq.STORE_TAG, "Value": own_store or target.uri}]}
            for kind in ("instance", "volume")]
    wide_open = [{"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}]
    return {
        "read the job key": outcome_of(lambda: ssm.get_parameter(Name=key, WithDecryption=True)),
        "overwrite the job key": outcome_of(lambda: ssm.put_parameter(Name=key, Value="forged", Type="SecureString",
                                                                 Overwrite=True)),
        "delete the secrets": outcome_of(lambda: ssm.delete_parameter(Name=secrets)),
        "edit the job role's policy": outcome_of(lambda: iam.put_role_policy(
            RoleName=name, PolicyName=roles.ROLE_POLICY_NAME, PolicyDocument=json.dumps(
                {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))),
        "pass the job role to an instance": outcome_of(lambda: launched.extend(i["InstanceId"] for i in ec2.run_instances(
            ImageId=image, MinCount=1, MaxCount=1, InstanceType="t3.micro", TagSpecifications=mine,
            IamInstanceProfile={"Arn": target.role.profile_arn})["Instances"])),
        "launch a node of its store": outcome_of(lambda: launched.extend(i["InstanceId"] for i in ec2.run_instances(
            ImageId=image, MinCount=1, MaxCount=1, InstanceType="t3.micro", TagSpecifications=theirs)["Instances"])),
        "open its security group": outcome_of(lambda: ec2.authorize_security_group_ingress(
            GroupId=target.group, IpPermissions=wide_open)),
        "make a security group of its store": outcome_of(lambda: ec2.delete_security_group(GroupId=ec2.create_security_group(
            GroupName=f"made-{uuid.uuid4().hex[:8]}", Description="x", TagSpecifications=[
                {"ResourceType": "security-group", "Tags": [{"Key": rq.STORE_TAG, "Value": target.uri}]}])["GroupId"])),
        "terminate a node": outcome_of(lambda: ec2.terminate_instances(InstanceIds=[target.instance])),
        "forge a document": outcome_of(lambda: s3.put_object(Bucket=target.bucket,
                                                        Key=f"{target.prefix}/{target.run}/payload.bin", Body=b"x")),
        "delete its security group": outcome_of(lambda: ec2.delete_security_group(GroupId=target.group)),
        # last: IAM refuses deleting a role that still has a policy and a profile, after the gate let it through
        "delete the job role": outcome_of(lambda: iam.delete_role(RoleName=name)),
    }


def _as_driver(aws: MotoAWS, store: _Store, tag: str) -> Any:
    """An IAM user holding exactly ``store``'s driver policy; its boto3 session."""
    iam = aws.client("iam")
    user = f"sgpu-driver-{store.prefix}-{tag}"
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="prefect-sgpu-driver", PolicyDocument=json.dumps(
        roles.driver_policy(store.uri, aws.region, ACCOUNT, store.boundary)))
    keys = iam.create_access_key(UserName=user)["AccessKey"]
    return user, boto3.Session(aws_access_key_id=keys["AccessKeyId"], aws_secret_access_key=keys["SecretAccessKey"],
                               region_name=aws.region)


def _as_role(aws: MotoAWS, store: _Store) -> Any:
    """The job role of ``store`` as its nodes hold it (an assumed-role session)."""
    creds = aws.client("sts").assume_role(RoleArn=aws.client("iam").get_role(
        RoleName=roles.role_name(store.run))["Role"]["Arn"], RoleSessionName="node")["Credentials"]
    return boto3.Session(aws_access_key_id=creds["AccessKeyId"], aws_secret_access_key=creds["SecretAccessKey"],
                         aws_session_token=creds["SessionToken"], region_name=aws.region)


def test_a_driver_and_a_job_role_of_one_store_are_refused_everything_of_another_store(
        aws_env: MotoAWS, aws_faults: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    bucket = f"sgpu-iam-{tag}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    x, y = _Store(aws_env, bucket, "team-x", tag), _Store(aws_env, bucket, "team-y", tag)
    image = aws_env.image_id()
    gate = IAMGate(aws_env.region)
    user, driver = _as_driver(aws_env, x, tag)
    user_y, driver_y = _as_driver(aws_env, y, tag)
    for name in (user, user_y):
        gate.watch_user(name)
    gate.watch_role(roles.role_name(x.run))
    node = _as_role(aws_env, x)
    aws_faults.iam_gate = gate
    launched: list[str] = []
    try:
        theirs_by_driver = _reach(driver, y, image, launched, own_store=x.uri)
        theirs_by_node = _reach(node, y, image, launched)
        ours_by_y = _reach(driver_y, x, image, launched, own_store=y.uri)  # and the other way round
        mine_refused = len(gate.denied)
        own_by_driver = _reach(driver, x, image, launched)
    finally:
        aws_faults.iam_gate = None
    try:
        assert all(code in REFUSED for code in theirs_by_driver.values()), theirs_by_driver
        assert all(code in REFUSED for code in theirs_by_node.values()), theirs_by_node
        assert all(code in REFUSED for code in ours_by_y.values()), ours_by_y
        # the same calls on its own store's things: the driver policy allows them (what jobs need)
        assert gate.denied[mine_refused:] == [], gate.denied[mine_refused:]
        assert {what: code for what, code in own_by_driver.items() if code != "allowed"} == {
            "delete the job role": "DeleteConflict"}, own_by_driver
        refused = {(d.identity, d.action) for d in gate.denied}
        assert {(f"user/{user}", a) for a in ("iam:PassRole", "iam:PutRolePolicy", "iam:DeleteRole",
                                              "ssm:GetParameter", "ec2:TerminateInstances", "ec2:RunInstances",
                                              "ec2:AuthorizeSecurityGroupIngress", "ec2:CreateSecurityGroup",
                                              "ec2:DeleteSecurityGroup")} <= refused, refused
    finally:
        if launched:
            aws_env.client("ec2").terminate_instances(InstanceIds=launched)
        for store in (x, y):
            store.close(aws_env)


def test_a_driver_tags_only_what_it_creates_and_launches_only_what_it_tags_as_its_store(
        aws_env: MotoAWS, aws_faults: Any) -> None:
    """Tags decide which store a node or group belongs to (sweeps, terminations, group edits): a
    driver may set them only in the call that creates the resource, and may launch only instances
    and volumes tagged with its own store."""
    tag = uuid.uuid4().hex[:8]
    bucket = f"sgpu-iam-{tag}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    x = _Store(aws_env, bucket, "team-x", tag)
    gate = IAMGate(aws_env.region)
    user, driver = _as_driver(aws_env, x, tag)
    gate.watch_user(user)
    ec2 = driver.client("ec2")
    ours = [{"ResourceType": kind, "Tags": [{"Key": rq.STORE_TAG, "Value": x.uri}]} for kind in ("instance", "volume")]
    launched: list[str] = []
    aws_faults.iam_gate = gate
    try:
        codes = {
            "retag its own node": outcome_of(lambda: ec2.create_tags(Resources=[x.instance],
                                                                Tags=[{"Key": rq.STORE_TAG, "Value": "s3://other/x"}])),
            "launch untagged": outcome_of(lambda: launched.extend(i["InstanceId"] for i in ec2.run_instances(
                ImageId=aws_env.image_id(), MinCount=1, MaxCount=1, InstanceType="t3.micro")["Instances"])),
            "launch tagged as its store": outcome_of(lambda: launched.extend(i["InstanceId"] for i in ec2.run_instances(
                ImageId=aws_env.image_id(), MinCount=1, MaxCount=1, InstanceType="t3.micro",
                TagSpecifications=ours)["Instances"])),
        }
    finally:
        aws_faults.iam_gate = None
        if launched:
            aws_env.client("ec2").terminate_instances(InstanceIds=launched)
        x.close(aws_env)
    assert codes == {"retag its own node": "UnauthorizedOperation", "launch untagged": "UnauthorizedOperation",
                     "launch tagged as its store": "allowed"}, codes
    assert [(d.action, d.resource.split(":")[-1]) for d in gate.denied] == [
        ("ec2:CreateTags", f"instance/{x.instance}"), ("ec2:RunInstances", "instance/*")], gate.denied


def test_the_driver_may_edit_a_role_of_its_store_only_while_the_role_has_the_boundary(
        aws_env: MotoAWS, aws_faults: Any) -> None:
    """A role on the store's path made without the boundary (by someone else) is no job role: the
    driver can neither widen nor delete its policy (``iam:PermissionsBoundary`` on the edit)."""
    tag = uuid.uuid4().hex[:8]
    bucket = f"sgpu-iam-{tag}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    x = _Store(aws_env, bucket, "team-x", tag)
    iam = aws_env.client("iam")
    loose = f"sgpu-loose-{tag}"
    iam.create_role(RoleName=loose, Path=roles.role_path(x.scope), AssumeRolePolicyDocument=json.dumps(
        roles.NODE_TRUST_POLICY))
    user, driver = _as_driver(aws_env, x, tag)
    gate = IAMGate(aws_env.region)
    gate.watch_user(user)
    aws_faults.iam_gate = gate
    widen = json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]})
    try:
        loose_edit = outcome_of(lambda: driver.client("iam").put_role_policy(RoleName=loose, PolicyName="p",
                                                                        PolicyDocument=widen))
        job_edit = outcome_of(lambda: driver.client("iam").put_role_policy(
            RoleName=roles.role_name(x.run), PolicyName=roles.ROLE_POLICY_NAME, PolicyDocument=widen))
    finally:
        aws_faults.iam_gate = None
    try:
        assert loose_edit in REFUSED, loose_edit
        assert job_edit == "allowed", "a job role under the boundary is the driver's to edit (its boundary caps it)"
    finally:
        iam.delete_role(RoleName=loose)
        x.close(aws_env)


@pytest.mark.parametrize("kms", [None, "1234abcd-12ab-34cd-56ef-1234567890ab"])
def test_the_boundary_names_one_stores_paths_instances_and_key(kms: str | None) -> None:
    boundary = roles.node_boundary("s3://b/team-x", "eu-west-1", "210987654321", kms)
    text = json.dumps(boundary)
    assert "{{" not in text
    scope = store_scope("s3://b/team-x")
    assert f"parameter/prefect-sgpu/{scope}/*" in text and "parameter/prefect-sgpu/*" not in text
    terminate = next(s for s in boundary["Statement"] if s["Action"] == "ec2:TerminateInstances")
    assert terminate["Condition"] == {"StringEquals": {"ec2:ResourceTag/sgpu:store": "s3://b/team-x"}}
    keys = [s["Resource"] for s in boundary["Statement"] if s["Sid"] == "StoreKey"]
    assert keys == ([f"arn:aws:kms:eu-west-1:210987654321:key/{kms}"] if kms else []), "KMS on one key, or none"
    via_ssm = [s for s in boundary["Statement"] if s["Sid"] == "StoreParametersKey"]
    assert bool(via_ssm) == (kms is None), "without a store key: SSM's decryption of the store's parameters"
