"""Job roles (``job_roles=True``): the policies they are made of, and their lifecycle on moto.

The end-to-end check (two jobs at once, a rank of one reaching into the other, every call
judged per resource) is ``test_ec2_e2e.py::test_with_job_roles_a_rank_cannot_read_forge_or_stop_another_job``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefect_sgpu.compute.ec2 import request as rq
from prefect_sgpu.compute.ec2 import roles
from prefect_sgpu.compute.ec2.instances import EC2Provisioner
from prefect_sgpu.compute.ec2.settings import EC2Settings
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.store import LocalStore
from prefect_sgpu.compute.remote.sweep import Sweeper

DOCS = Path(__file__).resolve().parents[2] / "docs" / "iam"


def test_the_shipped_documents_are_the_ones_the_package_renders() -> None:
    for name in ("node-policy", "node-boundary", "driver-policy", "doctor-policy"):
        assert json.loads((DOCS / f"{name}.json").read_text()) == roles.policy_template(name)


def test_a_node_policy_names_only_its_run_and_its_locations() -> None:
    policy = roles.node_policy("train-0123456789", "eu-west-1", "210987654321",
                               ["s3://b/jobs/train-0123456789", "s3://b/jobs/checkpoints/flow/task"], "0123456789abcdef")
    text = json.dumps(policy)
    assert "{{" not in text, "no unfilled name"
    assert [s["Sid"] for s in policy["Statement"] if "kms:" in json.dumps(s["Action"])] == ["JobParametersKey"], \
        "without a store key: only SSM's decryption of the run's own parameters"
    sids = [s["Sid"] for s in policy["Statement"]]
    assert len(sids) == len(set(sids)), "statement ids are unique"
    resources = {r for s in policy["Statement"] for r in (s["Resource"] if isinstance(s["Resource"], list)
                                                         else [s["Resource"]])}
    assert resources == {
        "arn:aws:s3:::b/jobs/train-0123456789/*", "arn:aws:s3:::b/jobs/checkpoints/flow/task/*", "arn:aws:s3:::b",
        "arn:aws:ssm:eu-west-1:210987654321:parameter/prefect-sgpu/0123456789abcdef/train-0123456789/*",
        "arn:aws:ec2:eu-west-1:210987654321:instance/*", "arn:aws:kms:eu-west-1:210987654321:key/*",
    }
    terminate = next(s for s in policy["Statement"] if s["Action"] == "ec2:TerminateInstances")
    assert terminate["Condition"] == {"StringEquals": {"ec2:ResourceTag/sgpu:run-id": "train-0123456789"}}
    with_key = roles.node_policy("r", "us-east-1", "210987654321", ["s3://b/jobs/r"], "0123456789abcdef",
                                 kms_key_id="1234abcd")
    assert any(s["Resource"] == "arn:aws:kms:us-east-1:210987654321:key/1234abcd" for s in with_key["Statement"])


def test_settings_refuse_a_shared_profile_with_job_roles_and_a_malformed_boundary() -> None:
    with pytest.raises(SGPUConfigError) as info:
        EC2Settings(instance_profile="nodes", job_roles=True)
    assert info.value.field == "instance_profile"
    with pytest.raises(SGPUConfigError) as info:
        EC2Settings(job_roles=True, node_permissions_boundary="nodes-boundary")
    assert info.value.field == "node_permissions_boundary"
    EC2Settings(job_roles=True, subnet_ids=["subnet-0123456789abcdef0"]).require_launchable()


def test_create_is_idempotent_and_the_sweeper_deletes_only_its_stores_ended_runs(aws_env, tmp_path: Path) -> None:
    iam = aws_env.client("iam")
    store, other = LocalStore(tmp_path / "mine"), LocalStore(tmp_path / "theirs")
    policy = roles.node_policy("mine-1", aws_env.region, "123456789012", ["s3://b/jobs/mine-1"], store.scope)
    for _ in range(2):  # a retried acquire
        made = roles.create(iam, "mine-1", policy, {rq.RUN_ID_TAG: "mine-1", rq.STORE_TAG: store.root_uri},
                            store.scope)
    assert made.profile_arn.endswith(f":instance-profile/prefect-sgpu/{store.scope}/sgpu-mine-1")
    profile = iam.get_instance_profile(InstanceProfileName="sgpu-mine-1")["InstanceProfile"]
    assert [r["RoleName"] for r in profile["Roles"]] == ["sgpu-mine-1"]
    assert json.loads(json.dumps(iam.get_role_policy(RoleName="sgpu-mine-1",
                                                     PolicyName=roles.ROLE_POLICY_NAME)["PolicyDocument"])) == policy
    roles.create(iam, "theirs-1", policy, {rq.RUN_ID_TAG: "theirs-1", rq.STORE_TAG: other.root_uri}, other.scope)
    try:
        cloud = EC2Provisioner(EC2Settings(region=aws_env.region, endpoint_url=aws_env.endpoint_url, job_roles=True),
                               session=aws_env.session())
        report = Sweeper(store, ttl_s=60, cloud=cloud).sweep()
        assert [(x.run_id, x.kind, x.name) for x in report.removed] == [("mine-1", "IAM role", "sgpu-mine-1")]
        with pytest.raises(iam.exceptions.NoSuchEntityException):
            iam.get_role(RoleName="sgpu-mine-1")
        with pytest.raises(iam.exceptions.NoSuchEntityException):
            iam.get_instance_profile(InstanceProfileName="sgpu-mine-1")
        iam.get_role(RoleName="sgpu-theirs-1")  # another store's run is not judged
        assert roles.delete(iam, "mine-1") == [], "deleting what is gone is fine"
    finally:
        roles.delete(iam, "theirs-1")
