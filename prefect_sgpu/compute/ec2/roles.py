"""A role of its own for every EC2 job: its nodes reach only that job's files, key and instances.

With ``job_roles=True`` on the ``EC2Compute`` block (and no shared ``instance_profile``), the
driver creates, before launching, an IAM role and an instance profile named for the run
under the path ``/prefect-sgpu/<store scope>/`` (:func:`prefect_sgpu.store.store_scope`),
with one inline policy rendered from
``prefect_sgpu/policies/node-policy.json``:

- S3 get/put/delete under the run's own folder of the store (and under the job's
  checkpoint location when a GPU task keys it elsewhere), and a listing limited to those
  prefixes;
- ``ssm:GetParameter`` / ``ssm:DeleteParameter`` on ``/prefect-sgpu/<store scope>/<run id>/*`` only
  (the job key, the job's ``secrets=``);
- ``ec2:TerminateInstances`` only on instances tagged ``sgpu:run-id=<run id>``;
- the store's KMS key when one is configured; without one, ``kms:Decrypt`` through SSM only
  (``kms:ViaService``) and only for the run's own parameters (their ``PARAMETER_ARN`` encryption
  context): the job key is a SecureString under the account's AWS-managed ``aws/ssm`` key, whose
  key policy leaves the rest to IAM.

Code in one job's ranks therefore gets AccessDenied on another job's key, documents and
nodes. The role is created with the permissions boundary ``node_permissions_boundary`` (the
account-wide ceiling, ``policies/node-boundary.json``), which is what lets the driver's own
policy (``policies/driver-policy.json``) allow ``iam:CreateRole`` without letting a driver mint
a stronger role. Role and profile are deleted when the job ends, on every path, and by the
sweeper for a dead driver's runs.

**A warm lease** (``keep_warm``) gets one role too, named for the lease and created with it:
its policy covers the lease's own folder, key and instances. A job the lease serves is added
while it runs: before the driver assigns a job, it puts a second inline policy on the lease's
role (:func:`job_access_policy`: that job's files, checkpoint location and SSM path), and it
deletes that policy when the job gives the lease back. So a job on a lease reaches its own
folder and key and the lease's, never those of the job before it, of another lease or of a
cold job. The role goes when the lease ends.

Why one role per run rather than one shared role with attribute-based conditions: a shared
role's session would need a per-node session tag to tell runs apart, and EC2 instance
profiles cannot set session tags; the run id in a role's own policy is plain and auditable.
The cost is a few IAM calls per job and IAM's eventual consistency: a new instance profile
takes seconds before EC2 accepts it, so the launch retries that one error (see
:meth:`~prefect_sgpu.compute.ec2.instances.EC2Provisioner.provision`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from importlib import resources
from typing import Any

from prefect_sgpu import aws
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.store import store_scope

logger = logging.getLogger("prefect_sgpu.ec2")

ROLE_PATH = "/prefect-sgpu/"


def role_path(scope: str) -> str:
    """``/prefect-sgpu/<store scope>/``: the IAM path of one store's job roles and instance profiles."""
    return f"{ROLE_PATH}{scope}/"
ROLE_POLICY_NAME = "prefect-sgpu-job"
#: the inline policy a warm lease's role holds for the job it serves (put at assignment, deleted at release)
ASSIGNED_JOB_POLICY_NAME = "prefect-sgpu-assigned-job"
#: the statements of ``node-policy.json`` that a job on a lease adds to the lease's role
ASSIGNED_JOB_STATEMENTS = ("JobFiles", "ListJobFiles", "JobParameters", "JobParametersKey")
NODE_TRUST_POLICY = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}],
}


def policy_template(name: str) -> dict[str, Any]:
    """One of the shipped policy documents (``node-policy``, ``node-boundary``, ``driver-policy``,
    ``doctor-policy``)."""
    text = resources.files("prefect_sgpu.policies").joinpath(f"{name}.json").read_text()
    return json.loads(text)


def partition(region: str) -> str:
    if region.startswith("cn-"):
        return "aws-cn"
    if region.startswith("us-gov-"):
        return "aws-us-gov"
    return "aws"


def role_name(run_id: str) -> str:
    """``sgpu-<run id>``: at most 48 characters (IAM allows 64)."""
    return f"sgpu-{run_id}"


def is_kms_alias(key_id: str | None) -> bool:
    """Whether ``key_id`` names a KMS key by alias (``alias/name`` or an alias ARN)."""
    return bool(key_id) and (str(key_id).startswith("alias/") or ":alias/" in str(key_id))


def kms_key_arn(key_id: str | None, region: str, account: str) -> str | None:
    """The ARN a policy names the store's key by: a key ARN as given, else the key id's.

    An alias is refused: IAM authorizes KMS's cryptographic calls (``kms:Decrypt``,
    ``kms:GenerateDataKey``, ...) against the key's own ARN, never an alias ARN (AWS KMS docs, "Using
    aliases to control access to KMS keys": an alias ARN in a policy's Resource controls the alias
    operations only), so a policy naming an alias allows nothing with the key. Resolve it first
    (:func:`resolve_kms_key`)."""
    if not key_id:
        return None
    if is_kms_alias(key_id):
        raise SGPUConfigError("kms_key_id", key_id, "the key's id or ARN in a policy: IAM never matches an alias "
                              "for KMS's cryptographic calls (resolve it with kms.describe_key first)")
    if key_id.startswith("arn:"):
        return key_id
    return f"arn:{partition(region)}:kms:{region}:{account}:key/{key_id}"


def resolve_kms_key(kms: Any, key_id: str | None, region: str = "") -> str | None:
    """The key ARN of ``key_id`` when it is an alias (one ``kms.describe_key``), else ``key_id``
    unchanged (a key id or key ARN renders without a call). An alias that does not exist, or that the
    caller may not describe, is an :class:`SGPUConfigError` naming it."""
    if not is_kms_alias(key_id):
        return key_id
    try:
        return str(kms.describe_key(KeyId=key_id)["KeyMetadata"]["Arn"])
    except Exception as exc:  # noqa: BLE001 - AWS's answers are the user's to fix; anything else is raised
        code, message = aws.error_of(exc)
        if not code:
            raise
        where = f" in {region}" if region else ""
        if code in ("NotFoundException", "NotFound"):
            raise SGPUConfigError("kms_key_id", key_id, f"a KMS key id, key ARN or an alias that exists{where} "
                                  f"(DescribeKey: {code}: {message})") from None
        raise SGPUConfigError("kms_key_id", key_id, f"an alias the driver may resolve{where} with kms:DescribeKey "
                              f"(DescribeKey: {code}: {message}), or the key's id or ARN") from None


def ssm_managed_keys(kms_key_id: str | None, region: str, account: str) -> str | None:
    """The KMS keys a node may decrypt its SSM SecureStrings with when the store names no key of its own:
    every key of the account, each statement that names them conditioned to SSM's use for the store's
    (or the run's) parameters; None when a key is configured (the ``StoreKey`` statements cover it).

    SSM encrypts a SecureString without ``KeyId`` under the AWS-managed ``alias/aws/ssm`` key, whose id
    differs per account and region, and IAM cannot name a key by alias for ``kms:Decrypt``: hence
    ``key/*`` with ``kms:ViaService`` and ``kms:EncryptionContext:PARAMETER_ARN``
    (https://docs.aws.amazon.com/systems-manager/latest/userguide/secure-string-parameter-kms-encryption.html).
    """
    return None if kms_key_id else f"arn:{partition(region)}:kms:{region}:{account}:key/*"


def render(template: dict[str, Any], values: dict[str, str | None],
           locations: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """``template`` with ``{{Name}}`` replaced by ``values``.

    A statement naming ``{{Bucket}}`` or ``{{Prefix}}`` is repeated once per
    ``(bucket, prefix)`` of ``locations``; a statement naming a value that is None (a KMS
    key that is not configured) is left out.
    """
    out = []
    for statement in template["Statement"]:
        text = json.dumps(statement)
        names = {part.split("}}")[0] for part in text.split("{{")[1:]}
        if any(values.get(n, "") is None for n in names):
            continue
        per_location = [{}] if not ({"Prefix"} & names) or locations is None else [
            {"Bucket": b, "Prefix": p} for b, p in locations]
        for number, extra in enumerate(per_location):
            filled = text
            for name, value in {**values, **extra}.items():
                if value is not None:
                    filled = filled.replace("{{" + name + "}}", value)
            if "{{" in filled:
                missing = sorted({part.split("}}")[0] for part in filled.split("{{")[1:]})
                raise ValueError(f"policy statement {statement.get('Sid')} needs {missing}")
            rendered = json.loads(filled)
            if number and "Sid" in rendered:  # statement ids are unique within a policy
                rendered["Sid"] = f"{rendered['Sid']}{number}"
            out.append(rendered)
    return {"Version": template.get("Version", "2012-10-17"), "Statement": out}


def s3_location(uri: str) -> tuple[str, str]:
    """(bucket, key prefix ending in "/") of an ``s3://bucket/prefix`` URI."""
    rest = uri[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def node_policy(run_id: str, region: str, account: str, locations: list[str], scope: str,
                kms_key_id: str | None = None, environment_uri: str | None = None,
                packages_uri: str | None = None) -> dict[str, Any]:
    """The inline policy of run ``run_id``'s role: its ``s3://`` locations, its SSM path, its instances,
    read access to ``environment_uri``, the folder of the environment its nodes build (none when
    they build none), and read and write access to ``packages_uri``, the folder of the packs of that
    environment's packages."""
    env_bucket, env_prefix = s3_location(environment_uri) if environment_uri else (None, None)
    packages_prefix = s3_location(packages_uri)[1] if packages_uri and environment_uri else None
    return render(policy_template("node-policy"),
                  {"Partition": partition(region), "Region": region, "Account": account, "RunId": run_id,
                   "StoreScope": scope, "KmsKeyArn": kms_key_arn(kms_key_id, region, account),
                   "SsmManagedKeys": ssm_managed_keys(kms_key_id, region, account), "EnvironmentBucket": env_bucket,
                   "EnvironmentPrefix": env_prefix, "PackagesPrefix": packages_prefix},
                  [s3_location(uri) for uri in dict.fromkeys(locations)])


def job_access_policy(run_id: str, region: str, account: str, locations: list[str], scope: str,
                      kms_key_id: str | None = None) -> dict[str, Any]:
    """What a warm lease's role holds while it serves run ``run_id``: that run's ``s3://`` locations
    and SSM path, and without a store key the decryption of that path's parameters through SSM (the
    node policy's job statements; the lease's own policy has its instances, environment and KMS key)."""
    template = policy_template("node-policy")
    template = {**template, "Statement": [s for s in template["Statement"] if s.get("Sid") in ASSIGNED_JOB_STATEMENTS]}
    return render(template, {"Partition": partition(region), "Region": region, "Account": account, "RunId": run_id,
                             "StoreScope": scope, "SsmManagedKeys": ssm_managed_keys(kms_key_id, region, account)},
                  [s3_location(uri) for uri in dict.fromkeys(locations)])


def grant_job(iam: Any, lease_id: str, policy: dict[str, Any]) -> None:
    """The lease's role reaches the job of ``policy`` (replacing the last job's, if it is still there)."""
    iam.put_role_policy(RoleName=role_name(lease_id), PolicyName=ASSIGNED_JOB_POLICY_NAME,
                        PolicyDocument=json.dumps(policy))


def revoke_job(iam: Any, lease_id: str) -> None:
    """The lease's role no longer reaches the job it served; "already gone" is fine."""
    try:
        iam.delete_role_policy(RoleName=role_name(lease_id), PolicyName=ASSIGNED_JOB_POLICY_NAME)
    except Exception as exc:  # noqa: BLE001
        if aws.error_code(exc) not in ("NoSuchEntity", "NoSuchEntityException"):
            raise


def role_policies(iam: Any, run_id: str) -> list[str]:
    """The names of the inline policies of run (or lease) ``run_id``'s role."""
    names: list[str] = []
    for page in iam.get_paginator("list_role_policies").paginate(RoleName=role_name(run_id)):
        names += page.get("PolicyNames", [])
    return names


def driver_policy(store_uri: str, region: str, account: str, node_boundary_arn: str,
                  kms_key_id: str | None = None, shared_profile_role_arn: str | None = None) -> dict[str, Any]:
    """The shipped driver policy for one store (what a Prefect worker's role needs).

    ``shared_profile_role_arn``: the role of the block's shared ``instance_profile``, which the
    driver then may pass to EC2 (``iam:PassRole``, ``iam:PassedToService`` EC2 only); without it the
    driver passes only the store's job roles, and a launch naming another profile is refused."""
    bucket, prefix = s3_location(store_uri)
    return render(policy_template("driver-policy"),
                  {"Partition": partition(region), "Region": region, "Account": account, "Bucket": bucket,
                   "StorePrefix": prefix, "StoreUri": store_uri.rstrip("/"), "NodeBoundaryArn": node_boundary_arn,
                   "StoreScope": store_scope(store_uri),
                   "KmsKeyArn": kms_key_arn(kms_key_id, region, account),
                   "SharedProfileRoleArn": shared_profile_role_arn})


def node_boundary(store_uri: str, region: str, account: str, kms_key_id: str | None = None) -> dict[str, Any]:
    """The shipped permissions boundary every job role of one store is created under: that store's
    files, its SSM path, its instances and its KMS key (none: no KMS at all)."""
    bucket, prefix = s3_location(store_uri)
    return render(policy_template("node-boundary"),
                  {"Partition": partition(region), "Region": region, "Account": account, "Bucket": bucket,
                   "StorePrefix": prefix, "StoreUri": store_uri.rstrip("/"), "StoreScope": store_scope(store_uri),
                   "KmsKeyArn": kms_key_arn(kms_key_id, region, account),
                   "SsmManagedKeys": ssm_managed_keys(kms_key_id, region, account)})


def doctor_policy(store_uri: str, region: str, account: str) -> dict[str, Any]:
    """The shipped doctor policy for one store: what ``prefect-sgpu doctor`` reads besides what the
    driver policy allows (the driver runs the doctor under both)."""
    bucket, _ = s3_location(store_uri)
    return render(policy_template("doctor-policy"), {"Partition": partition(region), "Account": account,
                                                     "Bucket": bucket})


@dataclass
class JobRole:
    """What :func:`create` made for one run (names, for release and for the launch request)."""

    run_id: str
    name: str
    profile_arn: str = ""


def create(iam: Any, run_id: str, policy: dict[str, Any], tags: dict[str, str], scope: str,
           boundary_arn: str | None = None) -> JobRole:
    """Role + inline policy + instance profile for ``run_id``; idempotent (a retried acquire reuses them)."""
    name = role_name(run_id)
    tag_list = [{"Key": k, "Value": v} for k, v in tags.items()]
    extra = {"PermissionsBoundary": boundary_arn} if boundary_arn else {}
    try:
        iam.create_role(RoleName=name, Path=role_path(scope), AssumeRolePolicyDocument=json.dumps(NODE_TRUST_POLICY),
                        Description=f"prefect-sgpu nodes of run {run_id} (deleted with the run)",
                        MaxSessionDuration=43200, Tags=tag_list, **extra)
    except Exception as exc:  # noqa: BLE001
        if aws.error_code(exc) != "EntityAlreadyExists":
            raise
    iam.put_role_policy(RoleName=name, PolicyName=ROLE_POLICY_NAME, PolicyDocument=json.dumps(policy))
    try:
        profile = iam.create_instance_profile(InstanceProfileName=name, Path=role_path(scope), Tags=tag_list)
        arn = profile["InstanceProfile"]["Arn"]
    except Exception as exc:  # noqa: BLE001
        if aws.error_code(exc) != "EntityAlreadyExists":
            raise
        arn = iam.get_instance_profile(InstanceProfileName=name)["InstanceProfile"]["Arn"]
    try:
        iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)
    except Exception as exc:  # noqa: BLE001
        if aws.error_code(exc) != "LimitExceeded":  # the profile holds its role already
            raise
    return JobRole(run_id=run_id, name=name, profile_arn=arn)


def delete(iam: Any, run_id: str) -> list[str]:
    """Remove run ``run_id``'s instance profile and role; what was deleted. "Already gone" is fine."""
    name = role_name(run_id)
    gone: list[str] = []

    def attempt(call: Any, what: str | None = None, **kwargs: Any) -> None:
        try:
            call(**kwargs)
            if what:
                gone.append(what)
        except Exception as exc:  # noqa: BLE001
            if aws.error_code(exc) not in ("NoSuchEntity", "NoSuchEntityException"):
                raise

    attempt(iam.remove_role_from_instance_profile, InstanceProfileName=name, RoleName=name)
    attempt(iam.delete_instance_profile, f"IAM instance profile {name}", InstanceProfileName=name)
    try:  # its own, and on a lease's role the policy of the job it serves
        policies = role_policies(iam, run_id)
    except Exception as exc:  # noqa: BLE001
        if aws.error_code(exc) not in ("NoSuchEntity", "NoSuchEntityException"):
            raise
        policies = []  # the role is gone already
    for policy in policies:
        attempt(iam.delete_role_policy, RoleName=name, PolicyName=policy)
    attempt(iam.delete_role, f"IAM role {name}", RoleName=name)
    return gone


def job_role_runs(iam: Any, scope: str) -> dict[str, dict[str, str]]:
    """Run id -> tags of every job role of one store's scope that exists (for the sweeper)."""
    found: dict[str, dict[str, str]] = {}
    for page in iam.get_paginator("list_roles").paginate(PathPrefix=role_path(scope)):
        for role in page.get("Roles", []):
            name = role["RoleName"]
            if not name.startswith("sgpu-"):
                continue
            tags = {t["Key"]: t["Value"] for t in role.get("Tags") or []}
            if not tags:
                try:
                    got = iam.get_role(RoleName=name)["Role"]
                    tags = {t["Key"]: t["Value"] for t in got.get("Tags") or []}
                except Exception:  # noqa: BLE001 - deleted meanwhile
                    continue
            run = tags.get("sgpu:run-id")
            if run:
                found[run] = tags
    return found
