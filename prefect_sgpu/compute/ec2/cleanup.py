"""Removing one run's EC2 resources: its instances (by id and by tag), then its groups.

**Cleanup by tag**: every resource carries ``sgpu:run-id``; :meth:`RunCleanup.terminate` finds
instances by id *and* by that tag, so it also cleans up after a driver that crashed between
launch and bookkeeping. Only groups tagged with the run id are deleted, never a given one, and
every removal tolerates "already gone", so two cleanups of one run (the driver's and a
sweeper's) can run at once.

**Groups stay in use after their instances ended.** EC2 answers ``DependencyViolation`` to
``DeleteSecurityGroup`` for minutes after the instances are terminated (their network interfaces
detach late) and ``InvalidPlacementGroup.InUse`` to ``DeletePlacementGroup`` for a while. Each
group delete is retried with :func:`prefect_sgpu.retry.retrying` for a bounded time
(:data:`GROUP_DELETE_BUDGET_S`); a group still refused then, or refused for any other reason, is
logged (which group, which run, why) and left to the sweeper, which finds it by its tags. Group
cleanup never raises: a job's result or error is never replaced by it.
"""

from __future__ import annotations

import logging
from typing import Any

from botocore.exceptions import ClientError

from prefect_sgpu.aws import error_of
from prefect_sgpu.compute.ec2.describe import live_by_tag
from prefect_sgpu.compute.ec2.request import RUN_ID_TAG
from prefect_sgpu.retry import Backoff, retrying

logger = logging.getLogger("prefect_sgpu.compute.ec2.cleanup")

#: how long deleting a security group waits out the network interfaces of terminated instances
SG_DELETE_TIMEOUT_S = 180.0
#: how long deleting each kind of group waits while EC2 still counts it in use; then it is the sweeper's
GROUP_DELETE_BUDGET_S = {"security group": SG_DELETE_TIMEOUT_S, "placement group": 60.0}
#: what EC2 answers a group delete while the group's instances (or their interfaces) are not gone yet
IN_USE = {"security group": "DependencyViolation", "placement group": "InvalidPlacementGroup.InUse"}
#: what EC2 answers a delete of a group that is already gone
GONE = {"security group": "InvalidGroup.NotFound", "placement group": "InvalidPlacementGroup.Unknown"}


class RunCleanup:
    """The removing half of :class:`~prefect_sgpu.compute.ec2.instances.EC2Provisioner`, which
    provides ``settings``, ``client`` and the ``_launched`` record of what each run launched."""

    settings: Any
    _launched: dict[str, set[str]]

    def terminate(self, run_id: str, wait: bool = True) -> list[str]:
        """Terminate the run's instances (by id and by tag), wait, then delete its groups.

        Idempotent: a second call, or a call for a run that never launched, does nothing
        harmful. Only groups tagged with the run id are deleted, never a given one.
        Returns what it removed (instance ids, "security group sg-...", "placement group ...").
        With ``wait=False`` it does not wait for the instances to go: a group they still
        use stays (for the next sweep) instead of being waited for. A group EC2 still counts in
        use past its budget stays too (logged); group cleanup never raises.
        """
        ec2 = self.client("ec2")
        gone: list[str] = []
        ids = set(self._launched.get(run_id, ())) | set(live_by_tag(ec2, run_id))
        if ids:
            live = self._terminate_ids(sorted(ids))
            gone += live
            if live and wait:
                self._wait_terminated(live)
        self._launched.pop(run_id, None)
        gone += self._delete_groups(run_id, wait)
        return gone

    def _delete_groups(self, run_id: str, wait: bool) -> list[str]:
        """The run's placement and security groups (never the block's own), each deleted by
        :meth:`_delete_group`; what could not be listed or deleted is logged and left to the
        sweeper. Never raises."""
        ec2 = self.client("ec2")
        run_filter = [{"Name": f"tag:{RUN_ID_TAG}", "Values": [run_id]}]
        gone: list[str] = []
        listings = (
            ("placement group", lambda: [g["GroupName"] for g in ec2.describe_placement_groups(
                Filters=run_filter).get("PlacementGroups", [])],
             lambda name: ec2.delete_placement_group(GroupName=name)),
            ("security group", lambda: [g["GroupId"] for g in ec2.describe_security_groups(
                Filters=run_filter).get("SecurityGroups", []) if g["GroupId"] != self.settings.security_group_id],
             lambda name: ec2.delete_security_group(GroupId=name)),
        )
        for kind, listing, delete in listings:
            try:
                names = listing()
            except Exception as exc:  # noqa: BLE001 - the sweeper lists them again
                logger.warning("the %ss of run %s could not be listed (%s); the sweeper removes them later",
                               kind, run_id, _why(exc))
                continue
            for name in names:
                if self._delete_group(run_id, kind, name, delete, wait):
                    gone.append(f"{kind} {name}")
        return gone

    def _delete_group(self, run_id: str, kind: str, name: str, delete: Any, wait: bool) -> bool:
        """Delete one group, retrying while EC2 counts it in use for :data:`GROUP_DELETE_BUDGET_S`
        (``wait=False``: one try). True when this call deleted it; False when it was gone already or
        is left (logged) to the sweeper."""
        def in_use(exc: BaseException) -> bool:
            return isinstance(exc, ClientError) and error_of(exc)[0] == IN_USE[kind]

        try:
            retrying(lambda: delete(name), transient=in_use, budget_s=GROUP_DELETE_BUDGET_S[kind] if wait else 0.0,
                     base_s=2.0, cap_s=20.0, floor_s=1.0, what=f"deleting {kind} {name} of run {run_id}",
                     log=logger.info)
            return True
        except Exception as exc:  # noqa: BLE001 - group cleanup never fails a release
            if error_of(exc)[0] == GONE[kind]:
                return False
            if in_use(exc):
                why = (f"EC2 still counts it in use ({_why(exc)}): the network interfaces of the run's ended "
                       "instances are still detaching" if kind == "security group"
                       else f"EC2 still counts it in use ({_why(exc)})")
            else:
                why = _why(exc)
            logger.warning("%s %s of run %s is left for the sweeper: %s", kind, name, run_id, why)
            return False

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
        delay = self.settings.waiter_delay_s
        backoff = Backoff(budget_s=self.settings.running_timeout_s, base_s=delay, cap_s=delay, floor_s=delay).start()
        while True:
            try:
                states = [inst["State"]["Name"]
                          for page in ec2.get_paginator("describe_instances").paginate(InstanceIds=ids)
                          for reservation in page["Reservations"] for inst in reservation["Instances"]]
                if len(states) == len(ids) and all(state == "terminated" for state in states):
                    return
            except ClientError as exc:
                if error_of(exc)[0] != "InvalidInstanceID.NotFound":
                    raise
            if not backoff.wait():
                logger.warning("instances %s not seen terminated within %.0fs; deleting their groups anyway",
                               ", ".join(ids), self.settings.running_timeout_s)
                return


    def _terminate_ids(self, ids: list[str]) -> list[str]:
        """Terminate ``ids``; an id EC2 no longer knows is already gone. Returns those terminated."""
        ec2 = self.client("ec2")
        remaining = list(ids)
        while remaining:
            try:
                ec2.terminate_instances(InstanceIds=remaining)
                return remaining
            except ClientError as exc:
                code, message = error_of(exc)
                if code != "InvalidInstanceID.NotFound":
                    raise
                gone = {i for i in remaining if i in message}
                if not gone:
                    raise
                remaining = [i for i in remaining if i not in gone]
        return []

def _why(exc: BaseException) -> str:
    code, message = error_of(exc)
    return f"{code}: {message}" if code else f"{type(exc).__name__}: {exc}"
