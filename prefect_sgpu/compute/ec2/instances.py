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

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from botocore.exceptions import ClientError, WaiterError

from prefect_sgpu import aws, catalog
from prefect_sgpu.aws import error_of as _error_of
from prefect_sgpu.compute.ec2 import request as rq
from prefect_sgpu.compute.ec2.request import (
    DEFAULT_ROOT_DEVICE,
    RUN_ID_TAG,
    LaunchAttempt,
)
from prefect_sgpu.compute.ec2.settings import EC2Settings
from prefect_sgpu.errors import JobCancelled, LaunchTimeout, ProvisioningError, SGPUConfigError

logger = logging.getLogger("prefect_sgpu.compute.ec2.instances")

#: errors that say "no room here right now": worth another zone or market
#: how long a launch waits for EC2 to see a job's new instance profile
PROFILE_PROPAGATION_S = 60.0
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
#: the regional vCPU quota of an instance family and market: run_instances says VcpuLimitExceeded when a
#: launch would pass it (Service Quotas, service "ec2"); the other zones of the region share it
VCPU_QUOTAS = {
    ("G and VT", "on-demand"): "L-DB2E81BA", ("G and VT", "spot"): "L-3819A6DF",
    ("P", "on-demand"): "L-417A185B", ("P", "spot"): "L-7212CCBC",
    ("Standard", "on-demand"): "L-1216C47A", ("Standard", "spot"): "L-34B43A08",
}
SG_DELETE_TIMEOUT_S = 180.0
#: instance states of an instance that will not run a job again
DEAD_STATES = ("shutting-down", "terminated", "stopping", "stopped")

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


def vcpu_quota_of(instance_type: str, market: str) -> tuple[str, str | None]:
    """(name, code or None where unknown here) of the Service Quotas quota an ``instance_type``
    launch in ``market`` counts against."""
    prefix = re.match(r"[a-z]+", instance_type.lower())
    family = prefix.group(0) if prefix else ""
    kind = {"g": "G and VT", "vt": "G and VT", "p": "P", "trn": "Trn", "inf": "Inf", "dl": "DL", "f": "F",
            "x": "X"}.get(family, "Standard")
    spot = market == "spot"
    name = f"All {kind} Spot Instance Requests" if spot else f"Running On-Demand {kind} instances"
    return name, VCPU_QUOTAS.get((kind, "spot" if spot else "on-demand"))


def vcpu_quota(instance_type: str, market: str) -> str:
    """The Service Quotas quota an ``instance_type`` launch in ``market`` counts against, by name and code."""
    name, code = vcpu_quota_of(instance_type, market)
    return f"EC2 quota \"{name}\"" + (f" ({code})" if code else "")


class EC2Provisioner:
    """Launches, waits for and terminates one run's instances (see the module docstring); the
    remote-node wing's provider (:class:`prefect_sgpu.compute.remote.provider.Provider`) on EC2."""

    #: instance states of a machine that will not run a job again
    dead_states = DEAD_STATES

    def __init__(self, settings: EC2Settings, session: Any | None = None,
                 run_tags: dict[str, str] | None = None) -> None:
        self.settings = settings
        #: tags every resource of every run gets besides the settings' own (store, heartbeat TTL)
        self.run_tags = dict(run_tags or {})
        self._session = session
        self._clients: dict[str, Any] = {}
        self._clients_lock = threading.Lock()  # boto3 sessions do not create clients thread-safely
        self._launched: dict[str, set[str]] = {}
        self._expiry: dict[str, str] = {}

    # -- boto3 ---------------------------------------------------------------------

    @property
    def session(self) -> Any:
        if self._session is None:
            self._session = aws.new_session(self.settings.region)
        return self._session

    def client(self, service: str) -> Any:
        """A client whose every call is retried by botocore on throttling and 5xx (:mod:`prefect_sgpu.aws`);
        one per service, shared by the compute, its leases and its sweeper."""
        with self._clients_lock:
            if service not in self._clients:
                self._clients[service] = aws.client(
                    service, self.session, self.settings.region, self.settings.endpoint_url,
                    retry_mode=self.settings.retry_mode, max_attempts=self.settings.max_attempts,
                )
            return self._clients[service]

    # -- what the compute, its leases and its sweeper read and delete -----------------

    def instance_states(self, ids: list[str], reasons: bool = False) -> dict[str, str]:
        """The state name of each instance id (empty ids skipped; with ``reasons``, EC2's state
        reason in brackets). An id EC2 no longer knows is long gone: every id reads ``terminated``
        then. Another failure is logged and reads as no states (the caller asks again)."""
        states: dict[str, str] = {}
        ids = [i for i in ids if i]
        try:
            for page in self.client("ec2").get_paginator("describe_instances").paginate(InstanceIds=ids) \
                    if ids else ():
                for inst in (i for r in page.get("Reservations", []) for i in r.get("Instances", [])):
                    reason = inst.get("StateReason", {}).get("Message", "") if reasons else ""
                    states[inst["InstanceId"]] = inst["State"]["Name"] + (f" ({reason})" if reason else "")
        except Exception as exc:  # noqa: BLE001 - an unknown id means the instance is long gone
            if aws.error_code(exc).startswith("InvalidInstanceID"):
                return {i: "terminated" for i in ids}
            logger.warning("describe_instances failed: %s", exc)
        return states

    def put_secret(self, name: str, value: str, description: str, kms_key_id: str | None = None) -> None:
        """An SSM SecureString (under ``kms_key_id`` when set), overwritten if it exists, tagged with the
        run's store (:attr:`run_tags`) from the moment it exists: a sweeper lists only its own store's
        parameters by that tag. SSM takes tags with a new parameter only, so one that exists already
        (a retried write) is overwritten, then tagged."""
        ssm = self.client("ssm")
        extra = {"KeyId": kms_key_id} if kms_key_id else {}
        tags = [{"Key": k, "Value": v} for k, v in self.run_tags.items()]
        if not tags:
            ssm.put_parameter(Name=name, Value=value, Type="SecureString", Overwrite=True,
                              Description=description, **extra)
            return
        try:
            ssm.put_parameter(Name=name, Value=value, Type="SecureString", Description=description, Tags=tags,
                              **extra)
        except Exception as exc:  # noqa: BLE001 - only "already there" is answered here
            if aws.error_code(exc) != "ParameterAlreadyExists":
                raise
            ssm.put_parameter(Name=name, Value=value, Type="SecureString", Overwrite=True,
                              Description=description, **extra)
            ssm.add_tags_to_resource(ResourceType="Parameter", ResourceId=name, Tags=tags)

    def delete_secret(self, name: str) -> bool:
        """Delete the SSM parameter ``name`` (a job's or a lease's key); False when it was not
        there. Another failure is logged, not raised: the sweeper deletes it later."""
        try:
            self.client("ssm").delete_parameter(Name=name)
            return True
        except Exception as exc:  # noqa: BLE001
            if aws.error_code(exc) != "ParameterNotFound":
                logger.warning("could not delete SSM parameter %s: %s", name, exc)
            return False

    # -- the request (built by prefect_sgpu.compute.ec2.request) -------------------

    def instance_type_for(self, plan: Any) -> str:
        return rq.instance_type_for(self.settings, plan)

    def expiry(self, run_id: str) -> str:
        """One expiry per run: every retry and every resource carries identical tags."""
        if run_id not in self._expiry:
            self._expiry[run_id] = rq.expiry(self.settings.ttl_minutes)
        return self._expiry[run_id]

    def tags(self, run_id: str, market: str | None = None) -> list[dict[str, str]]:
        return rq.tags(self.settings, run_id, self.expiry(run_id), market, self.run_tags)

    def client_token(self, run_id: str, attempt: int) -> str:
        return rq.client_token(run_id, attempt)

    def placement_group_name(self, run_id: str) -> str:
        return rq.placement_group_name(run_id)

    def run_instances_request(self, run_id: str, plan: Any, user_data: str, subnet_id: str | None = None,
                              market: str | None = None, **options: Any) -> dict[str, Any]:
        """One ``run_instances`` request (see :func:`request.run_instances_request`), checked for secrets."""
        request = rq.run_instances_request(self.settings, run_id, plan, user_data, self.expiry(run_id),
                                           subnet_id, market, extra_tags=self.run_tags, **options)
        rq.refuse_secrets(request, rq.known_secrets(self.session))
        return request

    def attempts(self, run_id: str, plan: Any, user_data: str) -> tuple[LaunchAttempt, ...]:
        """Every try a launch makes, in failover order, rendered before any call."""
        return rq.launch_attempts(self.settings, run_id, plan, user_data, self.expiry(run_id),
                                  rq.known_secrets(self.session), self.run_tags)

    # -- provisioning --------------------------------------------------------------

    def provision(self, run_id: str, plan: Any, user_data: str, progress: Progress = None,
                  should_stop: Callable[[], bool] | None = None, *,
                  attempts: tuple[LaunchAttempt, ...] | None = None,
                  deadline: float | None = None, sent: list[dict[str, Any]] | None = None) -> list[Instance]:
        """Launch ``plan.nodes`` instances as one gang, failing over as configured.

        ``attempts`` are the requests rendered when the job was planned (what dry_run
        showed); without them they are rendered now. Returns the running instances
        sorted by launch index. The wait for "running" ends at ``deadline`` (a
        ``time.monotonic()`` value) or ``running_timeout_s``, whichever comes first
        (``LaunchTimeout``, phase "provisioning"). On any failure, and when
        ``should_stop()`` turns true before they run (``JobCancelled``), every resource
        of the run is cleaned up before the error propagates. Each request actually
        sent is appended to ``sent``.
        """
        stop = should_stop or (lambda: False)
        say = progress or (lambda message: None)
        self.settings.require_launchable()
        itype = self.instance_type_for(plan)
        if attempts is None:
            attempts = self.attempts(run_id, plan, user_data)  # shape and secrets, before any call
        subnets = self._describe_subnets()
        todo = list(attempts)
        if any(a.market == "reserved" for a in todo):
            zone = self._reservation_zone(itype)
            todo = [a for a in todo if a.market != "reserved" or subnets[a.subnet_id or ""]["AvailabilityZone"] == zone]
            if not any(a.market == "reserved" for a in todo):
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
            over_quota: set[str] = set()  # markets whose regional vCPU quota this launch would pass
            for launch in todo:
                if stop():
                    raise JobCancelled(f"run {run_id} was cancelled while provisioning")
                market, subnet_id = launch.market, launch.subnet_id or ""
                if market in over_quota:
                    continue  # every zone of the region counts against the same quota
                zone = subnets[subnet_id]["AvailabilityZone"]
                request = launch.resolved(image_id, sg, root_device)
                if sent is not None:
                    sent.append(request)
                say(f"run_instances {plan.nodes} x {itype} in {subnet_id} ({zone}), {market}")
                try:
                    response = self._run_instances(request, stop, deadline)
                except ClientError as exc:
                    code, message = _error_of(exc)
                    if code == "VcpuLimitExceeded":
                        quota = vcpu_quota(itype, "spot" if market == "spot" else "on-demand")
                        message = (f"{message} {plan.nodes} x {itype} needs more vCPUs than the {quota} in "
                                   f"{self.settings.region} leaves: raise it in Service Quotas")
                        tried.append(Attempt(subnet_id, zone, market, code, message))
                        over_quota.add(market)
                        say(f"over the vCPU quota for {market} {itype}: {quota}")
                        continue
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
                return self._wait_running(run_id, ids, market, stop, deadline)
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

    def _run_instances(self, request: dict[str, Any], stop: Callable[[], bool],
                       deadline: float | None) -> dict[str, Any]:
        """``run_instances``; a just-created instance profile that EC2 does not see yet (IAM is
        eventually consistent: seconds) is waited for, up to ``PROFILE_PROPAGATION_S``."""
        give_up = time.monotonic() + PROFILE_PROPAGATION_S
        if deadline is not None:
            give_up = min(give_up, deadline)
        while True:
            try:
                return self.client("ec2").run_instances(**request)
            except ClientError as exc:
                code, message = _error_of(exc)
                fresh_profile = (code == "InvalidParameterValue" and "iaminstanceprofile" in message.lower()
                                 and self.settings.job_roles)
                if not fresh_profile or time.monotonic() > give_up or stop():
                    raise
                logger.info("instance profile not visible to EC2 yet: retrying run_instances")
                time.sleep(2.0)

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
                      should_stop: Callable[[], bool] = lambda: False,
                      deadline: float | None = None) -> list[Instance]:
        """botocore's ``instance_running`` waiter, one poll at a time so a cancel is seen between polls.

        Ends at ``deadline`` (the job's) or after ``running_timeout_s``, whichever is first.
        """
        ec2 = self.client("ec2")
        delay = self.settings.waiter_delay_s
        waiter = ec2.get_waiter("instance_running")
        limit = time.monotonic() + self.settings.running_timeout_s
        if deadline is not None:
            limit = min(limit, deadline)
        while True:
            try:
                waiter.wait(InstanceIds=ids, WaiterConfig={"Delay": delay, "MaxAttempts": 1})
                break
            except WaiterError as exc:
                if "Max attempts exceeded" not in str(exc):  # a terminal state: not coming up
                    states = self.instance_states(ids, reasons=True)
                    raise ProvisioningError(
                        f"run {run_id}: instances stopped before running (spot reclaimed or launch failure): "
                        f"{states}"
                    ) from exc
                if time.monotonic() + delay > limit:
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

    # -- cleanup -------------------------------------------------------------------

    def terminate(self, run_id: str, wait: bool = True) -> list[str]:
        """Terminate the run's instances (by id and by tag), wait, then delete its groups.

        Idempotent: a second call, or a call for a run that never launched, does nothing
        harmful. Only groups tagged with the run id are deleted, never a given one.
        Returns what it removed (instance ids, "security group sg-...", "placement group ...").
        With ``wait=False`` it does not wait for the instances to go: a group they still
        use stays (for the next sweep) instead of being waited for.
        """
        ec2 = self.client("ec2")
        gone: list[str] = []
        ids = set(self._launched.get(run_id, ())) | set(self._live_by_tag(run_id))
        if ids:
            live = self._terminate_ids(sorted(ids))
            gone += live
            if live and wait:
                self._wait_terminated(live)
        self._launched.pop(run_id, None)
        run_filter = [{"Name": f"tag:{RUN_ID_TAG}", "Values": [run_id]}]
        for group in ec2.describe_placement_groups(Filters=run_filter).get("PlacementGroups", []):
            try:
                ec2.delete_placement_group(GroupName=group["GroupName"])
                gone.append(f"placement group {group['GroupName']}")
            except ClientError as exc:
                code = _error_of(exc)[0]
                if code != "InvalidPlacementGroup.Unknown" and (wait or code != "InvalidPlacementGroup.InUse"):
                    raise
        for group in ec2.describe_security_groups(Filters=run_filter).get("SecurityGroups", []):
            if group["GroupId"] != self.settings.security_group_id:
                if self._delete_security_group(group["GroupId"], wait=wait):
                    gone.append(f"security group {group['GroupId']}")
        return gone

    def terminate_machines(self, ids: list[str]) -> list[str]:
        """Terminate these instances alone (a lost node's, replaced by one new instance); the run's
        groups stay for the instances it keeps. Idempotent."""
        return self._terminate_ids(sorted(set(ids))) if ids else []

    def _wait_terminated(self, ids: list[str]) -> None:
        """Until every one of ``ids`` is terminated, for at most ``running_timeout_s``.

        EC2 may not know ids it launched moments ago (eventual consistency): that answer is
        waited out like "shutting-down", where botocore's ``instance_terminated`` waiter fails
        at once and the run's groups would be left for a sweep. Past the time the groups are
        deleted anyway (their deletion waits out the instances' network interfaces)."""
        ec2 = self.client("ec2")
        deadline = time.monotonic() + self.settings.running_timeout_s
        while True:
            try:
                states = [inst["State"]["Name"]
                          for page in ec2.get_paginator("describe_instances").paginate(InstanceIds=ids)
                          for reservation in page["Reservations"] for inst in reservation["Instances"]]
                if len(states) == len(ids) and all(state == "terminated" for state in states):
                    return
            except ClientError as exc:
                if _error_of(exc)[0] != "InvalidInstanceID.NotFound":
                    raise
            if time.monotonic() > deadline:
                logger.warning("instances %s not seen terminated within %.0fs; deleting their groups anyway",
                               ", ".join(ids), self.settings.running_timeout_s)
                return
            time.sleep(self.settings.waiter_delay_s)

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

    def _delete_security_group(self, group_id: str, wait: bool = True) -> bool:
        """Delete, waiting out the minutes AWS may take to detach terminated instances' ENIs.
        Returns whether this call deleted it (``wait=False``: one try, False while in use)."""
        ec2 = self.client("ec2")
        deadline = time.monotonic() + SG_DELETE_TIMEOUT_S
        while True:
            try:
                ec2.delete_security_group(GroupId=group_id)
                return True
            except ClientError as exc:
                code = _error_of(exc)[0]
                if code == "InvalidGroup.NotFound":
                    return False
                if code == "DependencyViolation" and not wait:
                    return False
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



__all__ = ["CAPACITY_ERRORS", "Attempt", "EC2Provisioner", "EC2Settings", "Instance"]
