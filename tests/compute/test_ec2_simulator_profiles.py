"""The keys a simulated EC2 node signs with: those of its instance profile's role, from its IMDS, for every
instance of a launch, and no keys at all when the profile gives none; never the admin keys of the test.

moto server through the fault proxy (real boto3 clients), the simulator ticked by the test: each node runs
a real user-data that makes one signed request with the default credential chain, and the proxy's record
says which access key signed it.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from support.aws_fixtures import FAKE_CREDENTIALS, MotoAWS, Network
from support.ec2_simulator import EC2Simulator

ADMIN_KEY = FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"]
KEY_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


def _profile(aws: MotoAWS, role: bool = True) -> str:
    iam = aws.client("iam")
    name = f"sim-profile-{uuid.uuid4().hex[:8]}"
    iam.create_instance_profile(InstanceProfileName=name)
    if role:
        trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                          "Principal": {"Service": "ec2.amazonaws.com"}}]}
        iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust))
        iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)
    return name


def _user_data(endpoint: str, marker: str) -> str:
    """One S3 listing signed by whatever credentials the default chain finds (environment, then IMDS)."""
    code = (f"import boto3; boto3.client('s3', endpoint_url='{endpoint}', region_name='us-east-1')"
            f".list_objects_v2(Bucket='{marker}', Prefix='$(cat /proc/sys/kernel/random/uuid)')")
    return f'#!/bin/bash\npython -c "{code}" || true\nexec sleep 600\n'


def _simulator(aws: MotoAWS, proxy: Any, workdir: Path) -> EC2Simulator:
    node_env = {k: v for k, v in aws.env.items() if k not in ("AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN",
                                                               "AWS_SECURITY_TOKEN")}
    simulator = EC2Simulator(aws.client("ec2"), node_env, workdir)  # not started: the test ticks it
    simulator.control_plane_url = f"http://{proxy.upstream_host}:{proxy.upstream_port}"
    return simulator


def _signed_by(proxy: Any, marker: str, count: int, timeout: float = 120.0) -> list[str]:
    """The access keys of the nodes' listings of bucket ``marker`` (one per node), once ``count`` came."""
    deadline = time.monotonic() + timeout
    while True:
        keys = [r.access_key for r in list(proxy.requests) if r.service == "rest" and f"/{marker}" in r.path]
        if len(keys) >= count or time.monotonic() > deadline:
            return keys
        time.sleep(0.3)


def test_two_nodes_booted_in_one_tick_both_sign_with_their_profiles_role_keys(
        aws_env: MotoAWS, aws_network: Network, aws_faults: Any, tmp_path: Path) -> None:
    """A two-instance launch with a profile: both instances have it (moto gave it to the first only; the
    proxy gives it to each), and both nodes, booted in one tick, sign with role keys of their own from IMDS,
    with no key in their environment."""
    ec2 = aws_env.client("ec2")
    profile, marker = _profile(aws_env), f"marker-{uuid.uuid4().hex[:8]}"
    simulator = _simulator(aws_env, aws_faults, tmp_path / "nodes")
    ids: list[str] = []
    try:
        launched = ec2.run_instances(ImageId=aws_env.image_id(), InstanceType="t3.micro", MinCount=2, MaxCount=2,
                                     SubnetId=aws_network.subnet_ids[0], IamInstanceProfile={"Name": profile},
                                     UserData=_user_data(aws_env.endpoint_url, marker))["Instances"]
        ids = [i["InstanceId"] for i in launched]
        assert [i.get("IamInstanceProfile", {}).get("Arn", "").split("/")[-1] for i in launched] == [profile] * 2
        described = [i for r in ec2.describe_instances(InstanceIds=ids)["Reservations"] for i in r["Instances"]]
        assert {i["InstanceId"]: i.get("IamInstanceProfile", {}).get("Arn", "").split("/")[-1]
                for i in described} == dict.fromkeys(ids, profile)
        simulator.tick()
        assert sorted(simulator.nodes) == sorted(ids), "both boot in the one tick"
        served = {}
        for iid, node in simulator.nodes.items():
            assert not set(KEY_VARIABLES) & set(node.info["env"]), f"{iid} has keys in its environment"
            served[iid] = json.loads(node.imds.metadata[f"iam/security-credentials/{profile}"])["AccessKeyId"]
        keys = _signed_by(aws_faults, marker, 2)
        assert len(keys) == 2, (keys, [simulator.console(i)[-2000:] for i in ids])
        assert ADMIN_KEY not in keys, f"a node signed with the admin keys: {keys}"
        assert sorted(keys) == sorted(served.values()) and len(set(keys)) == 2, (keys, served)
        assert not simulator.profile_errors and not simulator.errors
    finally:
        if ids:
            ec2.terminate_instances(InstanceIds=ids)
        simulator.close()


def _launch_one(aws: MotoAWS, network: Network, profile: str) -> str:
    """One instance with ``profile`` whose user-data only waits: what its IMDS and environment get is the test."""
    return aws.client("ec2").run_instances(
        ImageId=aws.image_id(), InstanceType="t3.micro", MinCount=1, MaxCount=1, SubnetId=network.subnet_ids[0],
        IamInstanceProfile={"Name": profile}, UserData="#!/bin/bash\nexec sleep 600\n")["Instances"][0]["InstanceId"]


def _imds_credentials(node: Any) -> int:
    token = urllib.request.urlopen(urllib.request.Request(
        f"{node.imds.url}latest/api/token", method="PUT",
        headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}), timeout=5).read().decode()
    try:
        urllib.request.urlopen(urllib.request.Request(
            f"{node.imds.url}latest/meta-data/iam/security-credentials/",
            headers={"X-aws-ec2-metadata-token": token}), timeout=5).close()
    except urllib.error.HTTPError as err:
        return err.code
    return 200


def test_a_profile_without_a_role_boots_the_node_with_no_keys_at_all_and_says_so(
        aws_env: MotoAWS, aws_network: Network, aws_faults: Any, tmp_path: Path) -> None:
    """As on EC2, an instance whose profile holds no role gets no credentials: its IMDS answers 404, its
    environment has no keys (not the admin keys), and the simulator's log and the node's console say why."""
    ec2 = aws_env.client("ec2")
    profile = _profile(aws_env, role=False)
    simulator = _simulator(aws_env, aws_faults, tmp_path / "nodes")
    ids: list[str] = []
    try:
        ids = [_launch_one(aws_env, aws_network, profile)]
        simulator.tick()
        (node,) = simulator.nodes.values()
        assert not set(KEY_VARIABLES) & set(node.info["env"]), "keys in the environment"
        assert _imds_credentials(node) == 404
        assert f"instance profile {profile}" in simulator.profile_errors[ids[0]], simulator.profile_errors
        assert "no role" in simulator.profile_errors[ids[0]]
        assert "ERROR" in simulator.console(ids[0]) and profile in simulator.console(ids[0])
    finally:
        if ids:
            ec2.terminate_instances(InstanceIds=ids)
        simulator.close()


def test_a_profile_iam_shows_late_is_waited_for_and_one_never_shown_leaves_the_node_without_keys(
        aws_env: MotoAWS, aws_network: Network, aws_faults: Any, tmp_path: Path, virtual_clock: Any) -> None:
    """The simulator's read of an instance's profile is retried while IAM answers NoSuchEntity (eventual
    consistency), on the virtual clock; a profile IAM never shows within ``profile_wait_s`` gives no keys."""
    ec2 = aws_env.client("ec2")
    profile = _profile(aws_env)
    simulator = _simulator(aws_env, aws_faults, tmp_path / "nodes")
    simulator.control_plane_url = None  # through the proxy, whose rule stands for IAM's lateness here
    ids: list[str] = []
    try:
        aws_faults.fail("GetInstanceProfile", "NoSuchEntity", status=404, times=3)
        ids = [_launch_one(aws_env, aws_network, profile)]
        simulator.tick()
        (node,) = simulator.nodes.values()
        assert f"iam/security-credentials/{profile}" in node.imds.metadata, simulator.profile_errors
        assert virtual_clock.waited_s > 0 and not simulator.profile_errors

        aws_faults.fail("GetInstanceProfile", "NoSuchEntity", status=404)
        later = _launch_one(aws_env, aws_network, profile)
        ids.append(later)
        waited = virtual_clock.waited_s
        simulator.tick()
        assert "NoSuchEntity" in simulator.profile_errors[later], simulator.profile_errors
        assert _imds_credentials(simulator.nodes[later]) == 404
        assert simulator.profile_wait_s - 6 <= virtual_clock.waited_s - waited <= simulator.profile_wait_s
    finally:
        if ids:
            ec2.terminate_instances(InstanceIds=ids)
        simulator.close()
