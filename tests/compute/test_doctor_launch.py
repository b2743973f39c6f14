"""The doctor's launch checks (``compute/ec2/doctor_checks.py``) against moto behind the fault proxy
and the IAM gate, through real boto3 clients: each on an account set up to show the trap, and on a
correct one."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from prefect_sgpu.compute.ec2 import doctor, roles
from prefect_sgpu.compute.ec2.settings import EC2Settings
from support.aws_fixtures import REGION, MotoAWS, iam_user_session, Network
from support.iam_gate import ACCOUNT, IAMGate

BOUNDARY = f"arn:aws:iam::{ACCOUNT}:policy/prefect-sgpu-node-boundary"


def _driver(aws: MotoAWS, *policies: dict[str, Any]) -> tuple[str, Any]:
    return iam_user_session(aws, *policies, prefix="sgpu-doctor")


def _doctor(aws: MotoAWS, session: Any | None = None, **fields: Any) -> doctor.Doctor:
    made = doctor.Doctor(EC2Settings(region=REGION, endpoint_url=aws.endpoint_url, **fields),
                         session=session or aws.session())
    assert made.credentials().status == "ok"
    return made


def test_a_security_group_without_its_all_traffic_rule_to_itself_fails(
        aws_env: MotoAWS, aws_faults: Any, aws_network: Network) -> None:
    ec2 = aws_env.client("ec2")
    group = ec2.create_security_group(GroupName=f"sgpu-{uuid.uuid4().hex[:8]}", Description="nodes",
                                      VpcId=aws_network.vpc_id)["GroupId"]
    check = _doctor(aws_env, security_group_id=group).security_group()
    assert check.status == "fail" and "(inbound and outbound)" in check.detail, check
    assert f"authorize-security-group-ingress --group-id {group}" in check.fix and "egress" in check.fix
    to_itself = [{"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group}]}]
    ec2.authorize_security_group_ingress(GroupId=group, IpPermissions=to_itself)
    check = _doctor(aws_env, security_group_id=group).security_group()
    assert check.status == "fail" and "(outbound)" in check.detail, check
    ec2.authorize_security_group_egress(GroupId=group, IpPermissions=to_itself)
    assert _doctor(aws_env, security_group_id=group).security_group().status == "ok"
    ec2.delete_security_group(GroupId=group)


def test_a_default_ebs_key_the_driver_cannot_use_fails(aws_env: MotoAWS, aws_faults: Any) -> None:
    store = f"s3://sgpu-ebs-{uuid.uuid4().hex[:8]}/jobs"
    ec2, kms = aws_env.client("ec2"), aws_env.client("kms")
    key = kms.create_key(Description="a team's EBS key")["KeyMetadata"]["Arn"]
    driver = roles.driver_policy(store, REGION, ACCOUNT, BOUNDARY)
    doctor_reads = roles.doctor_policy(store, REGION, ACCOUNT)
    ec2.enable_ebs_encryption_by_default()
    ec2.modify_ebs_default_kms_key_id(KmsKeyId=key)
    try:
        _, session = _driver(aws_env, driver, doctor_reads)
        check = _doctor(aws_env, session, store_uri=store).ebs_key()
        assert check.status == "fail", check
        assert f"default EBS encryption on, key {key}" in check.detail
        assert "kms:CreateGrant (implicitDeny)" in check.detail
        assert "kms:GenerateDataKeyWithoutPlaintext" in check.fix and "reset-ebs-default-kms-key-id" in check.fix
        use = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": [
            "kms:CreateGrant", "kms:GenerateDataKeyWithoutPlaintext", "kms:Decrypt", "kms:DescribeKey"],
            "Resource": key}]}
        _, session = _driver(aws_env, driver, doctor_reads, use)
        check = _doctor(aws_env, session, store_uri=store).ebs_key()
        assert check.status == "ok", check
    finally:
        ec2.reset_ebs_default_kms_key_id()
        ec2.disable_ebs_encryption_by_default()
    check = _doctor(aws_env, store_uri=store).ebs_key()
    assert check.status == "ok" and "alias/aws/ebs" in check.detail, check


def test_subnets_with_fewer_free_addresses_than_the_launch_takes(
        aws_env: MotoAWS, aws_faults: Any, aws_network: Network) -> None:
    ec2 = aws_env.client("ec2")
    cidr = ec2.describe_vpcs(VpcIds=[aws_network.vpc_id])["Vpcs"][0]["CidrBlock"]
    small = ec2.create_subnet(VpcId=aws_network.vpc_id, CidrBlock=cidr.replace("0.0/16", "9.0/26"),
                              AvailabilityZone=aws_network.availability_zones[0])["Subnet"]["SubnetId"]
    p5 = doctor.Wanted.of("H100", 16, None)  # 2 x p5.48xlarge, 32 EFA interfaces each
    check = _doctor(aws_env, subnet_ids=[small]).subnet_addresses(p5.instance_type, p5.nodes)
    assert check.status == "fail", check
    assert "2 x p5.48xlarge take 64 address(es) (32 a node)" in check.detail and f"{small}: 59 free" in check.detail
    check = _doctor(aws_env, subnet_ids=[small, aws_network.subnet_ids[0]]).subnet_addresses(p5.instance_type, p5.nodes)
    assert check.status == "warn" and "skips " + small in check.detail, check
    check = _doctor(aws_env, subnet_ids=[aws_network.subnet_ids[0]]).subnet_addresses(p5.instance_type, p5.nodes)
    assert check.status == "ok", check
    ec2.delete_subnet(SubnetId=small)


def test_a_shared_profile_whose_role_the_driver_may_not_pass_fails(aws_env: MotoAWS, aws_faults: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    store, name = f"s3://sgpu-pass-{tag}/jobs", f"shared-{tag}"
    iam = aws_env.client("iam")
    role = iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(roles.NODE_TRUST_POLICY))["Role"]["Arn"]
    iam.create_instance_profile(InstanceProfileName=name)
    iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)
    doctor_reads = roles.doctor_policy(store, REGION, ACCOUNT)
    try:
        _, session = _driver(aws_env, roles.driver_policy(store, REGION, ACCOUNT, BOUNDARY), doctor_reads)
        check = _doctor(aws_env, session, store_uri=store, instance_profile=name).shared_profile()
        assert check.status == "fail" and f"may not pass {role}" in check.detail, check
        assert f"--instance-profile {name}" in check.fix
        _, session = _driver(aws_env, roles.driver_policy(store, REGION, ACCOUNT, BOUNDARY,
                                                          shared_profile_role_arn=role), doctor_reads)
        assert _doctor(aws_env, session, store_uri=store, instance_profile=name).shared_profile().status == "ok"
    finally:
        iam.remove_role_from_instance_profile(InstanceProfileName=name, RoleName=name)
        iam.delete_instance_profile(InstanceProfileName=name)
        iam.delete_role(RoleName=name)


def test_a_boundary_without_ssm_decryption_fails_job_roles_without_a_store_key(
        aws_env: MotoAWS, aws_faults: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    store = f"s3://sgpu-key-{tag}/jobs"
    iam = aws_env.client("iam")
    current = roles.node_boundary(store, REGION, ACCOUNT)
    older = {**current, "Statement": [s for s in current["Statement"] if s["Sid"] != "StoreParametersKey"]}
    found = {}
    for label, document in (("older", older), ("current", current)):
        arn = iam.create_policy(PolicyName=f"sgpu-boundary-{label}-{tag}",
                                PolicyDocument=json.dumps(document))["Policy"]["Arn"]
        found[label] = _doctor(aws_env, store_uri=store, job_roles=True, node_permissions_boundary=arn).job_role_key()
        iam.delete_policy(PolicyArn=arn)
    assert found["older"].status == "fail" and "may not decrypt its key through SSM" in found["older"].detail
    assert "node-boundary.json" in found["older"].fix
    assert found["current"].status == "ok", found["current"]
    with_key = _doctor(aws_env, store_uri=store, job_roles=True, node_permissions_boundary=BOUNDARY, kms_key_id="k1")
    assert with_key.job_role_key().status == "skip"


@pytest.mark.parametrize("market", ["on-demand", "spot"])
def test_the_first_launch_attempt_is_sent_as_a_dry_run_and_a_refusal_is_decoded(
        market: str, aws_env: MotoAWS, aws_faults: Any, aws_network: Network) -> None:
    tag = uuid.uuid4().hex[:8]
    store, other = f"s3://sgpu-dry-{tag}/jobs", f"s3://sgpu-dry-{tag}/other"
    fields = {"store_uri": store, "ami_id": aws_env.image_id(), "subnet_ids": aws_network.subnet_ids,
              "market": market}
    wanted = doctor.Wanted.of("A10", 1, None)
    gate = IAMGate(REGION)
    gate.encode_ec2_messages = True
    found = {}
    for label, driver_store in (("own", store), ("other", other)):
        user, session = _driver(aws_env, roles.driver_policy(driver_store, REGION, ACCOUNT, BOUNDARY),
                                roles.doctor_policy(driver_store, REGION, ACCOUNT))
        gate.watch_user(user)
        aws_faults.iam_gate = gate
        try:
            found[label] = _doctor(aws_env, session, **fields).dry_run_launch(wanted.instance_type, wanted.nodes)
        finally:
            aws_faults.iam_gate = None
    assert found["own"].status == "ok" and "EC2 would accept it" in found["own"].detail, found["own"]
    assert found["other"].status == "fail", found["other"]
    assert (f"refused ec2:RunInstances on arn:aws:ec2:{REGION}:{ACCOUNT}:instance/* (no policy allows it"
            in found["other"].detail), found["other"]
    assert f'"values": {{"items": [{{"value": "{store}"}}]}}' in found["other"].detail, "the tag it was refused with"
    assert aws_env.live_instances([{"Name": "tag:sgpu:store", "Values": [store]}]) == [], "nothing launched"
