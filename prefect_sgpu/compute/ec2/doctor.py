"""``prefect-sgpu doctor``: what a first EC2 job needs, checked against the account before it runs.

Each check reads the account (nothing is launched, and the one object written to the store is
deleted at once) and says ``ok``, ``warn``, ``fail`` or ``skip`` with the reason and what to do:

- **credentials**: who the driver is (``sts:GetCallerIdentity``);
- **region**: its availability zones answer, and the configured subnets are in it;
- **store**: the bucket exists, is in the region, and the driver can write, list and delete
  under the store's prefix; a bucket in another region fails when the nodes build the job's
  environment from the store (``environment`` mode ``driver``, the default: every node downloads the
  packages and files across regions on every cold boot), and warns otherwise;
- **store lifecycle**: a lifecycle rule of the bucket aborts the store's incomplete multipart uploads
  (a warning with the fix when none does);
- **image**: the AMI (``ami_id``, or the one ``ami_ssm_parameter`` names) resolves and is available;
- **instances**: the instance type of ``--gpu-type``/``--gpus``/``--nodes`` is offered in the region
  (and in the configured subnets' zones);
- **GPU quota**: the account's vCPU quota for that instance family and market (Service Quotas)
  covers the job's nodes; a shortfall names the quota to raise;
- **capacity reservation** (market ``reserved``): active, of the instance type, with enough free;
- **driver policy**: the shipped driver policy for this store, simulated against the driver's own
  identity (``iam:SimulatePrincipalPolicy``); each action it would be refused is listed;
- what a launch meets after the API accepted it, and the policies that only fail inside a node:
  the security group's rule to itself, the default EBS key, free addresses in the subnets, a
  shared profile's role, a job role's key through SSM, and the first launch attempt with
  ``DryRun=True`` (:mod:`prefect_sgpu.compute.ec2.doctor_checks`).

The driver runs every check under its own identity: the shipped driver policy for the store and
``policies/doctor-policy.json`` (:func:`prefect_sgpu.compute.ec2.roles.doctor_policy`).
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from typing import Any

from prefect_sgpu import catalog
from prefect_sgpu.compute.ec2.doctor_checks import AccountChecks, Check, Status, error_text
from prefect_sgpu.errors import SGPUConfigError

__all__ = ["Check", "Doctor", "Status", "Wanted", "as_json", "examine", "report"]


@dataclass
class Wanted:
    """The job the checks are for: its instance type and node count (None: no GPU checks)."""

    instance_type: catalog.InstanceType | None = None
    nodes: int = 1

    @classmethod
    def of(cls, gpu_type: str | None, gpus: int | None, nodes: int | None) -> "Wanted":
        if gpu_type is None:
            if gpus is not None or nodes is not None:
                raise SGPUConfigError("--gpu-type", None, "a GPU type (prefect-sgpu gpus lists them) with --gpus "
                                      "or --nodes")
            return cls()
        count, instance_type = catalog.plan_nodes(gpu_type, gpus or catalog.lookup(gpu_type).gpus_per_node_options[0],
                                                  nodes)
        return cls(instance_type, count)


_error = error_text


class Doctor(AccountChecks):
    """Runs the checks for one set of EC2 settings with one boto3 session (the driver's)."""

    def __init__(self, settings: Any, session: Any | None = None, builds_on_nodes: bool | None = None) -> None:
        from prefect_sgpu.compute.ec2.instances import EC2Provisioner

        self.settings = settings
        #: whether the nodes build the job's environment from the store (None: unless
        #: ``PREFECT_SGPU_ENVIRONMENT=image`` says the image has it)
        self.builds_on_nodes = builds_on_nodes
        self.provisioner = EC2Provisioner(settings, session=session)
        self.identity: dict[str, Any] | None = None
        self._subnets: list[dict[str, Any]] | None = None

    def subnets(self) -> list[dict[str, Any]]:
        """The configured subnets as EC2 describes them (asked once; raises what EC2 raised)."""
        if self._subnets is None:
            ids = list(self.settings.subnet_ids)
            self._subnets = self.client("ec2").describe_subnets(SubnetIds=ids)["Subnets"] if ids else []
        return self._subnets

    def client(self, service: str) -> Any:
        return self.provisioner.client(service)

    def run(self, wanted: Wanted) -> list[Check]:
        checks = [self.credentials()]
        if self.identity is None:
            rest = ("region", "store", "store lifecycle", "image", "instances", "GPU quota", "driver policy", "security group",
                    "EBS key", "subnet addresses", "subnet egress", "shared profile", "job role key", "launch (dry run)")
            return checks + [Check(name, "skip", "needs credentials") for name in rest]
        checks += [self.region(), self.store(), self.store_lifecycle(), self.image(), *self.instances(wanted), self.driver_policy()]
        checks += self.launch_checks(wanted.instance_type, wanted.nodes)
        return checks

    def principal(self) -> str | None:
        return self._principal_arn()

    def image_of(self) -> tuple[str, str]:
        return self.provisioner.image()

    # -- one check each -----------------------------------------------------------------

    def credentials(self) -> Check:
        try:
            self.identity = self.client("sts").get_caller_identity()
        except Exception as exc:  # noqa: BLE001 - no credentials is the answer, not a crash
            return Check("credentials", "fail", f"no usable AWS credentials: {_error(exc)}",
                         "configure them as for the AWS CLI (aws configure, AWS_PROFILE, or an instance role)")
        return Check("credentials", "ok", f"account {self.identity['Account']} as {self.identity['Arn']}")

    def region(self) -> Check:
        s = self.settings
        try:
            zones = self.client("ec2").describe_availability_zones()["AvailabilityZones"]
        except Exception as exc:  # noqa: BLE001
            return Check("region", "fail", f"{s.region}: {_error(exc)}", "set region to one enabled for the account")
        names = sorted(z["ZoneName"] for z in zones)
        detail = f"{s.region}: {len(names)} availability zone(s)"
        if s.subnet_ids:
            try:
                subnets = self.subnets()
            except Exception as exc:  # noqa: BLE001
                return Check("region", "fail", f"subnet_ids {list(s.subnet_ids)}: {_error(exc)}",
                             f"subnets of {s.region} (aws ec2 describe-subnets --region {s.region})")
            detail += "; subnets in " + ", ".join(sorted(n["AvailabilityZone"] for n in subnets))
        return Check("region", "ok", detail)

    def store(self) -> Check:
        from prefect_sgpu.aws import error_code
        from prefect_sgpu.compute.ec2.roles import s3_location

        s = self.settings
        if not s.store_uri:
            return Check("store", "fail", "store_uri is empty", "an s3://bucket/prefix the driver and nodes share")
        bucket, prefix = s3_location(s.store_uri)
        s3 = self.client("s3")
        try:
            try:
                s3.head_bucket(Bucket=bucket)
            except Exception as exc:  # noqa: BLE001
                # HeadBucket needs s3:ListBucket of the whole bucket; the driver policy lists its prefix
                # only, so a 403 here is the policy: the bucket's location says whether it exists
                if error_code(exc) not in ("403", "AccessDenied"):
                    raise
                s3.get_bucket_location(Bucket=bucket)
        except Exception as exc:  # noqa: BLE001
            code = error_code(exc)
            if code in ("404", "NoSuchBucket"):
                return Check("store", "fail", f"bucket {bucket} does not exist",
                             f"create it in {s.region} (aws s3 mb s3://{bucket} --region {s.region})")
            return Check("store", "fail", f"bucket {bucket}: {_error(exc)}",
                         "the driver needs s3:ListBucket on it and s3:*Object under the store's prefix")
        try:
            location = s3.get_bucket_location(Bucket=bucket).get("LocationConstraint") or "us-east-1"
        except Exception:  # noqa: BLE001 - not allowed to ask: the write probe below still tells
            location = None
        probe = f"{prefix}.prefect-sgpu-doctor/{uuid.uuid4().hex}"
        try:
            s3.put_object(Bucket=bucket, Key=probe, Body=b"prefect-sgpu doctor")
            s3.list_objects_v2(Bucket=bucket, Prefix=probe, MaxKeys=1)
            s3.delete_object(Bucket=bucket, Key=probe)
        except Exception as exc:  # noqa: BLE001
            return Check("store", "fail", f"{s.store_uri}: writing, listing and deleting {probe}: {_error(exc)}",
                         "the driver needs s3:PutObject, s3:GetObject, s3:DeleteObject under the prefix and "
                         "s3:ListBucket on the bucket (the shipped driver policy grants them)")
        if location is not None and location != s.region:
            if self._nodes_build():
                return Check("store", "fail", f"{s.store_uri} is in {location}, the instances in {s.region}, and "
                             "the nodes build the job's environment from it (environment mode 'driver')",
                             f"a store in a bucket of {s.region} (aws s3 mb s3://<bucket> --region {s.region}), "
                             f"or region={location} for the instances, or environment mode 'image' with an "
                             "image that has the job's packages")
            return Check("store", "warn", f"{s.store_uri} is in {location}, the instances in {s.region}",
                         "a bucket in the instances' region: traffic between regions is slower and billed")
        return Check("store", "ok", f"{s.store_uri}: written, listed and deleted a probe object")

    def _nodes_build(self) -> bool:
        if self.builds_on_nodes is not None:
            return self.builds_on_nodes
        from prefect_sgpu.environment import ENVIRONMENT_ENV
        import os

        return os.environ.get(ENVIRONMENT_ENV, "driver") != "image"

    def image(self) -> Check:
        from prefect_sgpu.errors import ProvisioningError

        s = self.settings
        try:
            image_id, _ = self.provisioner.image()
            (image,) = self.client("ec2").describe_images(ImageIds=[image_id])["Images"]
        except (SGPUConfigError, ProvisioningError) as exc:
            return Check("image", "fail", str(exc), "ami_id, or an ami_ssm_parameter of the region")
        except Exception as exc:  # noqa: BLE001
            return Check("image", "fail", f"{s.ami_id or s.ami_ssm_parameter}: {_error(exc)}",
                         "ami_id, or an ami_ssm_parameter of the region")
        source = "ami_id" if s.ami_id else f"from {s.ami_ssm_parameter}"
        detail = f"{image_id} ({source}): {image.get('Name') or image.get('Description') or 'no name'}"
        if image.get("State", "available") != "available":
            return Check("image", "fail", f"{detail} is {image.get('State')}", "an available image")
        return Check("image", "ok", f"{detail}, {image.get('Architecture', 'unknown architecture')}")

    def instances(self, wanted: Wanted) -> list[Check]:
        it = wanted.instance_type
        if it is None:
            return [Check(name, "skip", "no --gpu-type given") for name in ("instances", "GPU quota")]
        return [self.offered(it), self.quota(it, wanted.nodes), *self.reservation(it, wanted.nodes)]

    def offered(self, it: catalog.InstanceType) -> Check:
        s = self.settings
        try:
            offers = self.client("ec2").describe_instance_type_offerings(
                LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [it.name]}],
            )["InstanceTypeOfferings"]
        except Exception as exc:  # noqa: BLE001
            return Check("instances", "warn", f"{it.name}: offerings unknown: {_error(exc)}")
        zones = sorted({o["Location"] for o in offers})
        if not zones:
            return Check("instances", "fail", f"{it.name} is not offered in {s.region}",
                         "another region, or another gpu_type (prefect-sgpu gpus)")
        if s.subnet_ids:
            try:
                subnets = self.subnets()
            except Exception:  # noqa: BLE001 - the region check names a bad subnet
                subnets = []
            mine = sorted({n["AvailabilityZone"] for n in subnets})
            if mine and not set(mine) & set(zones):
                return Check("instances", "fail", f"{it.name} is offered in {', '.join(zones)}, none of the "
                             f"subnets' zones ({', '.join(mine)})", "a subnet in one of those zones")
        return Check("instances", "ok", f"{it.name} ({it.gpus} GPU(s), {it.vcpus} vCPUs) offered in "
                     f"{', '.join(zones)}")

    def quota(self, it: catalog.InstanceType, nodes: int) -> Check:
        from prefect_sgpu.aws import error_code
        from prefect_sgpu.compute.ec2.gang_launch import vcpu_quota_of

        market = "on-demand" if self.settings.market == "reserved" else self.settings.market
        needed = it.vcpus * nodes
        title, code = vcpu_quota_of(it.name, market)
        if code is None:
            return Check("GPU quota", "skip", f"no code known here for the quota '{title}' of {it.name}")
        quotas = self.client("service-quotas")
        try:
            value = quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
        except Exception as exc:  # noqa: BLE001
            if error_code(exc) != "NoSuchResourceException":
                return Check("GPU quota", "warn", f"'{title}' ({code}) could not be read: {_error(exc)}",
                             "allow servicequotas:GetServiceQuota to see it here")
            try:  # never raised for this account: the default applies
                value = quotas.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
            except Exception as inner:  # noqa: BLE001
                return Check("GPU quota", "warn", f"'{title}' ({code}) could not be read: {_error(inner)}")
        if value < needed:
            return Check("GPU quota", "fail", f"{nodes} x {it.name} need {needed} vCPUs of '{title}' ({code}); the "
                         f"account has {value:g} in {self.settings.region}",
                         f"request an increase: aws service-quotas request-service-quota-increase --service-code ec2 "
                         f"--quota-code {code} --desired-value {needed} --region {self.settings.region}")
        return Check("GPU quota", "ok", f"{nodes} x {it.name} need {needed} of {value:g} vCPUs of '{title}' ({code})")

    def reservation(self, it: catalog.InstanceType, nodes: int) -> list[Check]:
        s = self.settings
        if s.market != "reserved":
            return []
        try:
            (found,) = self.client("ec2").describe_capacity_reservations(
                CapacityReservationIds=[s.capacity_reservation_id])["CapacityReservations"]
        except Exception as exc:  # noqa: BLE001
            return [Check("capacity reservation", "fail", f"{s.capacity_reservation_id}: {_error(exc)}",
                          "a reservation id of this account and region")]
        problems = []
        if found.get("State") != "active":
            problems.append(f"it is {found.get('State')}")
        if found.get("InstanceType") != it.name:
            problems.append(f"it holds {found.get('InstanceType')}, the job needs {it.name}")
        if int(found.get("AvailableInstanceCount", 0)) < nodes:
            problems.append(f"{found.get('AvailableInstanceCount', 0)} free, the job needs {nodes}")
        if problems:
            return [Check("capacity reservation", "fail", f"{s.capacity_reservation_id}: " + "; ".join(problems))]
        return [Check("capacity reservation", "ok", f"{s.capacity_reservation_id}: {nodes} of "
                      f"{found['AvailableInstanceCount']} free {it.name} in {found.get('AvailabilityZone')}")]

    def driver_policy(self) -> Check:
        from prefect_sgpu.compute.ec2 import roles

        s = self.settings
        assert self.identity is not None
        if not s.store_uri:
            return Check("driver policy", "skip", "needs store_uri")
        account, region = self.identity["Account"], s.region
        part = roles.partition(region)
        boundary = s.node_permissions_boundary or f"arn:{part}:iam::{account}:policy/prefect-sgpu-node-boundary"
        shared = self._shared_role_arn()
        try:  # an alias names no key IAM matches: the policy names the key it resolves to
            key = roles.resolve_kms_key(self.client("kms"), s.kms_key_id, region)
        except SGPUConfigError as exc:
            return Check("driver policy", "fail", str(exc), "set kms_key_id to a key id, key ARN or existing alias")
        policy = roles.driver_policy(s.store_uri, region, account, boundary, key, shared)
        try:
            principal = self._principal_arn()
        except Exception as exc:  # noqa: BLE001
            return Check("driver policy", "warn", f"cannot name the driver's IAM identity: {_error(exc)}")
        if principal is None:
            return Check("driver policy", "warn", f"{self.identity['Arn']} is the account's root user: every action is "
                         "allowed", "run drivers as a role or user with the shipped driver policy")
        iam = self.client("iam")
        refused: list[str] = []
        for statement in policy["Statement"]:
            if statement.get("Effect") != "Allow":
                continue
            actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
            resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
            arn = resources[0].replace("*", "prefect-sgpu-doctor") if resources[0] != "*" else "*"
            context = [{"ContextKeyName": key, "ContextKeyValues": [str(v) for v in (want if isinstance(want, list)
                                                                                     else [want])],
                        "ContextKeyType": "stringList"}
                       for pairs in statement.get("Condition", {}).values() for key, want in pairs.items()]
            try:
                results = iam.simulate_principal_policy(PolicySourceArn=principal, ActionNames=actions,
                                                        ResourceArns=[arn], ContextEntries=context)["EvaluationResults"]
            except Exception as exc:  # noqa: BLE001
                return Check("driver policy", "warn", f"cannot simulate {principal}'s policies: {_error(exc)}",
                             "allow iam:SimulatePrincipalPolicy on the driver's own identity to see this check")
            refused += [f"{r['EvalActionName']} on {r.get('EvalResourceName', arn)} ({r['EvalDecision']})"
                        for r in results if r["EvalDecision"] != "allowed"]
        if refused:
            return Check("driver policy", "fail", f"{principal} would be refused {len(refused)} action(s): "
                         + "; ".join(refused),
                         "attach the driver policy for this store (prefect_sgpu.compute.ec2.roles.driver_policy, "
                         "docs/iam)")
        return Check("driver policy", "ok", f"{principal} is allowed every action of the driver policy for "
                     f"{s.store_uri}")

    def _shared_role_arn(self) -> str | None:
        """The role of the shared ``instance_profile``, when there is one and IAM names it."""
        if not self.settings.instance_profile:
            return None
        try:
            found = self.client("iam").get_instance_profile(
                InstanceProfileName=self.settings.instance_profile.rsplit("/", 1)[-1])["InstanceProfile"]["Roles"]
        except Exception:  # noqa: BLE001 - the shared profile check says why
            return None
        return str(found[0]["Arn"]) if found else None

    def _principal_arn(self) -> str | None:
        """The IAM user or role behind the caller (an assumed role's session names its role)."""
        assert self.identity is not None
        arn: str = self.identity["Arn"]
        kind, _, rest = arn.split(":", 5)[5].partition("/")
        if kind == "root":
            return None
        if kind == "assumed-role":
            role = rest.split("/")[0]
            return str(self.client("iam").get_role(RoleName=role)["Role"]["Arn"])
        return arn


def examine(settings: Any, wanted: Wanted, session: Any | None = None,
            builds_on_nodes: bool | None = None) -> list[Check]:
    """Every check (see the module's docstring); ``builds_on_nodes``: see :class:`Doctor`."""
    return Doctor(settings, session=session, builds_on_nodes=builds_on_nodes).run(wanted)


def report(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status.upper():4}  {c.name:<{width}}  {c.detail}")
        if c.fix and c.status in ("fail", "warn"):
            lines.append(f"{'':4}  {'':<{width}}  -> {c.fix}")
    return "\n".join(lines)


def as_json(checks: list[Check]) -> list[dict[str, Any]]:
    return [asdict(c) for c in checks]
