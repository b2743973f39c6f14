"""Launching one run's gang of EC2 instances: one request per try, failing over, cleaned up on failure.

- **One ``run_instances`` per attempt with ``MinCount=MaxCount=nodes``** in a cluster
  placement group: a multi-node job is useless with part of its nodes, and EC2 then
  either places the whole gang or none of it.
- **Failover** walks the configured subnets (one per availability zone) in order, then
  on to on-demand when ``fallback_to_on_demand`` is set, but only for capacity errors,
  at launch or as the state reason of instances EC2 ended while pending (what that attempt
  launched is terminated first); a regional quota skips the other zones of its market;
  anything else (permissions, a bad AMI, an EBS KMS key) is raised at once because another
  zone would fail the same way (:mod:`~prefect_sgpu.compute.ec2.launch_outcomes`).
- **Throttling** is botocore's job: every client uses its ``standard``/``adaptive``
  retry mode, which leaves capacity errors to the failover here (:data:`prefect_sgpu.aws.NOT_RETRIED`).
  A retried ``run_instances`` carries the same ``ClientToken`` (one per run and attempt), so a
  lost response never launches a second gang.
- **A job's new instance profile** that EC2 does not see yet is waited for in the same subnet
  (:func:`prefect_sgpu.retry.retrying`, up to ``PROFILE_PROPAGATION_S``).
- A launch that fails, or is cancelled, removes everything of the run before the error
  propagates (:class:`~prefect_sgpu.compute.ec2.cleanup.RunCleanup`).
"""

from __future__ import annotations

import datetime as _dt
import logging
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from botocore.exceptions import ClientError, WaiterError

from prefect_sgpu import retry
from prefect_sgpu.aws import error_of
from prefect_sgpu.compute.ec2 import egress
from prefect_sgpu.compute.ec2 import launch_outcomes as outcomes
from prefect_sgpu.compute.ec2.describe import Instance, described, launched_instances
from prefect_sgpu.compute.ec2.launch_outcomes import PROFILE_PROPAGATION_S, QUOTA_ERRORS, DiedPending
from prefect_sgpu.compute.ec2.capacity import (SLOT_ERRORS, SLOT_WAIT_CAP_S, SLOT_WAIT_FLOOR_S, Reservation,
                                               into_reservation, reservation_of)
from prefect_sgpu.compute.ec2.request import DEFAULT_ROOT_DEVICE, LaunchAttempt, refuse_attached_interfaces
from prefect_sgpu.errors import JobCancelled, LaunchTimeout, ProvisioningError, SGPUConfigError

logger = logging.getLogger("prefect_sgpu.compute.ec2.gang_launch")

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

Progress = Callable[[str], None] | None


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


class GangLaunch:
    """The launching half of :class:`~prefect_sgpu.compute.ec2.instances.EC2Provisioner`, which
    provides ``settings``, ``client``, the request builders (``attempts``, ``tags``,
    ``instance_type_for``, ``placement_group_name``), ``instance_states``, ``terminate`` and the
    ``_launched`` record of what each run launched (which ``terminate`` ends even before tags are seen).
    """

    settings: Any
    _launched: dict[str, set[str]]

    def provision(self, run_id: str, plan: Any, user_data: str, progress: Progress = None,
                  should_stop: Callable[[], bool] | None = None, *,
                  attempts: tuple[LaunchAttempt, ...] | None = None,
                  deadline: float | None = None, sent: list[dict[str, Any]] | None = None,
                  zone: str | None = None, alone: bool = False,
                  image: tuple[str, str] | None = None, needs_index: bool = True) -> list[Instance]:
        """Launch ``plan.nodes`` instances as one gang, failing over as configured.

        ``attempts`` are the requests rendered when the job was planned (what dry_run
        showed); without them they are rendered now. Returns the running instances
        sorted by launch index. The wait for "running" ends at ``deadline`` (a
        ``time.monotonic()`` value) or ``running_timeout_s``, whichever comes first
        (``LaunchTimeout``, phase "provisioning"). On any failure, and when
        ``should_stop()`` turns true before they run (``JobCancelled``), every resource
        of the run is cleaned up before the error propagates. Each request actually
        sent is appended to ``sent``.

        ``alone``: the launch adds machines to a run that keeps others (a lost node's replacement):
        only subnets in ``zone`` (the kept machines', where the run's cluster placement group is
        bound) are tried, a failure terminates only what this call launched, and a reservation's
        slot that is not free yet (a terminated instance's, for minutes) is waited for, up to
        ``reservation_slot_wait_s``. A reserved try goes into the reservation's own placement group
        when it has one, as a ``capacity-block`` launch into a Capacity Block, and a reservation
        that ends before ``deadline`` is warned of (logged and said through ``progress``).
        ``image``: the (AMI id, root device) the job pinned (:meth:`image` when None), so every
        gang and replacement of a job boots the same image. A launch of several network
        interfaces per node (which EC2 gives no public IPv4) is tried only in subnets with a
        way out to S3 and SSM (:mod:`prefect_sgpu.compute.ec2.egress`; ``needs_index``: the nodes
        also reach a package index), and refused before anything is spent when none has one.
        """
        stop = should_stop or (lambda: False)
        say = progress or (lambda message: None)
        self.settings.require_launchable()
        itype = self.instance_type_for(plan)
        if attempts is None:
            attempts = self.attempts(run_id, plan, user_data)  # shape and secrets, before any call
        subnets = self._describe_subnets()
        todo = list(attempts)
        if zone is not None:  # a cluster placement group stays in the zone of its first instance
            todo = [a for a in todo if subnets[a.subnet_id or ""]["AvailabilityZone"] == zone]
            if not todo:
                raise ProvisioningError(f"run {run_id}: no configured subnet is in {zone}, the zone of the "
                                        "machines it keeps (its cluster placement group is bound to it)")
        reservation: Reservation | None = None
        if any(a.market == "reserved" for a in todo):
            reservation = self._reservation(itype)
            rzone = reservation.zone
            todo = [a for a in todo
                    if a.market != "reserved" or subnets[a.subnet_id or ""]["AvailabilityZone"] == rzone]
            if not any(a.market == "reserved" for a in todo) and zone is None:
                raise SGPUConfigError(
                    "subnet_ids",
                    self.settings.subnet_ids,
                    f"a subnet in {rzone}, the zone of capacity reservation "
                    f"{self.settings.capacity_reservation_id}",
                )
            self._warn_reservation_end(run_id, reservation, deadline, say)
        if todo:
            interfaces = egress.interfaces_of(todo[0].params)
            usable = egress.subnets_with_way_out(
                self.client("ec2"), self.settings.region, itype, interfaces,
                {a.subnet_id: subnets[a.subnet_id] for a in todo if a.subnet_id in subnets}, needs_index)
            todo = [a for a in todo if a.subnet_id not in subnets or a.subnet_id in usable]
        mine: list[str] = []  # what this call launched (``alone``: all a failure may end)
        image_id, root_device = image or self.image()
        try:
            sg = self.settings.security_group_id or self._create_security_group(run_id, subnets)
            if any("Placement" in a.params for a in todo):
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
                if market == "reserved" and reservation is not None:
                    request = into_reservation(request, reservation)
                if sent is not None:
                    sent.append(request)
                say(f"run_instances {plan.nodes} x {itype} in {subnet_id} ({zone}), {market}")
                try:
                    if alone and market == "reserved":
                        response = self._run_in_reservation(run_id, request, stop, deadline, say)
                    else:
                        response = self._run_instances(request, stop, deadline)
                except ClientError as exc:
                    code, message = error_of(exc)
                    if code in QUOTA_ERRORS:
                        quota = vcpu_quota(itype, "spot" if market == "spot" else "on-demand")
                        message = outcomes.quota_message(code, message, quota, plan.nodes, itype,
                                                         self.settings.region)
                        tried.append(Attempt(subnet_id, zone, market, code, message))
                        over_quota.add(market)
                        say(f"over the quota for {market} {itype}: {quota}")
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
                mine += ids
                self._launched.setdefault(run_id, set()).update(ids)
                say(f"launched {', '.join(ids)} in {zone}; waiting for running")
                try:
                    return self._wait_running(run_id, ids, market, stop, deadline)
                except DiedPending as died:
                    if not died.capacity:
                        if outcomes.KMS_STATE_REASON in died.codes:
                            raise DiedPending(run_id, died.reasons, self._kms_hint(image_id, request)) from None
                        raise
                    # what a capacity error at launch would have said: this attempt's instances go, next try
                    tried.append(Attempt(subnet_id, zone, market, "/".join(died.codes), died.message))
                    say(f"instances ended while pending in {subnet_id} ({zone}, {market}): "
                        f"{', '.join(died.codes)}; terminating {', '.join(ids)}")
                    logger.info("run %s: %s", run_id, tried[-1])
                    self.terminate_machines(ids)
                    continue
            error = ProvisioningError(
                f"could not launch {plan.nodes} x {itype} for run {run_id}; tried "
                f"{len(tried)} subnet/market combination(s):\n" + "\n".join(f"  - {a}" for a in tried)
            )
            error.attempts = [asdict(a) for a in tried]  # type: ignore[attr-defined]
            raise error
        except BaseException:
            try:
                if alone:  # the run keeps its other machines and its groups
                    self.terminate_machines(mine)
                else:
                    self.terminate(run_id)
            except Exception:  # keep the launch error; the failed cleanup is logged
                logger.exception("cleanup of run %s after a failed launch failed", run_id)
            raise

    def _run_in_reservation(self, run_id: str, request: dict[str, Any], stop: Callable[[], bool],
                            deadline: float | None, say: Callable[[str], None]) -> dict[str, Any]:
        """``run_instances`` into a reservation whose slot a terminated instance held: EC2 answers
        ``ReservationCapacityExceeded`` (or ``InsufficientInstanceCapacity``) until the slot is free
        again, minutes later (AWS docs, "Capacity Blocks for ML"), so those are retried with a backoff
        of at least ``SLOT_WAIT_FLOOR_S`` for ``reservation_slot_wait_s`` (and never past ``deadline``)."""
        budget = self.settings.reservation_slot_wait_s
        if deadline is not None:
            budget = min(budget, max(0.0, deadline - time.monotonic()))

        def transient(exc: BaseException) -> bool:
            return isinstance(exc, ClientError) and error_of(exc)[0] in SLOT_ERRORS and not stop()

        return retry.retrying(
            lambda: self._run_instances(request, stop, deadline), transient=transient, budget_s=budget,
            base_s=SLOT_WAIT_FLOOR_S, cap_s=SLOT_WAIT_CAP_S, floor_s=SLOT_WAIT_FLOOR_S,
            what=f"run {run_id}: a slot in capacity reservation {self.settings.capacity_reservation_id}",
            log=lambda text: (logger.info(text), say(text)),
        )

    def _warn_reservation_end(self, run_id: str, reservation: Reservation, deadline: float | None,
                              say: Callable[[str], None]) -> None:
        """A reservation (a Capacity Block, mostly) that ends before the job's deadline is warned of."""
        if deadline is None:
            return
        left = max(0.0, deadline - time.monotonic())
        job_end = _dt.datetime.now(_dt.timezone.utc) + _dt.timedelta(seconds=left)
        text = reservation.warning(job_end)
        if text:
            logger.warning("run %s: %s", run_id, text)
            say(f"warning: {text}")

    def _run_instances(self, request: dict[str, Any], stop: Callable[[], bool],
                       deadline: float | None) -> dict[str, Any]:
        """``run_instances``; the job's own instance profile (``job_roles``: made moments ago) that
        EC2 or IAM does not see yet is waited for here, in this subnet, up to ``PROFILE_PROPAGATION_S``
        (or the job's deadline), with backoff; how long it took is logged. A profile still unseen then
        is a :class:`ProvisioningError` that names it, not a capacity error: no other zone is tried."""
        budget = PROFILE_PROPAGATION_S
        if deadline is not None:
            budget = max(0.0, min(budget, deadline - time.monotonic()))
        refuse_attached_interfaces(request)  # the last look before the call
        profile = request.get("IamInstanceProfile", {})
        name = profile.get("Name") or profile.get("Arn", "")

        def launch() -> dict[str, Any]:
            if stop():
                raise JobCancelled(f"launch of {name or 'the gang'} was cancelled while IAM caught up")
            return self.client("ec2").run_instances(**request)

        def late_profile(exc: BaseException) -> bool:
            return bool(self.settings.job_roles) and outcomes.profile_not_visible(exc)

        def note(line: str) -> None:
            logger.info("instance profile %s: %s", name, line)

        try:
            return retry.retrying(launch, transient=late_profile, budget_s=budget, base_s=2.0, cap_s=20.0,
                                  floor_s=1.0, what=f"EC2 seeing the job's instance profile {name}", log=note)
        except ClientError as exc:
            if not late_profile(exc):
                raise
            code, message = error_of(exc)
            raise ProvisioningError(
                f"EC2 did not accept the job's new instance profile {name} within {budget:.0f} s "
                f"(IAM is eventually consistent; it usually takes seconds): {code}: {message}. "
                "Not retried in other zones: every zone waits for the same IAM."
            ) from exc

    def _describe_subnets(self) -> dict[str, dict[str, Any]]:
        try:
            found = self.client("ec2").describe_subnets(SubnetIds=list(self.settings.subnet_ids))["Subnets"]
        except ClientError as exc:
            code, message = error_of(exc)
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
        return self._reservation(instance_type).zone

    def _reservation(self, instance_type: str) -> Reservation:
        """The capacity reservation (zone, type, placement group, end), checked to hold this launch."""
        rid = self.settings.capacity_reservation_id
        allowed = (
            f"an active capacity reservation for {instance_type} in {self.settings.region} "
            "that this account can use"
        )
        try:
            found = self.client("ec2").describe_capacity_reservations(CapacityReservationIds=[rid])
        except ClientError as exc:
            code, message = error_of(exc)
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
        return reservation_of(reservation)

    def image(self) -> tuple[str, str]:
        """The AMI id (resolved from SSM when not given) and its root device name."""
        s = self.settings
        image_id = s.ami_id
        if not image_id:
            try:
                image_id = self.client("ssm").get_parameter(Name=s.ami_ssm_parameter)["Parameter"]["Value"]
            except ClientError as exc:
                code, message = error_of(exc)
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
            code, message = error_of(exc)
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
            if error_of(exc)[0] != "InvalidGroup.Duplicate":
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
            if error_of(exc)[0] != "InvalidPlacementGroup.Duplicate":
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
                    raise self._died_pending(run_id, ids) from exc
                if time.monotonic() + delay > limit:
                    raise LaunchTimeout(run_id, self.settings.running_timeout_s, phase="provisioning") from exc
            pause_until = time.monotonic() + delay
            while time.monotonic() < pause_until:
                if should_stop():
                    raise JobCancelled(f"run {run_id} was cancelled while its instances started")
                time.sleep(min(0.5, max(0.0, pause_until - time.monotonic())))
        return launched_instances(ec2, ids, market)

    def _died_pending(self, run_id: str, ids: list[str]) -> DiedPending:
        """The launch's instances that did not come up, with EC2's state reasons (an id EC2 does not
        know is one that is gone, with no reason)."""
        reasons: dict[str, tuple[str, str, str]] = {}
        try:
            for instance_id, inst in described(self.client("ec2"), ids).items():
                if inst is None:
                    reasons[instance_id] = ("terminated", "", "")
                elif inst["State"]["Name"] not in ("pending", "running"):
                    reason = inst.get("StateReason") or {}
                    reasons[instance_id] = (inst["State"]["Name"], reason.get("Code", ""), reason.get("Message", ""))
        except ClientError as exc:
            logger.warning("run %s: could not read why instances %s ended: %s", run_id, ", ".join(ids), exc)
        return DiedPending(run_id, reasons)

    def _kms_hint(self, image_id: str, request: dict[str, Any]) -> str:
        try:
            images = self.client("ec2").describe_images(ImageIds=[image_id]).get("Images", [])
        except ClientError:
            images = []
        return outcomes.kms_hint(self.settings.region, image_id, images[0] if images else None, request)
