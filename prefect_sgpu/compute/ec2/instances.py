"""EC2 provisioning: one gang of GPU instances per run, placed together, always cleaned up.

Why it looks the way it does:

- **One ``run_instances`` per attempt with ``MinCount=MaxCount=nodes``** in a cluster
  placement group: a multi-node job is useless with part of its nodes, and EC2 then
  either places the whole gang or none of it.
- **Failover** walks the configured subnets (one per availability zone) in order, then
  on to on-demand when ``fallback_to_on_demand`` is set, but only for capacity errors;
  anything else (permissions, a bad AMI, quotas) is raised at once because another
  zone would fail the same way.
- **Throttling** is botocore's job: every client uses its ``standard``/``adaptive``
  retry mode. A retried ``run_instances`` carries the same ``ClientToken`` (one per run
  and attempt), so a lost response never launches a second gang.
- **Cleanup by tag**: every resource carries ``sgpu:run-id``; :meth:`EC2Provisioner.terminate`
  finds instances by id *and* by that tag, so it also cleans up after a driver that
  crashed between launch and bookkeeping.
- **No secrets reach the instances**: nodes use the instance profile and IMDSv2; the
  rendered request is checked for the caller's AWS keys and the Prefect API key.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError, WaiterError

from prefect_sgpu import catalog
from prefect_sgpu.compute.ec2.settings import EC2Settings
from prefect_sgpu.errors import JobCancelled, LaunchTimeout, ProvisioningError, SGPUConfigError

logger = logging.getLogger("prefect_sgpu.compute.ec2.instances")

RUN_ID_TAG = "sgpu:run-id"
OWNER_TAG = "sgpu:owner"
TTL_TAG = "sgpu:ttl"
MARKET_TAG = "sgpu:market"
#: errors that say "no room here right now": worth another zone or market
CAPACITY_ERRORS = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientCapacity",
        "InsufficientHostCapacity",
        "InsufficientReservedInstanceCapacity",
        "ReservationCapacityExceeded",
        "InsufficientFreeAddressesInSubnet",
        "SpotMaxPriceTooLow",
        "MaxSpotInstanceCountExceeded",
        "Unsupported",  # the instance type is not offered in this availability zone
    }
)
DEFAULT_ROOT_DEVICE = "/dev/sda1"  # Ubuntu Deep Learning AMIs
SG_DELETE_TIMEOUT_S = 180.0
MIN_SECRET_LEN = 12  # AWS key ids are 20 characters, secrets 40: shorter strings are not keys

Progress = Callable[[str], None] | None


@dataclass
class Instance:
    """One launched node, as the rest of the EC2 compute needs it."""

    id: str
    private_ip: str
    subnet_id: str
    availability_zone: str
    launch_index: int
    instance_type: str
    market: str  # "spot" | "on-demand" | "reserved"


@dataclass
class Attempt:
    """One ``run_instances`` try and why it failed."""

    subnet_id: str
    availability_zone: str
    market: str
    error_code: str
    message: str

    def __str__(self) -> str:
        return (
            f"{self.subnet_id} ({self.availability_zone}, {self.market}): {self.error_code}: {self.message}"
        )


class EC2Provisioner:
    """Launches, waits for and terminates one run's instances (see the module docstring)."""

    def __init__(self, settings: EC2Settings, session: Any | None = None) -> None:
        self.settings = settings
        self._session = session
        self._clients: dict[str, Any] = {}
        self._launched: dict[str, set[str]] = {}
        self._expiry: dict[str, str] = {}

    # -- boto3 ---------------------------------------------------------------------

    @property
    def session(self) -> Any:
        if self._session is None:
            import boto3

            self._session = boto3.Session(region_name=self.settings.region)
        return self._session

    def client(self, service: str) -> Any:
        """A client whose every call is retried by botocore on throttling and 5xx."""
        if service not in self._clients:
            from botocore.config import Config

            config = Config(
                retries={"mode": self.settings.retry_mode, "max_attempts": self.settings.max_attempts},
                user_agent_extra="prefect-sgpu",
            )
            self._clients[service] = self.session.client(
                service,
                region_name=self.settings.region,
                endpoint_url=self.settings.endpoint_url or None,
                config=config,
            )
        return self._clients[service]

    # -- the request ---------------------------------------------------------------

    def instance_type_for(self, plan: Any) -> str:
        """The block's override for the plan's GPU type, else the catalog's instance type."""
        itype = getattr(plan, "instance_type", None)
        if itype is None:
            raise SGPUConfigError(
                "instance_type", None, "a remote plan with an instance type from the catalog"
            )
        for acc in catalog.CATALOG.values():
            if itype in acc.instance_types:
                override = self.settings.instance_types.get(acc.name)
                if override:
                    known = catalog.instance_type_by_name(override)
                    if known is not None and known.gpus != plan.procs_per_node:
                        raise SGPUConfigError(
                            f"instance_types[{acc.name}]",
                            override,
                            f"an instance type with {plan.procs_per_node} GPUs per node (the plan's), "
                            f"{override} has {known.gpus}",
                        )
                    return override
        return itype.name

    def efa_interfaces(self, instance_type: str) -> int:
        known = catalog.instance_type_by_name(instance_type)
        return known.efa_interfaces if known else 0

    def tags(self, run_id: str, market: str | None = None) -> list[dict[str, str]]:
        if run_id not in self._expiry:  # one expiry per run: every retry sends identical tags
            expiry = _dt.datetime.now(_dt.timezone.utc) + _dt.timedelta(minutes=self.settings.ttl_minutes)
            self._expiry[run_id] = expiry.strftime("%Y-%m-%dT%H:%M:%SZ")
        values = {
            "Name": f"sgpu-{run_id}",
            RUN_ID_TAG: run_id,
            OWNER_TAG: self.settings.owner_name,
            TTL_TAG: self._expiry[run_id],
            **self.settings.tags,
        }
        if market:
            values[MARKET_TAG] = market
        return [{"Key": k, "Value": str(v)} for k, v in values.items()]

    def client_token(self, run_id: str, attempt: int) -> str:
        """Same run and attempt, same token: a retried launch returns the first one."""
        digest = hashlib.sha256(f"{run_id}:{attempt}".encode()).hexdigest()[:40]
        return f"sgpu-{digest}"

    def run_instances_request(
        self,
        run_id: str,
        plan: Any,
        user_data: str,
        subnet_id: str | None = None,
        market: str | None = None,
        *,
        attempt: int = 0,
        image_id: str | None = None,
        security_group_id: str | None = None,
        root_device: str = DEFAULT_ROOT_DEVICE,
    ) -> dict[str, Any]:
        """The exact keyword arguments of one ``run_instances`` call.

        Without ``image_id`` the AMI is EC2's own ``resolve:ssm:`` reference to the SSM
        parameter; without a security group it names the group provisioning creates.
        """
        s = self.settings
        market = market or s.markets()[0]
        if market not in ("spot", "on-demand", "reserved"):
            raise SGPUConfigError("market", market, "one of spot, on-demand, reserved")
        subnet_id = subnet_id or (s.subnet_ids[0] if s.subnet_ids else None)
        itype = self.instance_type_for(plan)
        sg = security_group_id or s.security_group_id or f"<created: sgpu-{run_id}>"
        tags = self.tags(run_id, market)
        resource_types = ["instance", "volume", "network-interface"]
        if market == "spot":
            resource_types.append("spot-instances-request")
        request: dict[str, Any] = {
            "ImageId": image_id or s.ami_id or f"resolve:ssm:{s.ami_ssm_parameter}",
            "InstanceType": itype,
            "MinCount": plan.nodes,
            "MaxCount": plan.nodes,
            "ClientToken": self.client_token(run_id, attempt),
            "UserData": user_data,
            "Placement": {"GroupName": self.placement_group_name(run_id)},
            "MetadataOptions": {
                "HttpTokens": "required",
                "HttpEndpoint": "enabled",
                "HttpPutResponseHopLimit": 2,
            },
            "BlockDeviceMappings": [
                {
                    "DeviceName": root_device,
                    "Ebs": {
                        "VolumeSize": s.volume_size_gb,
                        "VolumeType": "gp3",
                        "DeleteOnTermination": True,
                        "Encrypted": True,
                    },
                }
            ],
            "InstanceInitiatedShutdownBehavior": "terminate",
            "TagSpecifications": [{"ResourceType": rt, "Tags": tags} for rt in resource_types],
        }
        if s.instance_profile:
            key = "Arn" if s.instance_profile.startswith("arn:") else "Name"
            request["IamInstanceProfile"] = {key: s.instance_profile}
        efa = self.efa_interfaces(itype)
        if efa:
            request["NetworkInterfaces"] = [
                {
                    "DeviceIndex": 0 if card == 0 else 1,
                    "NetworkCardIndex": card,
                    **({"SubnetId": subnet_id} if subnet_id else {}),
                    "Groups": [sg],
                    "InterfaceType": "efa",
                    "DeleteOnTermination": True,
                }
                for card in range(efa)
            ]
        else:
            if subnet_id:
                request["SubnetId"] = subnet_id
            request["SecurityGroupIds"] = [sg]
        if market == "spot":
            request["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"},
            }
        elif market == "reserved":
            if not s.capacity_reservation_id:
                raise SGPUConfigError(
                    "capacity_reservation_id", None, "a capacity reservation id for market='reserved'"
                )
            request["CapacityReservationSpecification"] = {
                "CapacityReservationTarget": {"CapacityReservationId": s.capacity_reservation_id}
            }
        self._refuse_secrets(request)
        return request

    def placement_group_name(self, run_id: str) -> str:
        return f"sgpu-{run_id}"

    def _refuse_secrets(self, request: dict[str, Any]) -> None:
        """Fail if the caller's AWS keys or the Prefect API key would reach the instances."""
        text = json.dumps(request)
        for name, secret in self._secrets():
            if len(secret) >= MIN_SECRET_LEN and secret in text:
                raise SGPUConfigError(
                    "user_data/tags",
                    "<redacted>",
                    f"no credentials: the request contains the {name}; nodes get AWS access from "
                    "the instance profile and never need the Prefect API key",
                )

    def _secrets(self) -> list[tuple[str, str]]:
        found = [
            ("AWS access key id", os.environ.get("AWS_ACCESS_KEY_ID", "")),
            ("AWS secret access key", os.environ.get("AWS_SECRET_ACCESS_KEY", "")),
            ("AWS session token", os.environ.get("AWS_SESSION_TOKEN", "")),
            ("Prefect API key", os.environ.get("PREFECT_API_KEY", "")),
        ]
        try:
            from prefect.settings import PREFECT_API_KEY

            value = PREFECT_API_KEY.value()
            value = value.get_secret_value() if hasattr(value, "get_secret_value") else value
            found.append(("Prefect API key", str(value or "")))
        except Exception:  # prefect settings unavailable: the env var was checked above
            logger.debug("could not read PREFECT_API_KEY from Prefect settings", exc_info=True)
        try:
            creds = self.session.get_credentials()
        except BotoCoreError:  # no usable credentials configured: nothing to leak
            creds = None
        if creds is not None:
            frozen = creds.get_frozen_credentials()
            found += [
                ("AWS access key id", frozen.access_key or ""),
                ("AWS secret access key", frozen.secret_key or ""),
                ("AWS session token", frozen.token or ""),
            ]
        return found

    # -- provisioning --------------------------------------------------------------

    def provision(self, run_id: str, plan: Any, user_data: str, progress: Progress = None,
                  should_stop: Callable[[], bool] | None = None) -> list[Instance]:
        """Launch ``plan.nodes`` instances as one gang, failing over as configured.

        Returns the running instances sorted by launch index. On any failure, and when
        ``should_stop()`` turns true before they run (``JobCancelled``), every resource
        of the run is cleaned up before the error propagates.
        """
        stop = should_stop or (lambda: False)
        say = progress or (lambda message: None)
        self.settings.require_launchable()
        itype = self.instance_type_for(plan)
        markets = self.settings.markets()
        self.run_instances_request(run_id, plan, user_data)  # shape and secrets, before any call
        subnets = self._describe_subnets()
        plan_attempts = [(m, sub) for m in markets for sub in self.settings.subnet_ids]
        if "reserved" in markets:
            zone = self._reservation_zone(itype)
            plan_attempts = [
                (m, sub)
                for m, sub in plan_attempts
                if m != "reserved" or subnets[sub]["AvailabilityZone"] == zone
            ]
            if not any(m == "reserved" for m, _ in plan_attempts):
                raise SGPUConfigError(
                    "subnet_ids",
                    self.settings.subnet_ids,
                    f"a subnet in {zone}, the zone of capacity reservation "
                    f"{self.settings.capacity_reservation_id}",
                )
        image_id, root_device = self._image()
        try:
            sg = self.settings.security_group_id or self._create_security_group(run_id, subnets)
            self._create_placement_group(run_id)
            tried: list[Attempt] = []
            for number, (market, subnet_id) in enumerate(plan_attempts):
                if stop():
                    raise JobCancelled(f"run {run_id} was cancelled while provisioning")
                zone = subnets[subnet_id]["AvailabilityZone"]
                request = self.run_instances_request(
                    run_id,
                    plan,
                    user_data,
                    subnet_id,
                    market,
                    attempt=number,
                    image_id=image_id,
                    security_group_id=sg,
                    root_device=root_device,
                )
                say(f"run_instances {plan.nodes} x {itype} in {subnet_id} ({zone}), {market}")
                try:
                    response = self.client("ec2").run_instances(**request)
                except ClientError as exc:
                    code, message = _error_of(exc)
                    if code not in CAPACITY_ERRORS:
                        raise ProvisioningError(
                            f"run_instances failed in {subnet_id} ({zone}, {market}) with "
                            f"{code or type(exc).__name__}: {message}. "
                            "Not retried in other zones: this is not a capacity error."
                        ) from exc
                    tried.append(Attempt(subnet_id, zone, market, code, message))
                    say(f"no capacity in {subnet_id} ({zone}, {market}): {code}")
                    logger.info("run %s: %s", run_id, tried[-1])
                    continue
                ids = [i["InstanceId"] for i in response["Instances"]]
                self._launched.setdefault(run_id, set()).update(ids)
                say(f"launched {', '.join(ids)} in {zone}; waiting for running")
                return self._wait_running(run_id, ids, market, stop)
            error = ProvisioningError(
                f"could not launch {plan.nodes} x {itype} for run {run_id}; tried "
                f"{len(tried)} subnet/market combination(s):\n" + "\n".join(f"  - {a}" for a in tried)
            )
            error.attempts = [asdict(a) for a in tried]  # type: ignore[attr-defined]
            raise error
        except BaseException:
            try:
                self.terminate(run_id)
            except Exception:  # keep the launch error; the failed cleanup is logged
                logger.exception("cleanup of run %s after a failed launch failed", run_id)
            raise

    def _describe_subnets(self) -> dict[str, dict[str, Any]]:
        try:
            found = self.client("ec2").describe_subnets(SubnetIds=list(self.settings.subnet_ids))["Subnets"]
        except ClientError as exc:
            code, message = _error_of(exc)
            if code.startswith("InvalidSubnet"):
                raise SGPUConfigError(
                    "subnet_ids",
                    self.settings.subnet_ids,
                    f"subnets that exist in {self.settings.region} ({message})",
                ) from None
            raise
        by_id = {s["SubnetId"]: s for s in found}
        if len({s["VpcId"] for s in found}) > 1 and not self.settings.security_group_id:
            raise SGPUConfigError(
                "subnet_ids",
                self.settings.subnet_ids,
                "subnets of one VPC (the security group created for the nodes lives in one VPC)",
            )
        return by_id

    def _reservation_zone(self, instance_type: str) -> str:
        """The capacity reservation's zone, after checking it can hold this launch."""
        rid = self.settings.capacity_reservation_id
        allowed = (
            f"an active capacity reservation for {instance_type} in {self.settings.region} "
            "that this account can use"
        )
        try:
            found = self.client("ec2").describe_capacity_reservations(CapacityReservationIds=[rid])
        except ClientError as exc:
            code, message = _error_of(exc)
            if code.startswith("InvalidCapacityReservationId"):
                raise SGPUConfigError("capacity_reservation_id", rid, allowed, hint=message) from None
            raise
        (reservation,) = found["CapacityReservations"]
        if reservation.get("State") != "active":
            raise SGPUConfigError(
                "capacity_reservation_id", rid, allowed, hint=f"it is {reservation.get('State')}"
            )
        if reservation.get("InstanceType") != instance_type:
            raise SGPUConfigError(
                "capacity_reservation_id", rid, allowed, hint=f"it holds {reservation.get('InstanceType')}"
            )
        return reservation["AvailabilityZone"]

    def _image(self) -> tuple[str, str]:
        """The AMI id (resolved from SSM when not given) and its root device name."""
        s = self.settings
        image_id = s.ami_id
        if not image_id:
            try:
                image_id = self.client("ssm").get_parameter(Name=s.ami_ssm_parameter)["Parameter"]["Value"]
            except ClientError as exc:
                code, message = _error_of(exc)
                if code == "ParameterNotFound":
                    raise SGPUConfigError(
                        "ami_ssm_parameter",
                        s.ami_ssm_parameter,
                        f"an SSM parameter in {s.region} that names an AMI, or set ami_id",
                    ) from None
                raise ProvisioningError(
                    f"could not read SSM parameter {s.ami_ssm_parameter}: {code}: {message}"
                ) from exc
        try:
            images = self.client("ec2").describe_images(ImageIds=[image_id])["Images"]
        except ClientError as exc:
            code, message = _error_of(exc)
            if code.startswith("InvalidAMIID"):
                images = []
            else:
                raise
        if not images:
            raise SGPUConfigError(
                "ami_id", image_id, f"an AMI that exists in {s.region} and this account can launch"
            )
        return image_id, images[0].get("RootDeviceName") or DEFAULT_ROOT_DEVICE

    def _create_security_group(self, run_id: str, subnets: dict[str, dict[str, Any]]) -> str:
        """A group that admits only its own members: rendezvous, NCCL and EFA traffic."""
        ec2 = self.client("ec2")
        vpc_id = next(iter(subnets.values()))["VpcId"]
        name = f"sgpu-{run_id}"
        try:
            group_id = ec2.create_security_group(
                GroupName=name,
                Description=f"prefect-sgpu nodes of run {run_id}; admits only itself",
                VpcId=vpc_id,
                TagSpecifications=[{"ResourceType": "security-group", "Tags": self.tags(run_id)}],
            )["GroupId"]
        except ClientError as exc:
            if _error_of(exc)[0] != "InvalidGroup.Duplicate":
                raise
            group_id = ec2.describe_security_groups(
                Filters=[{"Name": "group-name", "Values": [name]}, {"Name": "vpc-id", "Values": [vpc_id]}]
            )["SecurityGroups"][0]["GroupId"]
            return group_id
        itself = [
            {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group_id, "Description": "sgpu nodes"}]}
        ]
        ec2.authorize_security_group_ingress(GroupId=group_id, IpPermissions=itself)
        ec2.authorize_security_group_egress(GroupId=group_id, IpPermissions=itself)  # EFA needs it explicitly
        return group_id

    def _create_placement_group(self, run_id: str) -> None:
        try:
            self.client("ec2").create_placement_group(
                GroupName=self.placement_group_name(run_id),
                Strategy="cluster",
                TagSpecifications=[{"ResourceType": "placement-group", "Tags": self.tags(run_id)}],
            )
        except ClientError as exc:
            if _error_of(exc)[0] != "InvalidPlacementGroup.Duplicate":
                raise

    def _wait_running(self, run_id: str, ids: list[str], market: str,
                      should_stop: Callable[[], bool] = lambda: False) -> list[Instance]:
        """botocore's ``instance_running`` waiter, one poll at a time so a cancel is seen between polls."""
        ec2 = self.client("ec2")
        delay = self.settings.waiter_delay_s
        waiter = ec2.get_waiter("instance_running")
        attempts = max(1, math.ceil(self.settings.running_timeout_s / delay))
        for attempt in range(1, attempts + 1):
            try:
                waiter.wait(InstanceIds=ids, WaiterConfig={"Delay": delay, "MaxAttempts": 1})
                break
            except WaiterError as exc:
                if "Max attempts exceeded" not in str(exc):  # a terminal state: not coming up
                    states = self._states(ids)
                    raise ProvisioningError(
                        f"run {run_id}: instances stopped before running (spot reclaimed or launch failure): "
                        f"{states}"
                    ) from exc
                if attempt == attempts:
                    raise LaunchTimeout(run_id, self.settings.running_timeout_s, phase="provisioning") from exc
            pause_until = time.monotonic() + delay
            while time.monotonic() < pause_until:
                if should_stop():
                    raise JobCancelled(f"run {run_id} was cancelled while its instances started")
                time.sleep(min(0.5, max(0.0, pause_until - time.monotonic())))
        instances = []
        for page in ec2.get_paginator("describe_instances").paginate(InstanceIds=ids):
            for reservation in page["Reservations"]:
                for inst in reservation["Instances"]:
                    instances.append(
                        Instance(
                            id=inst["InstanceId"],
                            private_ip=inst.get("PrivateIpAddress", ""),
                            subnet_id=inst.get("SubnetId", ""),
                            availability_zone=inst.get("Placement", {}).get("AvailabilityZone", ""),
                            launch_index=int(inst.get("AmiLaunchIndex", 0)),
                            instance_type=inst["InstanceType"],
                            market=market,
                        )
                    )
        return sorted(instances, key=lambda i: (i.launch_index, i.id))

    def _states(self, ids: list[str]) -> dict[str, str]:
        states = {}
        for page in self.client("ec2").get_paginator("describe_instances").paginate(InstanceIds=ids):
            for reservation in page["Reservations"]:
                for inst in reservation["Instances"]:
                    reason = inst.get("StateReason", {}).get("Message", "")
                    states[inst["InstanceId"]] = inst["State"]["Name"] + (f" ({reason})" if reason else "")
        return states

    # -- cleanup -------------------------------------------------------------------

    def terminate(self, run_id: str) -> None:
        """Terminate the run's instances (by id and by tag), wait, then delete its groups.

        Idempotent: a second call, or a call for a run that never launched, does nothing
        harmful. Only groups tagged with the run id are deleted, never a given one.
        """
        ec2 = self.client("ec2")
        ids = set(self._launched.get(run_id, ())) | set(self._live_by_tag(run_id))
        if ids:
            live = self._terminate_ids(sorted(ids))
            if live:
                ec2.get_waiter("instance_terminated").wait(
                    InstanceIds=live,
                    WaiterConfig={
                        "Delay": self.settings.waiter_delay_s,
                        "MaxAttempts": max(
                            1, math.ceil(self.settings.running_timeout_s / self.settings.waiter_delay_s)
                        ),
                    },
                )
        self._launched.pop(run_id, None)
        run_filter = [{"Name": f"tag:{RUN_ID_TAG}", "Values": [run_id]}]
        for group in ec2.describe_placement_groups(Filters=run_filter).get("PlacementGroups", []):
            try:
                ec2.delete_placement_group(GroupName=group["GroupName"])
            except ClientError as exc:
                if _error_of(exc)[0] != "InvalidPlacementGroup.Unknown":
                    raise
        for group in ec2.describe_security_groups(Filters=run_filter).get("SecurityGroups", []):
            if group["GroupId"] != self.settings.security_group_id:
                self._delete_security_group(group["GroupId"])

    def _live_by_tag(self, run_id: str) -> list[str]:
        filters = [
            {"Name": f"tag:{RUN_ID_TAG}", "Values": [run_id]},
            {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]},
        ]
        found = []
        for page in self.client("ec2").get_paginator("describe_instances").paginate(Filters=filters):
            for reservation in page["Reservations"]:
                found.extend(i["InstanceId"] for i in reservation["Instances"])
        return found

    def _terminate_ids(self, ids: list[str]) -> list[str]:
        """Terminate ``ids``; an id EC2 no longer knows is already gone. Returns those terminated."""
        ec2 = self.client("ec2")
        remaining = list(ids)
        while remaining:
            try:
                ec2.terminate_instances(InstanceIds=remaining)
                return remaining
            except ClientError as exc:
                code, message = _error_of(exc)
                if code != "InvalidInstanceID.NotFound":
                    raise
                gone = {i for i in remaining if i in message}
                if not gone:
                    raise
                remaining = [i for i in remaining if i not in gone]
        return []

    def _delete_security_group(self, group_id: str) -> None:
        """Delete, waiting out the minutes AWS may take to detach terminated instances' ENIs."""
        ec2 = self.client("ec2")
        deadline = time.monotonic() + SG_DELETE_TIMEOUT_S
        while True:
            try:
                ec2.delete_security_group(GroupId=group_id)
                return
            except ClientError as exc:
                code = _error_of(exc)[0]
                if code == "InvalidGroup.NotFound":
                    return
                if code != "DependencyViolation" or time.monotonic() > deadline:
                    raise
                time.sleep(5)

    # -- money ---------------------------------------------------------------------

    def cost(self, instances: list[Instance], started: float, ended: float) -> dict[str, Any]:
        """Instance-hours and an estimate in USD at the catalog's on-demand list prices.

        Spot usually costs less and a capacity reservation is paid whether used or not,
        so the USD figure is an upper bound for spot and the marginal cost for reserved.
        """
        hours = max(0.0, ended - started) / 3600.0
        per_instance = []
        usd = 0.0
        unknown = []
        for inst in instances:
            known = catalog.instance_type_by_name(inst.instance_type)
            price = known.price_per_hour if known else None
            if price is None:
                unknown.append(inst.instance_type)
            else:
                usd += price * hours
            per_instance.append(
                {
                    "id": inst.id,
                    "instance_type": inst.instance_type,
                    "market": inst.market,
                    "usd_per_hour": price,
                }
            )
        return {
            "instance_hours": round(hours * len(instances), 6),
            "usd": round(usd, 6),
            "usd_per_hour": round(sum(p["usd_per_hour"] or 0.0 for p in per_instance), 4),
            "price_source": "catalog on-demand list price (us-east-1)",
            "unpriced_instance_types": sorted(set(unknown)),
            "instances": per_instance,
        }


def _error_of(exc: BaseException) -> tuple[str, str]:
    """(AWS error code, message) of a botocore ClientError; ('', str) otherwise."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error", {})
        return str(err.get("Code", "")), str(err.get("Message", ""))
    return "", str(exc)


__all__ = ["CAPACITY_ERRORS", "Attempt", "EC2Provisioner", "EC2Settings", "Instance"]
