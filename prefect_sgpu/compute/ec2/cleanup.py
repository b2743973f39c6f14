"""Removing one run's EC2 resources: its instances (by id and by tag), then its groups.

**Cleanup by tag**: every resource carries ``sgpu:run-id``; :meth:`RunCleanup.terminate` finds
instances by id *and* by that tag, so it also cleans up after a driver that crashed between
launch and bookkeeping. Only groups tagged with the run id are deleted, never a given one, and
every removal tolerates "already gone", so two cleanups of one run (the driver's and a
sweeper's) can run at once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from botocore.exceptions import ClientError

from prefect_sgpu.aws import error_of
from prefect_sgpu.compute.ec2.describe import live_by_tag
from prefect_sgpu.compute.ec2.request import RUN_ID_TAG

logger = logging.getLogger("prefect_sgpu.compute.ec2.cleanup")

#: how long deleting a security group waits out the network interfaces of terminated instances
SG_DELETE_TIMEOUT_S = 180.0


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
        use stays (for the next sweep) instead of being waited for.
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
        run_filter = [{"Name": f"tag:{RUN_ID_TAG}", "Values": [run_id]}]
        for group in ec2.describe_placement_groups(Filters=run_filter).get("PlacementGroups", []):
            try:
                ec2.delete_placement_group(GroupName=group["GroupName"])
                gone.append(f"placement group {group['GroupName']}")
            except ClientError as exc:
                code = error_of(exc)[0]
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
                if error_of(exc)[0] != "InvalidInstanceID.NotFound":
                    raise
            if time.monotonic() > deadline:
                logger.warning("instances %s not seen terminated within %.0fs; deleting their groups anyway",
                               ", ".join(ids), self.settings.running_timeout_s)
                return
            time.sleep(self.settings.waiter_delay_s)


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
                code = error_of(exc)[0]
                if code == "InvalidGroup.NotFound":
                    return False
                if code == "DependencyViolation" and not wait:
                    return False
                if code != "DependencyViolation" or time.monotonic() > deadline:
                    raise
                time.sleep(5)
