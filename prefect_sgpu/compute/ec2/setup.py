"""``prefect-sgpu setup aws``: what one store needs in an AWS account, created or checked, idempotently.

For one store (``s3://bucket/prefix``) in one region, in the order the later steps need:

1. the bucket, with default encryption (SSE-KMS under ``kms_key_id``, else SSE-S3) and S3 Bucket
   Keys, and a lifecycle rule that aborts multipart uploads left incomplete under the store's prefix
   after N days (a dead driver's or node's parts are billed until then);
2. the shipped node permissions boundary (``prefect-sgpu-node-boundary``), as a managed policy;
3. with ``instance_profile``: a role of that name that EC2 may assume, holding what the boundary
   allows as its inline policy, and an instance profile of that name holding the role;
4. the shipped driver policy (``prefect-sgpu-driver``), rendered for the store, the boundary and
   the shared profile's role, and the doctor policy (``prefect-sgpu-doctor``): attach both to the
   driver's identity;
5. the network it found: the default VPC, its NAT gateways and S3 gateway endpoint (reported,
   never changed: nodes need outbound HTTPS and reach S3 cheapest through a gateway endpoint).

Each step reads first and writes only what differs: a second run makes no write. A managed policy
whose default version differs from the rendered document gets a new default version (the oldest
non-default version is deleted when IAM's five are in use). A bucket rule of another ID is kept, and so is
the abort rule of another store prefix of the same bucket (each prefix has its own).
The managed policies' descriptions name their store: a policy of the same name made for another
store is never replaced (a second store of one account takes ``name_suffix``).
With ``dry_run`` no call is made: every call a first run on an empty account makes is listed.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from prefect_sgpu import aws
from prefect_sgpu.compute.ec2 import roles
from prefect_sgpu.errors import SGPUConfigError

BOUNDARY_POLICY = "prefect-sgpu-node-boundary"
DRIVER_POLICY = "prefect-sgpu-driver"
DOCTOR_POLICY = "prefect-sgpu-doctor"
SHARED_PROFILE_POLICY = "prefect-sgpu-node"
LIFECYCLE_RULE_ID = "prefect-sgpu-abort-incomplete-uploads"
#: what a read answers when the thing is not there (S3 and IAM say it in several ways)
ABSENT = {"404", "NoSuchBucket", "NoSuchEntity", "NoSuchEntityException", "NoSuchLifecycleConfiguration",
          "ServerSideEncryptionConfigurationNotFoundError"}
#: operation names that change the account (the rest read it)
WRITES = ("create_", "put_", "add_", "delete_", "attach_", "set_")

Status = Literal["created", "updated", "unchanged", "found", "would"]


@dataclass
class Step:
    """One thing set up: its name, what happened to it and what it is."""

    name: str
    status: Status
    detail: str


@dataclass
class Outcome:
    """What a run did (or, dry, would do): its steps, every call in order, and the block's fields."""

    steps: list[Step] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    block: dict[str, Any] = field(default_factory=dict)
    attach: list[str] = field(default_factory=list)

    @property
    def writes(self) -> list[str]:
        return [c for c in self.calls if c.split(".", 1)[1].startswith(WRITES)]

    def as_json(self) -> dict[str, Any]:
        return {"steps": [asdict(s) for s in self.steps], "calls": self.calls, "block": self.block,
                "attach_to_driver": self.attach}


def _same(a: Any, b: Any) -> bool:
    """Policy documents compared as JSON (IAM hands them back decoded or as text)."""
    load = (lambda d: json.loads(d) if isinstance(d, str) else d)
    return bool(load(a) == load(b))


class AWSSetup:
    """One store's set-up with one boto3 session (an administrator's: IAM and S3 writes)."""

    def __init__(self, store_uri: str, region: str, *, session: Any | None = None, endpoint_url: str | None = None,
                 instance_profile: str | None = None, kms_key_id: str | None = None, abort_after_days: int = 7,
                 dry_run: bool = False, name_suffix: str = "") -> None:
        if not store_uri.startswith("s3://") or not roles.s3_location(store_uri)[0]:
            raise SGPUConfigError("store_uri", store_uri, "an s3://bucket/prefix URI")
        if not 1 <= abort_after_days <= 365:
            raise SGPUConfigError("abort_after_days", abort_after_days, "a whole number of days from 1 to 365")
        if instance_profile is not None and (not instance_profile or "/" in instance_profile
                                             or len(instance_profile) > 64):
            raise SGPUConfigError("instance_profile", instance_profile, "an instance profile name (no path, at most "
                                  "64 characters)")
        self.store_uri, self.region, self.endpoint_url = store_uri.rstrip("/"), region, endpoint_url
        self.bucket, self.prefix = roles.s3_location(store_uri)
        self.instance_profile, self.kms_key_id, self.days = instance_profile, kms_key_id, abort_after_days
        if name_suffix and not re.fullmatch(r"[A-Za-z0-9+=,.@_-]{1,32}", name_suffix):
            raise SGPUConfigError("name_suffix", name_suffix, "up to 32 of IAM's name characters (letters, digits, "
                                  "+=,.@_-)")
        self.dry_run, self.suffix = dry_run, name_suffix
        self._session = session
        self._clients: dict[str, Any] = {}
        self.outcome = Outcome()

    # -- calls: made and recorded, or (dry) only recorded ---------------------------------

    def _client(self, service: str) -> Any:
        if service not in self._clients:
            session = self._session or aws.new_session(self.region)
            self._clients[service] = aws.client(service, session, self.region, self.endpoint_url)
        return self._clients[service]

    def _call(self, service: str, operation: str, **params: Any) -> Any:
        """The call's answer; None when dry (nothing is asked: what a read would find counts as absent)."""
        shown = {k: (json.loads(v) if k.endswith("Document") and isinstance(v, str) else v) for k, v in params.items()}
        self.outcome.calls.append(f"{service}.{operation}" if not self.dry_run else
                                  f"{service}.{operation} {json.dumps(shown, sort_keys=True)}")
        if self.dry_run:
            return None
        return getattr(self._client(service), operation)(**params)

    def _read(self, service: str, operation: str, **params: Any) -> Any:
        """A read's answer, or None when the thing is absent (or the run is dry)."""
        try:
            return self._call(service, operation, **params)
        except Exception as exc:  # noqa: BLE001
            if aws.error_code(exc) in ABSENT:
                return None
            raise

    def _step(self, name: str, status: Status, detail: str) -> None:
        self.outcome.steps.append(Step(name, "would" if self.dry_run and status != "found" else status, detail))

    # -- the steps ------------------------------------------------------------------------

    def run(self) -> Outcome:
        identity = self._call("sts", "get_caller_identity")
        account = identity["Account"] if identity else "<account>"
        part = roles.partition(self.region)
        key = self.policy_kms_key(account)  # before anything is written: an unknown alias fails here
        self.bucket_steps()
        boundary = self.managed_policy(BOUNDARY_POLICY + self.suffix, account, roles.node_boundary(
            self.store_uri, self.region, account, key), "the boundary of prefect-sgpu job roles")
        role_arn = self.shared_profile(account, part) if self.instance_profile else None
        driver = self.managed_policy(DRIVER_POLICY + self.suffix, account, roles.driver_policy(
            self.store_uri, self.region, account, boundary, key, role_arn), "prefect-sgpu drivers")
        doctor = self.managed_policy(DOCTOR_POLICY + self.suffix, account,
                                     roles.doctor_policy(self.store_uri, self.region, account),
                                     "what prefect-sgpu doctor reads besides the driver policy")
        self.network()
        self.outcome.attach = [driver, doctor]
        self.outcome.block = {"region": self.region, "store_uri": self.store_uri, **(
            {"instance_profile": self.instance_profile} if self.instance_profile else
            {"job_roles": True, "node_permissions_boundary": boundary}),
            **({"kms_key_id": self.kms_key_id} if self.kms_key_id else {})}
        return self.outcome

    def policy_kms_key(self, account: str) -> str | None:
        """The store's key as the policies name it: an alias resolved to its key ARN (one DescribeKey; IAM
        never matches an alias for KMS's cryptographic calls), a key id or ARN as given. A dry run asks
        nothing and names the key by a placeholder."""
        if not roles.is_kms_alias(self.kms_key_id):
            return self.kms_key_id
        if self.dry_run:
            self._call("kms", "describe_key", KeyId=self.kms_key_id)  # recorded only
            return f"arn:{roles.partition(self.region)}:kms:{self.region}:{account}:key/<{self.kms_key_id}>"
        self.outcome.calls.append("kms.describe_key")
        return roles.resolve_kms_key(self._client("kms"), self.kms_key_id, self.region)

    def bucket_steps(self) -> None:
        b = self.bucket
        if self._read("s3", "head_bucket", Bucket=b) is None:
            where = {} if self.region == "us-east-1" else {
                "CreateBucketConfiguration": {"LocationConstraint": self.region}}
            self._call("s3", "create_bucket", Bucket=b, **where)
            self._step("bucket", "created", f"s3://{b} in {self.region}")
        else:
            self._step("bucket", "found", f"s3://{b}")
        sse = {"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": self.kms_key_id} if self.kms_key_id else \
            {"SSEAlgorithm": "AES256"}
        wanted = {"ApplyServerSideEncryptionByDefault": sse, "BucketKeyEnabled": True}
        found = self._read("s3", "get_bucket_encryption", Bucket=b)
        rules = (found or {}).get("ServerSideEncryptionConfiguration", {}).get("Rules", [])
        if rules and rules[0].get("ApplyServerSideEncryptionByDefault") == sse and rules[0].get("BucketKeyEnabled"):
            self._step("bucket encryption", "unchanged", f"{sse['SSEAlgorithm']} with Bucket Keys")
        else:
            self._call("s3", "put_bucket_encryption", Bucket=b,
                       ServerSideEncryptionConfiguration={"Rules": [wanted]})
            self._step("bucket encryption", "updated" if rules else "created",
                       f"{sse['SSEAlgorithm']} with Bucket Keys")
        found = self._read("s3", "get_bucket_lifecycle_configuration", Bucket=b)
        rules = list((found or {}).get("Rules", []))
        # one rule per store prefix: a second store of the bucket gets a rule of its own beside the first's
        mine = next((r for r in rules if str(r.get("ID", "")).startswith(LIFECYCLE_RULE_ID)
                     and r.get("Filter", {}).get("Prefix", r.get("Prefix", "")) == self.prefix), None)
        rule_id = mine["ID"] if mine is not None else LIFECYCLE_RULE_ID if not any(
            r.get("ID") == LIFECYCLE_RULE_ID for r in rules) else \
            f"{LIFECYCLE_RULE_ID}-{hashlib.sha256(self.prefix.encode()).hexdigest()[:12]}"
        ours = {"ID": rule_id, "Status": "Enabled", "Filter": {"Prefix": self.prefix},
                "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": self.days}}
        detail = f"abort multipart uploads under s3://{b}/{self.prefix} left incomplete {self.days} day(s)"
        if mine is not None and mine.get("Status") == "Enabled" and mine.get("Filter", {}).get(
                "Prefix", "") == self.prefix and mine.get("AbortIncompleteMultipartUpload") == {
                "DaysAfterInitiation": self.days}:
            self._step("bucket lifecycle", "unchanged", detail)
            return
        others = [r for r in rules if r is not mine]
        self._call("s3", "put_bucket_lifecycle_configuration", Bucket=b,
                   LifecycleConfiguration={"Rules": [*others, ours]})
        self._step("bucket lifecycle", "updated" if mine else "created", detail)

    def managed_policy(self, name: str, account: str, document: dict[str, Any], description: str) -> str:
        """The ARN of managed policy ``name`` holding ``document`` as its default version."""
        arn = f"arn:{roles.partition(self.region)}:iam::{account}:policy/{name}"
        found = self._read("iam", "get_policy", PolicyArn=arn)
        description = f"{description} (store {self.store_uri})"
        if found is None:
            self._call("iam", "create_policy", PolicyName=name, PolicyDocument=json.dumps(document),
                       Description=description)
            self._step(name, "created", arn)
            return arn
        if found["Policy"].get("Description", description) != description:
            raise SGPUConfigError("store_uri", self.store_uri, f"the store policy {arn} was made for",
                                  f"it says: {found['Policy'].get('Description')!r}; give this store's policies "
                                  "names of their own (--name-suffix)")
        version = found["Policy"]["DefaultVersionId"]
        current = self._call("iam", "get_policy_version", PolicyArn=arn, VersionId=version)["PolicyVersion"]
        if _same(current["Document"], document):
            self._step(name, "unchanged", f"{arn} ({version})")
            return arn
        versions = self._call("iam", "list_policy_versions", PolicyArn=arn)["Versions"]
        if len(versions) >= 5:  # IAM keeps five: the oldest that is not the default goes
            oldest = min((v for v in versions if not v["IsDefaultVersion"]), key=lambda v: v["CreateDate"])
            self._call("iam", "delete_policy_version", PolicyArn=arn, VersionId=oldest["VersionId"])
        made = self._call("iam", "create_policy_version", PolicyArn=arn, PolicyDocument=json.dumps(document),
                          SetAsDefault=True)["PolicyVersion"]["VersionId"]
        self._step(name, "updated", f"{arn} ({version} -> {made})")
        return arn

    def shared_profile(self, account: str, part: str) -> str:
        """The shared profile's role ARN, with the role, its policy and the profile made as needed."""
        name = self.instance_profile
        assert name is not None
        found = self._read("iam", "get_role", RoleName=name)
        if found is None:
            found = self._call("iam", "create_role", RoleName=name, AssumeRolePolicyDocument=json.dumps(
                roles.NODE_TRUST_POLICY), Description="prefect-sgpu nodes of every job (a shared instance profile)")
            self._step(f"role {name}", "created", "EC2 may assume it")
        else:
            self._step(f"role {name}", "found", found["Role"]["Arn"])
        role_arn = found["Role"]["Arn"] if found else f"arn:{part}:iam::{account}:role/{name}"
        policy = roles.node_boundary(self.store_uri, self.region, account, self.kms_key_id)
        held = self._read("iam", "get_role_policy", RoleName=name, PolicyName=SHARED_PROFILE_POLICY)
        if held is not None and _same(held["PolicyDocument"], policy):
            self._step(f"role {name} policy", "unchanged", "what the node boundary allows")
        else:
            self._call("iam", "put_role_policy", RoleName=name, PolicyName=SHARED_PROFILE_POLICY,
                       PolicyDocument=json.dumps(policy))
            self._step(f"role {name} policy", "updated" if held else "created", "what the node boundary allows")
        profile = self._read("iam", "get_instance_profile", InstanceProfileName=name)
        if profile is None:
            self._call("iam", "create_instance_profile", InstanceProfileName=name)
        if profile is None or name not in [r["RoleName"] for r in profile["InstanceProfile"]["Roles"]]:
            self._call("iam", "add_role_to_instance_profile", InstanceProfileName=name, RoleName=name)
            self._step(f"instance profile {name}", "created" if profile is None else "updated", f"holds role {name}")
        else:
            self._step(f"instance profile {name}", "unchanged", f"holds role {name}")
        return str(role_arn)

    def network(self) -> None:
        """The default VPC, its NAT gateways and S3 gateway endpoint, as found (nothing is changed)."""
        vpcs = self._call("ec2", "describe_vpcs", Filters=[{"Name": "is-default", "Values": ["true"]}])
        if self.dry_run:
            self._step("network", "found", "not read (dry run)")
            return
        if not vpcs["Vpcs"]:
            self._step("network", "found", f"no default VPC in {self.region}: set subnet_ids to subnets with "
                       "outbound HTTPS (a NAT gateway or public IPs)")
            return
        vpc = vpcs["Vpcs"][0]["VpcId"]
        where = [{"Name": "vpc-id", "Values": [vpc]}]
        nats = self._call("ec2", "describe_nat_gateways", Filters=[*where, {"Name": "state", "Values": ["available"]}])
        endpoints = self._call("ec2", "describe_vpc_endpoints", Filters=[
            *where, {"Name": "service-name", "Values": [f"com.amazonaws.{self.region}.s3"]},
            {"Name": "vpc-endpoint-type", "Values": ["Gateway"]}])
        nat_ids = [n["NatGatewayId"] for n in nats.get("NatGateways", [])]
        s3_ids = [e["VpcEndpointId"] for e in endpoints.get("VpcEndpoints", [])]
        self._step("network", "found", f"default VPC {vpc}; NAT gateways: {', '.join(nat_ids) or 'none'}; S3 "
                   f"gateway endpoint: {', '.join(s3_ids) or 'none (S3 traffic goes through NAT or public IPs)'}")


def report(outcome: Outcome, dry_run: bool) -> str:
    """The outcome as a person reads it."""
    lines = []
    if dry_run:
        lines.append("dry run: these calls would be made (none was):")
        lines += [f"  {call}" for call in outcome.calls]
    width = max((len(s.name) for s in outcome.steps), default=0)
    lines += [f"{s.status.upper():9}  {s.name:<{width}}  {s.detail}" for s in outcome.steps]
    if outcome.attach:
        lines.append("attach to the driver's identity: " + ", ".join(outcome.attach))
    if outcome.block:
        lines.append("EC2Compute fields: " + ", ".join(f"{k}={v!r}" for k, v in outcome.block.items()))
    return "\n".join(lines)
