"""IAM authorization in front of moto, per resource, for the identities a test names.

Moto 5.2 can enforce IAM (``INITIAL_NO_AUTH_ACTION_COUNT``), but it authorizes SSM and EC2
calls by action only (the resource is always ``*``) and evaluates one condition operator,
so it cannot tell job A's SSM parameter or instance from job B's. This gate does what AWS
does for the calls prefect-sgpu makes: it finds who signed a request (an IAM user's access
key, or the temporary key of an assumed role, looked up in moto's own IAM and STS state),
names the action (``ssm:GetParameter``) and every resource it touches (the parameter's,
object's, bucket's, instance's, security or placement group's, role's ARN; for a call that creates
EC2 resources, each resource it creates and each it uses, and ``ec2:CreateTags`` on what it tags at
creation) with the condition keys AWS sets (``ec2:ResourceTag/<key>`` from the resource's tags,
``aws:RequestTag/<key>`` and ``ec2:CreateAction`` from the request, ``s3:prefix``,
``iam:PermissionsBoundary`` (the new role's, or the edited role's own), ``iam:PassedToService``), and evaluates the identity's policies
and permissions boundary with AWS's rules: an explicit Deny wins, else an Allow is needed
for every resource, and a boundary must allow too. A request it refuses gets the service's
own AccessDenied error; every other request reaches moto unchanged.

Only identities the gate was told about are judged (``watch_role``/``watch_user``): the
test's admin keys and everyone else pass, as before.

IAM is eventually consistent: a role's new policy takes effect some seconds after it is written (AWS IAM
docs, "Troubleshoot IAM" / "Changes that I make are not always immediately visible"). With
``propagation_s`` set, a watched role whose policy was written (CreateRole, PutRolePolicy,
AttachRolePolicy, PutRolePermissionsBoundary through the proxy) less than that many seconds ago, read
on ``clock`` (a test's virtual or scaled clock), is refused everything, as a role whose new policy is not
yet visible is.
"""

from __future__ import annotations

import fnmatch
import json
import re
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

ACCOUNT = "123456789012"  # moto's default account
#: a bucket's sub-resources whose IAM action is not ``s3:GetBucket<Name>`` (Service Authorization Reference,
#: "Actions, resources, and condition keys for Amazon S3": GetBucketLifecycleConfiguration needs
#: s3:GetLifecycleConfiguration, PutBucketLifecycleConfiguration s3:PutLifecycleConfiguration)
BUCKET_SUBRESOURCE_ACTIONS = {("GET", "lifecycle"): "s3:GetLifecycleConfiguration",
                              ("PUT", "lifecycle"): "s3:PutLifecycleConfiguration"}


@dataclass
class Decision:
    action: str
    resource: str
    identity: str
    context: dict[str, list[str]] | None = None


def _match(pattern: str, value: str, case: bool = True) -> bool:
    if not case:
        pattern, value = pattern.lower(), value.lower()
    return fnmatch.fnmatchcase(value, pattern.replace("[", "[[]"))


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _condition_holds(condition: dict[str, dict[str, Any]], context: dict[str, list[str]]) -> bool:
    for operator, pairs in condition.items():
        for key, expected in pairs.items():
            actual = context.get(key)
            if operator == "Null":
                if (actual is None) != (str(expected).lower() == "true"):
                    return False
                continue
            if actual is None:
                return False  # AWS: a missing key fails every operator but Null (and ...IfExists)
            wants = [str(e) for e in _as_list(expected)]
            if operator == "StringEquals":
                ok = any(a == w for a in actual for w in wants)
            elif operator in ("StringLike", "ArnLike"):
                ok = any(_match(w, a) for a in actual for w in wants)
            elif operator in ("StringNotEquals",):
                ok = all(a != w for a in actual for w in wants)
            else:
                raise AssertionError(f"the IAM gate does not evaluate the {operator} operator")
            if not ok:
                return False
    return True


def evaluate(documents: list[dict[str, Any]], action: str, resource: str,
             context: dict[str, list[str]]) -> str:
    """"deny", "allow" or "neutral" for one action on one resource, over ``documents``."""
    allowed = False
    for doc in documents:
        for statement in _as_list(doc.get("Statement", [])):
            if "Action" in statement:
                concerned = any(_match(a, action, case=False) for a in _as_list(statement["Action"]))
            else:
                concerned = not any(_match(a, action, case=False) for a in _as_list(statement["NotAction"]))
            if not concerned:
                continue
            if not any(_match(r, resource) for r in _as_list(statement.get("Resource", "*"))):
                continue
            if "Condition" in statement and not _condition_holds(statement["Condition"], context):
                continue
            if statement["Effect"] == "Deny":
                return "deny"
            allowed = True
    return "allow" if allowed else "neutral"


_EC2_KINDS = {"i": "instance", "vol": "volume", "sg": "security-group", "eni": "network-interface",
              "pg": "placement-group", "ami": "image", "subnet": "subnet", "vpc": "vpc"}


def _tagged(tags: dict[str, str]) -> dict[str, list[str]]:
    return {f"ec2:ResourceTag/{k}": [v] for k, v in tags.items()}


def _request_tags(params: dict[str, str], resource_type: str | None) -> dict[str, list[str]]:
    """``aws:RequestTag/<key>`` of the tags a request sets: those of its TagSpecification of
    ``resource_type`` (a creating call), or its ``Tag.N`` (CreateTags)."""
    tags: dict[str, str] = {}
    if resource_type is None:
        n = 1
        while f"Tag.{n}.Key" in params:
            tags[params[f"Tag.{n}.Key"]] = params.get(f"Tag.{n}.Value", "")
            n += 1
    else:
        n = 1
        while f"TagSpecification.{n}.ResourceType" in params:
            if params[f"TagSpecification.{n}.ResourceType"] == resource_type:
                m = 1
                while f"TagSpecification.{n}.Tag.{m}.Key" in params:
                    tags[params[f"TagSpecification.{n}.Tag.{m}.Key"]] = params.get(f"TagSpecification.{n}.Tag.{m}.Value", "")
                    m += 1
            n += 1
    return {f"aws:RequestTag/{k}": [v] for k, v in tags.items()}


class IAMGate:
    """Judges requests of watched identities; see the module docstring."""

    def __init__(self, region: str = "us-east-1") -> None:
        self.region = region
        #: a placement group's tags by name (the fault proxy keeps placement groups: moto has none)
        self.placement_group_tags: Any = None
        self.roles: set[str] = set()
        self.users: set[str] = set()
        self.denied: list[Decision] = []
        #: (identity, action) of every call of a watched identity that was allowed
        self.allowed: set[tuple[str, str]] = set()
        #: seconds after a role's policy is written before it takes effect (0: at once)
        self.propagation_s = 0.0
        #: the clock ``propagation_s`` is counted on (a monotonic time in seconds)
        self.clock: Any = time.monotonic
        #: role name -> when its policy was last written, on ``clock``
        self.written: dict[str, float] = {}
        #: when True, ``ssm:GetParameter`` with decryption of a SecureString also needs ``kms:Decrypt`` on
        #: the parameter's key, as SSM asks KMS on the caller's behalf (``kms:ViaService`` and the
        #: ``PARAMETER_ARN`` encryption context set); off by default. Source: "How AWS Systems Manager
        #: Parameter Store uses AWS KMS", https://docs.aws.amazon.com/kms/latest/developerguide/services-parameter-store.html
        self.kms_via_ssm = False
        #: when True, an EC2 refusal carries an "Encoded authorization failure message", which
        #: ``sts:DecodeAuthorizationMessage`` (:meth:`decode`) turns back into the refused action, resource
        #: and context; off by default. Source: https://docs.aws.amazon.com/STS/latest/APIReference/API_DecodeAuthorizationMessage.html
        self.encode_ec2_messages = False
        #: when True, a KMS call naming a key (``KeyId``) is judged on that key's ARN, an alias resolved
        #: to the key it names, as IAM does: an alias ARN in a policy's Resource never matches a call on
        #: the key ("Using aliases to control access to KMS keys",
        #: https://docs.aws.amazon.com/kms/latest/developerguide/alias-authorization.html); an alias
        #: that names no key goes to KMS, which answers NotFoundException. Off by default (KMS calls are
        #: judged on ``*``).
        self.kms_resources = False
        self._encoded: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def watch_role(self, name: str) -> None:
        with self._lock:
            self.roles.add(name)

    def watch_roles_matching(self, pattern: str) -> None:
        with self._lock:
            self.roles.add(pattern)

    def watch_user(self, name: str) -> None:
        with self._lock:
            self.users.add(name)

    # -- identity and policies, from moto's own state --------------------------------

    @staticmethod
    def _iam() -> Any:
        from moto.iam.models import iam_backends

        return iam_backends[ACCOUNT]["aws"]

    def _identity(self, access_key: str) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]] | None:
        """(name, identity policies, boundary policies) of a watched identity, else None."""
        from moto.sts.models import sts_backends

        iam = self._iam()
        with self._lock:
            roles, users = set(self.roles), set(self.users)
        for assumed in list(sts_backends[ACCOUNT]["aws"].assumed_roles):
            if assumed.access_key_id == access_key:
                name = assumed.role_arn.split("/")[-1]
                if not any(_match(p, name) for p in roles):
                    return None
                try:
                    role = iam.get_role(name)
                except Exception:  # noqa: BLE001 - the role was deleted: nothing allows anything
                    return f"role/{name}", [], []
                docs = [json.loads(d) if isinstance(d, str) else d for d in role.policies.values()]
                docs += [self._managed(p) for p in role.managed_policies.values()]
                boundary = [self._managed(iam.get_policy(role.permissions_boundary_arn))] \
                    if role.permissions_boundary_arn else []
                return f"role/{name}", docs, boundary
        for user in list(iam.users.values()):
            if user.name in users and any(k.access_key_id == access_key for k in user.access_keys):
                docs = [json.loads(d) if isinstance(d, str) else d for d in user.policies.values()]
                docs += [self._managed(p) for p in user.managed_policies.values()]
                return f"user/{user.name}", docs, []
        return None

    @staticmethod
    def _managed(policy: Any) -> dict[str, Any]:
        doc = next(v.document for v in policy.versions if v.is_default)
        return json.loads(doc) if isinstance(doc, str) else doc

    # -- what a request does -----------------------------------------------------------

    def _arn(self, service: str, resource: str, region: bool = True, account: str = ACCOUNT) -> str:
        return f"arn:aws:{service}:{self.region if region else ''}:{account}:{resource}"

    def _instance_tags(self, instance_id: str) -> dict[str, str]:
        from moto.ec2.models import ec2_backends

        try:
            inst = ec2_backends[ACCOUNT][self.region].get_instance(instance_id)
        except Exception:  # noqa: BLE001 - an unknown instance has no tags (EC2 refuses it itself)
            return {}
        return {t["key"]: t["value"] for t in inst.get_tags()}

    def _parameter_key_arn(self, name: str) -> str | None:
        """The ARN of the KMS key a SecureString is encrypted under (the AWS-managed ``alias/aws/ssm`` key
        when it names none); None for a parameter that is not a SecureString or does not exist."""
        from moto.kms.models import kms_backends
        from moto.ssm.models import ssm_backends

        try:
            versions = ssm_backends[ACCOUNT][self.region]._parameters[name]
            parameter = versions[-1]
        except Exception:  # noqa: BLE001 - SSM answers ParameterNotFound itself
            return None
        if parameter.parameter_type != "SecureString":
            return None
        key = parameter.keyid or "alias/aws/ssm"
        if key.startswith("arn:") and ":key/" in key:
            return key
        kms = kms_backends[ACCOUNT][self.region]
        if key.startswith("alias/") or ":alias/" in key:
            key = kms.get_key_id_from_alias(key.split(":")[-1]) or key
        return self._arn("kms", f"key/{key}")

    def _kms_key_arn(self, key: str) -> str | None:
        """The ARN of the key ``key`` names (a key id or ARN, an alias name or ARN); None for an alias
        that names no key."""
        from moto.kms.models import kms_backends

        if key.startswith("arn:") and ":key/" in key:
            return key
        if key.startswith("alias/") or ":alias/" in key:
            found = kms_backends[ACCOUNT][self.region].get_key_id_from_alias("alias/" + key.split(":alias/")[-1]
                                                                            if ":alias/" in key else key)
            return self._arn("kms", f"key/{found}") if found else None
        return self._arn("kms", f"key/{key}")

    def _group_tags(self, group_id: str) -> dict[str, str]:
        from moto.ec2.models import ec2_backends

        try:
            group = ec2_backends[ACCOUNT][self.region].get_security_group_from_id(group_id)
        except Exception:  # noqa: BLE001 - unknown: EC2 refuses it itself
            return {}
        return {t["key"]: t["value"] for t in group.get_tags()} if group is not None else {}

    #: the calls that create resources, and the resources each one authorizes: (type, tags from the
    #: request's TagSpecifications of that type, or None: an existing resource the request names)
    _CREATES = ("RunInstances", "CreateSecurityGroup", "CreatePlacementGroup")

    def _create_needs(self, action: str, params: dict[str, str]) -> list[tuple[str, str, dict[str, list[str]]]]:
        """As EC2 authorizes a call that creates resources: the action on every resource it creates
        (with ``aws:RequestTag/*`` of that resource's tag specification) and on every resource it uses,
        and ``ec2:CreateTags`` (with ``ec2:CreateAction``) on every resource it tags at creation."""
        region_arn = self._arn
        created: list[str] = []
        used: list[str] = []
        if action == "RunInstances":
            created = ["instance", "volume"]
            if params.get("InstanceMarketOptions.MarketType") == "spot":
                created.append("spot-instances-request")
            image = params.get("ImageId", "")
            used.append(f"arn:aws:ec2:{self.region}::image/{image}")
            for key, value in sorted(params.items()):
                if key == "SubnetId" or key.endswith(".SubnetId"):
                    used.append(region_arn("ec2", f"subnet/{value}"))
                elif key.startswith("SecurityGroupId.") or ".SecurityGroupId." in key:
                    used.append(region_arn("ec2", f"security-group/{value}"))
                elif key == "Placement.GroupName":
                    used.append(region_arn("ec2", f"placement-group/{value}"))
                elif key == "CapacityReservationSpecification.CapacityReservationTarget.CapacityReservationId":
                    used.append(region_arn("ec2", f"capacity-reservation/{value}"))
            used.append(region_arn("ec2", "network-interface/*"))
        elif action == "CreateSecurityGroup":
            created = ["security-group"]
            if params.get("VpcId"):
                used.append(region_arn("ec2", f"vpc/{params['VpcId']}"))
        else:
            created = ["placement-group"]
        out = [(f"ec2:{action}", region_arn("ec2", f"{kind}/*"), _request_tags(params, kind)) for kind in created]
        out += [(f"ec2:{action}", arn, {}) for arn in dict.fromkeys(used)]
        tagged_kinds = {params[k] for k in params if k.startswith("TagSpecification.") and k.endswith(".ResourceType")}
        out += [("ec2:CreateTags", region_arn("ec2", f"{kind}/*"),
                 {**_request_tags(params, kind), "ec2:CreateAction": [action]}) for kind in sorted(tagged_kinds)]
        return out

    def _iam_arn(self, kind: str, name: str, path: str | None) -> str:
        """``arn:aws:iam::<account>:<kind><path><name>``, the path read from moto's IAM when not given."""
        if path is None:
            read = self._iam().get_role if kind == "role" else self._iam().get_instance_profile
            try:
                path = read(name).path
            except Exception:  # noqa: BLE001 - not made (yet): the default path
                path = "/"
        return f"arn:aws:iam::{ACCOUNT}:{kind}{path}{name}"

    def _role_arn(self, name: str, path: str | None = None) -> str:
        return self._iam_arn("role", name, path)

    def _profile_arn(self, name: str, path: str | None = None) -> str:
        return self._iam_arn("instance-profile", name, path)

    def requests(self, method: str, path: str, headers: dict[str, str], body: bytes,
                 service: str, action: str, params: dict[str, str]) -> list[tuple[str, str, dict[str, list[str]]]]:
        """(action, resource ARN, condition context) for everything one request needs."""
        if service.startswith("json:"):
            prefix = {"AmazonSSM": "ssm", "TrentService": "kms", "ServiceQuotasV20190624": "servicequotas",
                      "AWSPriceListService": "pricing"}.get(
                service[5:], service[5:].lower())
            name = params.get("Name", "")
            if prefix == "ssm" and not name and params.get("ResourceType") == "Parameter":
                name = params.get("ResourceId", "")  # tagging calls name the parameter so
            if prefix == "ssm" and name:
                owner = "" if name.startswith("/aws/") else ACCOUNT
                arn = self._arn("ssm", "parameter" + (name if name.startswith("/") else "/" + name), account=owner)
                if action == "PutParameter" and params.get("Tags"):  # tags at creation need the tagging right too
                    return [(f"ssm:{action}", arn, {}), ("ssm:AddTagsToResource", arn, {})]
                if action == "GetParameter" and self.kms_via_ssm and params.get("WithDecryption") == "true":
                    key = self._parameter_key_arn(name)
                    if key:
                        return [(f"ssm:{action}", arn, {}), ("kms:Decrypt", key, {
                            "kms:ViaService": [f"ssm.{self.region}.amazonaws.com"],
                            "kms:EncryptionContext:PARAMETER_ARN": [arn], "kms:CallerAccount": [ACCOUNT]})]
                return [(f"ssm:{action}", arn, {})]
            if prefix == "kms" and self.kms_resources and params.get("KeyId"):
                key = self._kms_key_arn(str(params["KeyId"]))
                return [(f"kms:{action}", key, {})] if key else []
            return [(f"{prefix}:{action}", "*", {})]
        if service == "rest":
            return self._s3(method, path, headers, body)
        if service == "ec2":
            ids = [v for k, v in sorted(params.items()) if k.startswith("InstanceId.")]
            if action in ("TerminateInstances", "GetConsoleOutput"):
                ids = ids or [params.get("InstanceId", "")]
                return [(f"ec2:{action}", self._arn("ec2", f"instance/{iid}"), _tagged(self._instance_tags(iid)))
                        for iid in ids]
            if action in ("AuthorizeSecurityGroupIngress", "AuthorizeSecurityGroupEgress", "DeleteSecurityGroup"):
                group = params.get("GroupId", "")
                return [(f"ec2:{action}", self._arn("ec2", f"security-group/{group}"),
                         _tagged(self._group_tags(group)))]
            if action == "DeletePlacementGroup":
                name = params.get("GroupName", "")
                tags = self.placement_group_tags(name) if self.placement_group_tags else {}
                return [(f"ec2:{action}", self._arn("ec2", f"placement-group/{name}"), _tagged(tags))]
            if action == "CreateTags":  # tags on what exists: no ec2:CreateAction
                resources = [v for k, v in sorted(params.items()) if k.startswith("ResourceId.")]
                return [(f"ec2:{action}", self._arn("ec2", f"{_EC2_KINDS.get(r.split('-')[0], 'resource')}/{r}"),
                         _request_tags(params, None)) for r in resources]
            needs = self._create_needs(action, params) if action in self._CREATES else [(f"ec2:{action}", "*", {})]
            profile = params.get("IamInstanceProfile.Name") or params.get("IamInstanceProfile.Arn", "").split("/")[-1]
            if action == "RunInstances" and profile:
                try:
                    role = self._iam().get_instance_profile(profile).roles[0].name
                    needs.append(("iam:PassRole", self._role_arn(role),
                                  {"iam:PassedToService": ["ec2.amazonaws.com"]}))
                except Exception:  # noqa: BLE001 - moto refuses the unknown profile itself
                    pass
            return needs
        if service == "iam":
            context: dict[str, list[str]] = {}
            if action == "CreateRole":
                context["iam:PermissionsBoundary"] = [params["PermissionsBoundary"]] \
                    if params.get("PermissionsBoundary") else []
                if not context["iam:PermissionsBoundary"]:
                    del context["iam:PermissionsBoundary"]
            elif action in ("PutRolePolicy", "DeleteRolePolicy", "AttachRolePolicy", "DetachRolePolicy") \
                    and params.get("RoleName"):
                try:  # AWS sets the key from the role's own boundary for edits of its policies
                    boundary = self._iam().get_role(params["RoleName"]).permissions_boundary_arn
                except Exception:  # noqa: BLE001 - an unknown role: IAM refuses it itself
                    boundary = None
                if boundary:
                    context["iam:PermissionsBoundary"] = [boundary]
            if "InstanceProfileName" in params:
                arn = self._profile_arn(params["InstanceProfileName"], params.get("Path") if action.startswith(
                    "Create") else None)
            elif "RoleName" in params:
                arn = self._role_arn(params["RoleName"], params.get("Path") if action == "CreateRole" else None)
            elif "PolicySourceArn" in params or "PolicyArn" in params:  # the simulated principal; a managed policy
                arn = params.get("PolicySourceArn") or params["PolicyArn"]
            else:
                arn = "*"
            return [(f"iam:{action}", arn, context)]
        if service == "sts":
            return [] if action == "GetCallerIdentity" else [(f"sts:{action}", "*", {})]
        return [(f"{service}:{action}", "*", {})]

    def _s3(self, method: str, path: str, headers: dict[str, str],
            body: bytes) -> list[tuple[str, str, dict[str, list[str]]]]:
        parts = urlsplit(path)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        bucket, _, key = unquote(parts.path).lstrip("/").partition("/")
        bucket_arn = f"arn:aws:s3:::{bucket}"
        if not key:
            named = BUCKET_SUBRESOURCE_ACTIONS.get((method, next(iter(query), "")))
            if named:
                return [(named, bucket_arn, {})]
            if method == "POST" and "delete" in query:
                keys = [el.text or "" for el in ET.fromstring(body).iter() if el.tag.endswith("Key")]
                return [("s3:DeleteObject", f"{bucket_arn}/{k}", {}) for k in keys]
            if method in ("GET", "HEAD") and not ({"location", "versioning", "acl", "policy"} & set(query)):
                return [("s3:ListBucket", bucket_arn, {"s3:prefix": [query.get("prefix", "")]})]
            if method == "PUT":
                return [("s3:CreateBucket", bucket_arn, {})]
            return [("s3:GetBucket" + next(iter(query), "").capitalize(), bucket_arn, {})]
        object_arn = f"{bucket_arn}/{key}"
        if method in ("GET", "HEAD"):
            return [("s3:GetObject", object_arn, {})]
        if method == "DELETE":
            return [("s3:AbortMultipartUpload" if "uploadId" in query else "s3:DeleteObject", object_arn, {})]
        needs = [("s3:PutObject", object_arn, {})]
        source = {k.lower(): v for k, v in headers.items()}.get("x-amz-copy-source")
        if source:
            needs.append(("s3:GetObject", f"arn:aws:s3:::{unquote(source).lstrip('/')}", {}))
        return needs

    # -- the check ---------------------------------------------------------------------

    def check(self, method: str, path: str, headers: dict[str, str], body: bytes, service: str, action: str,
              params: dict[str, str]) -> Decision | None:
        """The first refused (action, resource) of a watched identity's request, else None."""
        if service == "iam" and action in ("CreateRole", "PutRolePolicy", "AttachRolePolicy",
                                           "PutRolePermissionsBoundary") and params.get("RoleName"):
            with self._lock:
                self.written[params["RoleName"]] = self.clock()
        auth = {k.lower(): v for k, v in headers.items()}.get("authorization", "")
        found = re.search(r"Credential=([A-Z0-9]+)/", auth)
        if not found:
            return None
        who = self._identity(found.group(1))
        if who is None:
            return None
        name, docs, boundary = who
        if self.propagation_s and name.startswith("role/"):
            with self._lock:
                written = self.written.get(name[len("role/"):])
            if written is not None and self.clock() - written < self.propagation_s:
                docs = []  # its policy is not visible yet
        for needed, resource, context in self.requests(method, path, headers, body, service, action, params):
            verdict = evaluate(docs, needed, resource, context)
            if verdict == "allow" and boundary:
                verdict = evaluate(boundary, needed, resource, context)
            if verdict != "allow":
                decision = Decision(needed, resource, name, context)
                with self._lock:
                    self.denied.append(decision)
                return decision
            with self._lock:
                self.allowed.add((name, needed))
        return None


def encode_refusal(gate: IAMGate, decision: Decision, context: dict[str, list[str]]) -> str:
    """A token standing for ``decision`` as EC2 encodes it (opaque to the caller; :func:`decode_answer`
    reads it back)."""
    import base64
    import uuid as _uuid

    token = base64.urlsafe_b64encode(_uuid.uuid4().bytes + _uuid.uuid4().bytes).decode().rstrip("=")
    with gate._lock:
        gate._encoded[token] = {
            "allowed": False, "explicitDeny": False, "matchedStatements": {"items": []}, "failures": {"items": []},
            "context": {"principal": {"arn": f"arn:aws:iam::{ACCOUNT}:{decision.identity}"},
                        "action": decision.action, "resource": decision.resource,
                        "conditions": {"items": [{"key": k, "values": {"items": [{"value": v} for v in vs]}}
                                                 for k, vs in sorted(context.items())]}}}
    return token


def decode_answer(gate: IAMGate | None, params: dict[str, str]) -> tuple[int, bytes]:
    """STS's ``DecodeAuthorizationMessage`` for a token of :func:`encode_refusal` (moto has none)."""
    from xml.sax.saxutils import escape

    found = gate._encoded.get(params.get("EncodedMessage", "")) if gate is not None else None
    if found is None:
        return 400, ('<ErrorResponse><Error><Type>Sender</Type><Code>InvalidAuthorizationMessageException</Code>'
                     "<Message>The message is not an encoded authorization message of this account.</Message>"
                     "</Error><RequestId>0</RequestId></ErrorResponse>").encode()
    return 200, ('<DecodeAuthorizationMessageResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
                 f"<DecodeAuthorizationMessageResult><DecodedMessage>{escape(json.dumps(found))}</DecodedMessage>"
                 "</DecodeAuthorizationMessageResult><ResponseMetadata><RequestId>0</RequestId></ResponseMetadata>"
                 "</DecodeAuthorizationMessageResponse>").encode()


def _members(params: dict[str, str], prefix: str) -> list[str]:
    """The values of a query list parameter (``prefix.member.N``), in member order."""
    return [v for k, v in sorted(params.items(), key=lambda kv: _member_order(kv[0]))
            if re.fullmatch(rf"{re.escape(prefix)}\.member\.\d+", k)]


def _simulation(operation: str, params: dict[str, str], docs: list[dict[str, Any]],
                boundary: list[dict[str, Any]]) -> bytes:
    """IAM's answer to ``operation`` (SimulateCustomPolicy or SimulatePrincipalPolicy): each action on
    each resource of the request, under its context entries, through ``docs`` and then ``boundary``."""
    from xml.sax.saxutils import escape

    context: dict[str, list[str]] = {}
    for key in [k for k in params if re.fullmatch(r"ContextEntries\.member\.\d+\.ContextKeyName", k)]:
        context[params[key]] = _members(params, f"{key.rsplit('.', 1)[0]}.ContextKeyValues")
    out = []
    for action in _members(params, "ActionNames"):
        for resource in _members(params, "ResourceArns") or ["*"]:
            verdict = evaluate(docs, action, resource, context)
            if verdict == "allow" and boundary:
                verdict = evaluate(boundary, action, resource, context)
            decision = {"allow": "allowed", "deny": "explicitDeny"}.get(verdict, "implicitDeny")
            out.append(f"<member><EvalActionName>{escape(action)}</EvalActionName><EvalResourceName>"
                       f"{escape(resource)}</EvalResourceName><EvalDecision>{decision}</EvalDecision>"
                       "<MatchedStatements/><MissingContextValues/></member>")
    return (f'<{operation}Response xmlns="https://iam.amazonaws.com/doc/2010-05-08/">'
            f"<{operation}Result><IsTruncated>false</IsTruncated><EvaluationResults>"
            + "".join(out) + f"</EvaluationResults></{operation}Result><ResponseMetadata>"
            "<RequestId>7a62c49f-347e-4fc4-9331-6e8eEXAMPLE</RequestId></ResponseMetadata>"
            f"</{operation}Response>").encode()


def simulate_custom_policy(params: dict[str, str]) -> bytes:
    """IAM's ``SimulateCustomPolicy`` answered with :func:`evaluate` (moto 5.2 has none): the request's
    policies, then its permissions boundary policies, for each action on each resource under the
    request's context entries."""
    docs = [json.loads(d) for d in _members(params, "PolicyInputList")]
    boundary = [json.loads(d) for d in _members(params, "PermissionsBoundaryPolicyInputList")]
    return _simulation("SimulateCustomPolicy", params, docs, boundary)


def simulate_principal_policy(params: dict[str, str], region: str = "us-east-1") -> bytes:
    """IAM's ``SimulatePrincipalPolicy`` answered from moto's IAM state with :func:`evaluate`
    (moto 5.2 has no simulator): each action on each resource, under the request's context
    entries, through the principal's identity policies and its permissions boundary."""
    from moto.iam.models import iam_backends

    iam = iam_backends[ACCOUNT]["aws"]
    arn = params["PolicySourceArn"]
    kind, _, rest = arn.split(":", 5)[5].partition("/")
    name = rest.rsplit("/", 1)[-1]
    principal = iam.get_user(name) if kind == "user" else iam.get_role(name)
    docs = [json.loads(d) if isinstance(d, str) else d for d in principal.policies.values()]
    docs += [IAMGate._managed(p) for p in principal.managed_policies.values()]
    boundary_arn = getattr(principal, "permissions_boundary_arn", None) or getattr(
        principal, "permissions_boundary", None)
    boundary = [IAMGate._managed(iam.get_policy(boundary_arn))] if isinstance(boundary_arn, str) else []
    return _simulation("SimulatePrincipalPolicy", params, docs, boundary)


def _member_order(key: str) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in key.split(".")]


def outcome_of(call: Any) -> str:
    """"allowed", or the AWS error code ``call()`` raised (a probe's answer: AccessDenied, ...)."""
    try:
        call()
        return "allowed"
    except Exception as exc:  # noqa: BLE001 - the error code is the answer
        return getattr(exc, "response", {}).get("Error", {}).get("Code", type(exc).__name__)
