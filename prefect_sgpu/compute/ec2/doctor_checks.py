"""The doctor's checks of what a launch meets after the API accepts it, and of the policies that only
fail inside a node: each reads the account, launches nothing, and says what to fix.

- **security group** (``security_group_id``): the all-traffic rule to and from the group itself, in
  and out; without it the nodes of a job cannot reach node 0's rendezvous, and EFA refuses to start
  (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start.html#efa-start-security);
- **EBS key**: the request asks for encrypted volumes without naming a key, so EBS uses the
  account's default key (``ec2:GetEbsDefaultKmsKeyId``); a customer managed key the driver cannot use
  makes every instance go from ``pending`` to ``terminated`` with ``Client.InvalidKMSKey.InvalidState``
  or ``Client.InternalError`` after RunInstances succeeded
  (https://docs.aws.amazon.com/ebs/latest/userguide/ebs-encryption-requirements.html);
- **subnet addresses**: each node takes one private address per network interface (an EFA
  instance type one per network card: 32 on p5.48xlarge); a subnet with fewer free addresses than the
  job needs fails the launch with ``InsufficientFreeAddressesInSubnet``;
- **shared profile** (``instance_profile``): the driver may pass the profile's role to EC2
  (``iam:PassRole`` with ``iam:PassedToService``);
- **job role key** (``job_roles`` without ``kms_key_id``): a job role under the configured boundary may
  decrypt its SSM SecureString through SSM under the account's ``aws/ssm`` key;
- **store lifecycle**: the store's bucket has an enabled lifecycle rule that aborts incomplete multipart
  uploads for the store's prefix (or the whole bucket); without one, the parts of an upload a reclaim or a
  crash cut off (a pack, a checkpoint, a large result) stay billed, unseen by any listing of objects, until
  someone aborts it (https://docs.aws.amazon.com/AmazonS3/latest/userguide/mpu-abort-incomplete-mpu-lifecycle-config.html,
  "Configuring a bucket lifecycle configuration to delete incomplete multipart uploads");
- **launch (dry run)**: the first attempt of a launch as rendered, sent with ``DryRun=True``
  (``DryRunOperation`` is success); an ``UnauthorizedOperation`` is decoded with
  ``sts:DecodeAuthorizationMessage`` where the driver may.

Every check runs under the driver's identity with the shipped driver policy and
``policies/doctor-policy.json`` (its read-only additions).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from prefect_sgpu import catalog

Status = Literal["ok", "warn", "fail", "skip"]

#: the sessions a run's shape is rendered for, in the dry run (never a real run's id)
DOCTOR_RUN_ID = "sgpu-doctor-dry-run"
ENCODED = re.compile(r"Encoded authorization failure message:\s*(\S+)")


@dataclass
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


def error_text(exc: BaseException) -> str:
    """``Code: message`` of an AWS error, else the exception's type and message."""
    from prefect_sgpu.aws import error_of

    code, message = error_of(exc)
    return f"{code}: {message}" if code else f"{type(exc).__name__}: {message}"


def addresses_per_node(instance_type: str) -> int:
    """Private addresses one node takes in its subnet: one per network interface the request gives it."""
    known = catalog.instance_type_by_name(instance_type)
    return max(1, known.efa_interfaces if known else 0)


def abort_rule_for(rules: list[dict[str, Any]], prefix: str) -> dict[str, Any] | None:
    """The first enabled rule of a bucket's lifecycle ``rules`` that aborts incomplete multipart uploads
    of every key under ``prefix`` (a prefix ending in "/", or "" for the whole bucket), else None.
    A rule covers the prefix when its own prefix (``Filter.Prefix``, ``Filter.And.Prefix`` or the
    older top-level ``Prefix``; none: the whole bucket) starts it, and it filters by nothing else
    (a tag or size filter leaves uploads out: an upload has no tags until it completes)."""
    for rule in rules:
        if rule.get("Status") != "Enabled" or not rule.get("AbortIncompleteMultipartUpload"):
            continue
        found = rule.get("Filter")
        if found is None:
            found = {"Prefix": rule.get("Prefix", "")}
        conditions = dict(found.get("And") or found)
        rule_prefix = conditions.pop("Prefix", "") or ""
        if any(v not in (None, "", [], {}) for v in conditions.values()):
            continue
        if prefix.startswith(rule_prefix):
            return rule
    return None


def self_rule(permissions: list[dict[str, Any]], group_id: str) -> bool:
    """Whether ``permissions`` hold an all-protocol rule naming ``group_id`` itself."""
    return any(p.get("IpProtocol") == "-1" and any(pair.get("GroupId") == group_id
                                                   for pair in p.get("UserIdGroupPairs", []))
               for p in permissions)


class AccountChecks:
    """The checks above, mixed into :class:`prefect_sgpu.compute.ec2.doctor.Doctor` (which gives
    ``settings``, ``identity``, ``client``, ``subnets`` and ``principal``)."""

    settings: Any
    identity: dict[str, Any] | None

    def client(self, service: str) -> Any:  # pragma: no cover - the Doctor's
        raise NotImplementedError

    def subnets(self) -> list[dict[str, Any]]:  # pragma: no cover - the Doctor's
        raise NotImplementedError

    def principal(self) -> str | None:  # pragma: no cover - the Doctor's
        raise NotImplementedError

    def launch_checks(self, instance_type: catalog.InstanceType | None, nodes: int) -> list[Check]:
        return [self.security_group(), self.ebs_key(), self.subnet_addresses(instance_type, nodes),
                self.subnet_egress(instance_type), self.shared_profile(), self.job_role_key(),
                self.dry_run_launch(instance_type, nodes)]

    def simulate(self, actions: list[str], resource: str, context: dict[str, str]) -> list[str]:
        """The actions of ``actions`` on ``resource`` the driver's own policies refuse (as IAM's policy
        simulator says; a resource's own policy, such as a key policy, is not part of it)."""
        principal = self.principal()
        if principal is None:
            return []
        entries = [{"ContextKeyName": k, "ContextKeyValues": [v],
                    "ContextKeyType": "boolean" if v in ("true", "false") else "string"} for k, v in context.items()]
        results = self.client("iam").simulate_principal_policy(
            PolicySourceArn=principal, ActionNames=actions, ResourceArns=[resource],
            ContextEntries=entries)["EvaluationResults"]
        return [f"{r['EvalActionName']} ({r['EvalDecision']})" for r in results if r["EvalDecision"] != "allowed"]

    # -- one check each -----------------------------------------------------------------

    def security_group(self) -> Check:
        group = self.settings.security_group_id
        if not group:
            return Check("security group", "skip", "no security_group_id: each run creates a group that admits "
                         "only itself")
        try:
            (found,) = self.client("ec2").describe_security_groups(GroupIds=[group])["SecurityGroups"]
        except Exception as exc:  # noqa: BLE001
            return Check("security group", "fail", f"{group}: {error_text(exc)}",
                         "a security group of the subnets' VPC")
        missing = [way for way, rules in (("inbound", found.get("IpPermissions", [])),
                                          ("outbound", found.get("IpPermissionsEgress", [])))
                   if not self_rule(rules, group)]
        if missing:
            fix = " && ".join(
                f"aws ec2 authorize-security-group-{'ingress' if way == 'inbound' else 'egress'} --group-id {group} "
                f"--ip-permissions 'IpProtocol=-1,UserIdGroupPairs=[{{GroupId={group}}}]'" for way in missing)
            return Check("security group", "fail", f"{group} lacks the all-traffic rule to itself "
                         f"({' and '.join(missing)}): nodes cannot reach each other, EFA does not start", fix)
        return Check("security group", "ok", f"{group} admits all traffic from and to itself")

    def ebs_key(self) -> Check:
        ec2 = self.client("ec2")
        try:
            by_default = ec2.get_ebs_encryption_by_default()["EbsEncryptionByDefault"]
            key = ec2.get_ebs_default_kms_key_id()["KmsKeyId"]
        except Exception as exc:  # noqa: BLE001
            return Check("EBS key", "warn", f"the account's default EBS key is unknown: {error_text(exc)}",
                         "allow ec2:GetEbsEncryptionByDefault and ec2:GetEbsDefaultKmsKeyId (doctor-policy.json)")
        where = f"default EBS encryption {'on' if by_default else 'off'}, key {key}"
        if key.endswith("alias/aws/ebs"):
            return Check("EBS key", "ok", f"{where} (AWS managed)")
        try:
            meta = self.client("kms").describe_key(KeyId=key)["KeyMetadata"]
        except Exception as exc:  # noqa: BLE001
            return Check("EBS key", "fail", f"{where}: {error_text(exc)}",
                         "allow kms:DescribeKey, or set the default EBS key to one the driver can use "
                         "(aws ec2 modify-ebs-default-kms-key-id)")
        if meta.get("KeyManager") == "AWS":
            return Check("EBS key", "ok", f"{where} (AWS managed)")
        if meta.get("KeyState", "Enabled") != "Enabled":
            return Check("EBS key", "fail", f"{where} is {meta.get('KeyState')}: every volume fails to encrypt",
                         "enable the key, or aws ec2 reset-ebs-default-kms-key-id")
        try:
            refused = self.simulate(["kms:CreateGrant", "kms:GenerateDataKeyWithoutPlaintext", "kms:Decrypt",
                                     "kms:DescribeKey"], meta["Arn"],
                                    {"kms:ViaService": f"ec2.{self.settings.region}.amazonaws.com",
                                     "kms:GrantIsForAWSResource": "true"})
        except Exception as exc:  # noqa: BLE001
            return Check("EBS key", "warn", f"{where}: cannot simulate the driver's policies: {error_text(exc)}",
                         "allow iam:SimulatePrincipalPolicy on the driver's own identity")
        if refused:
            statement = {"Effect": "Allow", "Action": ["kms:CreateGrant", "kms:GenerateDataKeyWithoutPlaintext",
                                                       "kms:Decrypt", "kms:DescribeKey"], "Resource": meta["Arn"],
                         "Condition": {"StringEquals": {"kms:ViaService": f"ec2.{self.settings.region}.amazonaws.com"}}}
            return Check("EBS key", "fail", f"{where} is a customer managed key the driver may not use: "
                         + "; ".join(refused) + " (instances would launch, then terminate while pending)",
                         "add to the driver's policy " + json.dumps(statement) + " (and let the key policy "
                         "delegate to IAM), or set the default EBS key back: aws ec2 reset-ebs-default-kms-key-id")
        return Check("EBS key", "ok", f"{where}: the driver may use it through EC2 (by its IAM policies)")

    def subnet_addresses(self, instance_type: catalog.InstanceType | None, nodes: int) -> Check:
        if instance_type is None or not self.settings.subnet_ids:
            return Check("subnet addresses", "skip", "needs --gpu-type and subnet_ids")
        try:
            subnets = self.subnets()
        except Exception as exc:  # noqa: BLE001 - the region check names a bad subnet
            return Check("subnet addresses", "skip", f"subnets unknown: {error_text(exc)}")
        per_node = addresses_per_node(instance_type.name)
        needed = nodes * per_node
        free = {n["SubnetId"]: int(n.get("AvailableIpAddressCount", 0)) for n in subnets}
        short = {sid: count for sid, count in free.items() if count < needed}
        shape = f"{nodes} x {instance_type.name} take {needed} address(es) ({per_node} a node)"
        counts = ", ".join(f"{sid}: {count} free" for sid, count in free.items())
        if len(short) == len(free):
            return Check("subnet addresses", "fail", f"{shape}; {counts}",
                         "a larger subnet (a /22 or wider for multi-node EFA jobs), or fewer nodes")
        if short:
            return Check("subnet addresses", "warn", f"{shape}; {counts}: the launch skips "
                         + ", ".join(short), "a larger subnet, or drop it from subnet_ids")
        return Check("subnet addresses", "ok", f"{shape}; {counts}")

    def subnet_egress(self, instance_type: catalog.InstanceType | None) -> Check:
        """A multi-NIC type gets no public IPv4: its subnets need NAT, or S3 and SSM endpoints
        (:mod:`prefect_sgpu.compute.ec2.egress`)."""
        from prefect_sgpu.compute.ec2 import egress

        if instance_type is None or not self.settings.subnet_ids:
            return Check("subnet egress", "skip", "needs --gpu-type and subnet_ids")
        interfaces = addresses_per_node(instance_type.name)
        if interfaces <= 1:
            return Check("subnet egress", "ok", f"{instance_type.name} has one network interface: a public IPv4 "
                         "address where the subnet assigns one")
        try:
            found = {n["SubnetId"]: egress.way_out(self.client("ec2"), self.settings.region, n["SubnetId"],
                                                   n["VpcId"], self._nodes_build()) for n in self.subnets()}
        except Exception as exc:  # noqa: BLE001
            return Check("subnet egress", "fail", f"could not read the subnets' routes: {error_text(exc)}",
                         "ec2:DescribeRouteTables and ec2:DescribeVpcEndpoints (doctor-policy.json)")
        shape = f"{instance_type.name} has {interfaces} network interfaces, so no public IPv4"
        detail = f"{shape}; " + "; ".join(f"{sid}: {what}" for sid, (_, what) in found.items())
        bad = [sid for sid, (ok, _) in found.items() if not ok]
        if len(bad) == len(found):
            return Check("subnet egress", "fail", detail, egress.fixes(self.settings.region))
        if bad:
            return Check("subnet egress", "warn", detail, f"the launch skips {', '.join(bad)}: "
                         + egress.fixes(self.settings.region))
        return Check("subnet egress", "ok", detail)

    def _nodes_build(self) -> bool:  # pragma: no cover - the Doctor's
        raise NotImplementedError

    def shared_profile(self) -> Check:
        profile = self.settings.instance_profile
        if not profile:
            return Check("shared profile", "skip", "no instance_profile")
        name = profile.rsplit("/", 1)[-1]
        try:
            roles = self.client("iam").get_instance_profile(InstanceProfileName=name)["InstanceProfile"]["Roles"]
        except Exception as exc:  # noqa: BLE001
            return Check("shared profile", "fail", f"instance profile {profile}: {error_text(exc)}",
                         f"create it: prefect-sgpu setup aws --instance-profile {name}")
        if not roles:
            return Check("shared profile", "fail", f"instance profile {profile} holds no role: nodes get no "
                         "credentials", f"aws iam add-role-to-instance-profile --instance-profile-name {name} "
                         "--role-name ROLE")
        role = roles[0]["Arn"]
        try:
            refused = self.simulate(["iam:PassRole"], role, {"iam:PassedToService": "ec2.amazonaws.com"})
        except Exception as exc:  # noqa: BLE001
            return Check("shared profile", "warn", f"cannot simulate the driver's policies: {error_text(exc)}",
                         "allow iam:SimulatePrincipalPolicy on the driver's own identity")
        if refused:
            return Check("shared profile", "fail", f"the driver may not pass {role} to EC2: " + "; ".join(refused),
                         "render the driver policy with shared_profile_role_arn (prefect-sgpu setup aws "
                         f"--instance-profile {name} does)")
        return Check("shared profile", "ok", f"{profile}: the driver may pass its role {role} to EC2")

    def job_role_key(self) -> Check:
        from prefect_sgpu.compute.ec2 import roles
        from prefect_sgpu.protocol.jobfolder import ssm_key_parameter
        from prefect_sgpu.store import store_scope

        s = self.settings
        if not s.job_roles:
            return Check("job role key", "skip", "no job_roles")
        if s.kms_key_id:
            return Check("job role key", "skip", f"the job key is under the store's key {s.kms_key_id}")
        if not s.node_permissions_boundary or not s.store_uri:
            return Check("job role key", "skip", "needs node_permissions_boundary and store_uri")
        assert self.identity is not None
        account, scope = self.identity["Account"], store_scope(s.store_uri)
        iam = self.client("iam")
        try:
            version = iam.get_policy(PolicyArn=s.node_permissions_boundary)["Policy"]["DefaultVersionId"]
            boundary = iam.get_policy_version(PolicyArn=s.node_permissions_boundary,
                                              VersionId=version)["PolicyVersion"]["Document"]
            # DescribeKey on the alias creates the AWS managed key if the account has none yet
            key = self.client("kms").describe_key(KeyId="alias/aws/ssm")["KeyMetadata"]["Arn"]
        except Exception as exc:  # noqa: BLE001
            return Check("job role key", "fail", f"{s.node_permissions_boundary} or the aws/ssm key: "
                         f"{error_text(exc)}", "create the boundary: prefect-sgpu setup aws")
        run = DOCTOR_RUN_ID
        policy = roles.node_policy(run, s.region, account, [f"{s.store_uri.rstrip('/')}/{run}"], scope)
        parameter = f"arn:{roles.partition(s.region)}:ssm:{s.region}:{account}:parameter{ssm_key_parameter(run, scope)}"
        try:
            results = iam.simulate_custom_policy(
                PolicyInputList=[json.dumps(policy)], PermissionsBoundaryPolicyInputList=[
                    boundary if isinstance(boundary, str) else json.dumps(boundary)],
                ActionNames=["kms:Decrypt"], ResourceArns=[key], ContextEntries=[
                    {"ContextKeyName": "kms:ViaService", "ContextKeyValues": [f"ssm.{s.region}.amazonaws.com"],
                     "ContextKeyType": "string"},
                    {"ContextKeyName": "kms:EncryptionContext:PARAMETER_ARN", "ContextKeyValues": [parameter],
                     "ContextKeyType": "string"}])["EvaluationResults"]
        except Exception as exc:  # noqa: BLE001
            return Check("job role key", "warn", f"cannot simulate a job role's policies: {error_text(exc)}",
                         "allow iam:SimulateCustomPolicy (doctor-policy.json)")
        if any(r["EvalDecision"] != "allowed" for r in results):
            return Check("job role key", "fail", f"a job role under {s.node_permissions_boundary} may not decrypt "
                         f"its key through SSM (kms:Decrypt on {key}): its nodes cannot read the job key",
                         "update the boundary to the shipped node-boundary.json (prefect-sgpu setup aws)")
        return Check("job role key", "ok", f"a job role under {s.node_permissions_boundary} decrypts its own "
                     f"SSM parameters through SSM ({key})")

    def dry_run_launch(self, instance_type: catalog.InstanceType | None, nodes: int) -> Check:
        from prefect_sgpu.compute.ec2 import request as rq
        from prefect_sgpu.spec import Plan

        s = self.settings
        if instance_type is None or not s.store_uri:
            return Check("launch (dry run)", "skip", "needs --gpu-type and a store")
        left_out = ["the placement group (created at launch)"]
        try:
            image_id, root = self.image_of()
            plan = Plan(nodes=nodes, procs_per_node=instance_type.gpus, device="cuda", instance_type=instance_type)
            params = rq.run_instances_request(s, DOCTOR_RUN_ID, plan, "#!/bin/sh\n", rq.expiry(s.ttl_minutes),
                                              image_id=image_id, root_device=root,
                                              extra_tags=rq.run_tags(s.store_uri.rstrip("/"), s.heartbeat_ttl))
        except Exception as exc:  # noqa: BLE001
            return Check("launch (dry run)", "skip", f"the request cannot be rendered: {error_text(exc)}")
        params.pop("Placement", None)
        params.pop("ClientToken", None)
        placeholder = rq.created_group_placeholder_of(params)
        if placeholder:
            left_out.append("the run's security group (created at launch)")
            params.pop("SecurityGroupIds", None)
            for nic in params.get("NetworkInterfaces", []):
                nic.pop("Groups", None)
        if s.job_roles:
            left_out.append("the job role's profile (created at launch)")
            params.pop("IamInstanceProfile", None)
        shape = f"{nodes} x {instance_type.name} ({params.get('SubnetId') or 'default subnet'})"
        try:
            self.client("ec2").run_instances(DryRun=True, **params)
        except Exception as exc:  # noqa: BLE001
            from prefect_sgpu.aws import error_of

            code, message = error_of(exc)
            if code == "DryRunOperation":
                return Check("launch (dry run)", "ok", f"{shape}: EC2 would accept it; left out: "
                             + ", ".join(left_out))
            if code == "UnauthorizedOperation":
                return Check("launch (dry run)", "fail", f"{shape}: {self.decoded(message)}",
                             "the driver policy for this store (prefect-sgpu setup aws), and with a shared "
                             "profile its role")
            return Check("launch (dry run)", "fail", f"{shape}: {code}: {message}", "see docs/troubleshooting.md")
        return Check("launch (dry run)", "warn", f"{shape}: EC2 answered a dry run without DryRunOperation")

    def store_lifecycle(self) -> Check:
        """A warning, with the fix, when the store's bucket has no rule aborting its incomplete uploads."""
        from prefect_sgpu.aws import error_code
        from prefect_sgpu.compute.ec2.roles import s3_location
        from prefect_sgpu.compute.ec2.setup import LIFECYCLE_RULE_ID

        s = self.settings
        if not s.store_uri:
            return Check("store lifecycle", "skip", "needs store_uri")
        bucket, prefix = s3_location(s.store_uri)
        where = f"s3://{bucket}/{prefix}"
        rule = {"ID": LIFECYCLE_RULE_ID, "Status": "Enabled", "Filter": {"Prefix": prefix},
                "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 7}}
        fix = (f"prefect-sgpu setup aws --store {s.store_uri.rstrip('/')} --region {s.region} adds the rule and keeps "
               f"the bucket's others; or add this rule to the bucket's lifecycle configuration ("
               f"put-bucket-lifecycle-configuration replaces every rule: include the ones it has): "
               f"{json.dumps(rule)}")
        try:
            rules = self.client("s3").get_bucket_lifecycle_configuration(Bucket=bucket).get("Rules", [])
        except Exception as exc:  # noqa: BLE001
            if error_code(exc) != "NoSuchLifecycleConfiguration":
                return Check("store lifecycle", "warn", f"s3://{bucket}: the lifecycle rules could not be read: "
                             f"{error_text(exc)}", "allow s3:GetLifecycleConfiguration on the bucket (the shipped "
                             "doctor policy grants it)")
            rules = []
        found = abort_rule_for(rules, prefix)
        if found is None:
            have = f"{len(rules)} lifecycle rule(s), none" if rules else "no lifecycle rule"
            return Check("store lifecycle", "warn", f"s3://{bucket} has {have} aborting incomplete multipart uploads "
                         f"under {where}: the parts of an upload a reclaim cut off (a pack, a checkpoint) are "
                         "billed until someone aborts it", fix)
        days = found["AbortIncompleteMultipartUpload"].get("DaysAfterInitiation")
        return Check("store lifecycle", "ok", f"rule {found.get('ID') or '(no ID)'} aborts multipart uploads under "
                     f"{where} left incomplete {days} day(s)")

    def image_of(self) -> tuple[str, str]:  # pragma: no cover - the Doctor's
        raise NotImplementedError

    def decoded(self, message: str) -> str:
        """``message`` with its encoded authorization failure decoded (action, resource, and whether an
        explicit deny matched), or as it is when there is none or the driver may not decode it."""
        found = ENCODED.search(message)
        if not found:
            return message
        try:
            text = self.client("sts").decode_authorization_message(EncodedMessage=found.group(1))["DecodedMessage"]
            decoded = json.loads(text)
        except Exception as exc:  # noqa: BLE001
            return f"{message[:found.start()].strip()} (not decoded: {error_text(exc)})"
        context = decoded.get("context", {})
        how = "an explicit Deny" if decoded.get("explicitDeny") else "no policy allows it"
        return (f"refused {context.get('action')} on {context.get('resource')} ({how}; conditions "
                f"{json.dumps(context.get('conditions', {}), sort_keys=True)})")
