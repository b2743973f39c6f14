"""Reading EC2's instances: their states, a run's live ones by tag, and what a launch got.

Everything here only describes; it launches and removes nothing. An id EC2 no longer knows is
an instance long gone (``terminated``), which is how both the compute's watch and its cleanup
read it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prefect_sgpu import aws
from prefect_sgpu.compute.ec2.request import RUN_ID_TAG

logger = logging.getLogger("prefect_sgpu.compute.ec2.describe")

#: instance states of an instance that will not run a job again
DEAD_STATES = ("shutting-down", "terminated", "stopping", "stopped")
#: instance states of an instance that may still run, or be started again
LIVE_STATES = ("pending", "running", "stopping", "stopped")


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


def instance_states(ec2: Any, ids: list[str], reasons: bool = False) -> dict[str, str]:
    """The state name of each instance id (empty ids skipped; with ``reasons``, EC2's state
    reason in brackets). An id EC2 no longer knows is long gone and reads ``terminated``; the
    others keep their own states (:func:`described`). Another failure is logged and reads as no
    states (the caller asks again)."""
    try:
        found = described(ec2, [i for i in ids if i])
    except Exception as exc:  # noqa: BLE001 - the caller asks again
        logger.warning("describe_instances failed: %s", exc)
        return {}
    states = {}
    for instance_id, inst in found.items():
        if inst is None:
            states[instance_id] = "terminated"
            continue
        reason = inst.get("StateReason", {}).get("Message", "") if reasons else ""
        states[instance_id] = inst["State"]["Name"] + (f" ({reason})" if reason else "")
    return states


def described(ec2: Any, ids: list[str]) -> dict[str, dict[str, Any] | None]:
    """EC2's description of each of ``ids``; None for an id EC2 no longer knows.

    DescribeInstances with explicit ids fails as a whole (``InvalidInstanceID.NotFound``) when
    one id is unknown (an instance terminated about an hour ago drops out of EC2's answers), so
    that answer is asked again with a filter on the ids, which leaves the unknown ones out and
    describes the rest: one unknown node never makes its live neighbours read as gone."""
    found: dict[str, dict[str, Any] | None] = {}
    if not ids:
        return found
    paginator = ec2.get_paginator("describe_instances")
    try:
        pages = list(paginator.paginate(InstanceIds=ids))
    except Exception as exc:  # noqa: BLE001 - only "unknown id" is answered here
        if aws.error_code(exc) != "InvalidInstanceID.NotFound":
            raise
        logger.info("describe_instances: %s; describing the others by filter", aws.error_of(exc)[1])
        pages = list(paginator.paginate(Filters=[{"Name": "instance-id", "Values": list(ids)}]))
    for page in pages:
        for inst in (i for r in page.get("Reservations", []) for i in r.get("Instances", [])):
            found[inst["InstanceId"]] = inst
    return {i: found.get(i) for i in ids}


def live_by_tag(ec2: Any, run_id: str) -> list[str]:
    """The ids of run ``run_id``'s instances (tagged ``sgpu:run-id``) that are not ended yet."""
    filters = [
        {"Name": f"tag:{RUN_ID_TAG}", "Values": [run_id]},
        {"Name": "instance-state-name", "Values": list(LIVE_STATES)},
    ]
    found = []
    for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
        for reservation in page["Reservations"]:
            found.extend(i["InstanceId"] for i in reservation["Instances"])
    return found


def launched_instances(ec2: Any, ids: list[str], market: str) -> list[Instance]:
    """The instances of one launch (bought in ``market``), in launch-index order."""
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
