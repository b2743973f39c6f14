"""What a dead driver's runs left on AWS, found by their store's tag and removed for the sweeper.

EC2's side of :meth:`~prefect_sgpu.compute.remote.provider.Provider.find_leftovers` and
:meth:`~prefect_sgpu.compute.remote.provider.Provider.remove_leftovers`. Every resource a run
makes carries ``sgpu:store`` (the store's root URI) and ``sgpu:run-id``: instances, security and
placement groups, job roles (``job_roles=True``), and the SSM parameters the driver tags as it
writes them (:meth:`~prefect_sgpu.compute.ec2.instances.EC2Provisioner.put_secret`). Only those
tagged with the swept store are listed, so a run of another store is never reached; a parameter's
name says its run, never its store (whoever writes a store can make a folder named like another
store's run), which is why untagged parameters are never listed at all.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefect_sgpu import aws
from prefect_sgpu.compute.ec2 import request as rq
from prefect_sgpu.compute.ec2 import roles
from prefect_sgpu.compute.ec2.describe import LIVE_STATES
from prefect_sgpu.compute.remote.provider import CloudLeftover, LeftoverScan
from prefect_sgpu.protocol.jobfolder import ssm_key_parameter, ssm_root, ssm_secrets_parameter

if TYPE_CHECKING:
    from prefect_sgpu.store import Store

_SSM_NAME = re.compile(r"^/prefect-sgpu/[0-9a-f]{16}/(?P<run>[^/]+)/(?:payload-key|secrets)$")
#: what each kind of leftover is to the sweeper
CATEGORY = {"instance": "machine", "security group": "group", "placement group": "group",
            "SSM parameter": "secret", "IAM role": "identity"}


def _ttl(tags: dict[str, str]) -> float | None:
    try:
        return float(tags[rq.HEARTBEAT_TTL_TAG])
    except (KeyError, ValueError):
        return None


def _leftover(run_id: str, kind: str, name: str, ttl: float | None = None) -> CloudLeftover:
    return CloudLeftover(run_id, CATEGORY[kind], kind, name, ttl)  # type: ignore[arg-type]


def find_leftovers(store: "Store", ec2: Any, ssm: Any, iam: Any | None,
                   own_group: str | None = None) -> LeftoverScan:
    """Instances not yet ended, security groups (never ``own_group``, the block's own), placement
    groups, SSM parameters and, when ``iam`` is given, job roles of ``store``'s runs. Each service
    is listed on its own: one that cannot be is named in ``errors`` and the others still listed."""
    scan = LeftoverScan()
    steps: list[tuple[str, Callable[[], list[CloudLeftover]]]] = [
        ("find cloud", lambda: _ec2_leftovers(store, ec2, own_group)),
        ("find roles", lambda: _role_leftovers(store, iam) if iam is not None else []),
        ("find ssm", lambda: _ssm_leftovers(store, ssm)),
    ]
    for label, step in steps:
        try:
            scan.found += step()
        except Exception as exc:  # noqa: BLE001 - one unreachable service must not stop the rest
            scan.errors.append(f"{label}: {type(exc).__name__}: {exc}")
    return scan


def _ec2_leftovers(store: "Store", ec2: Any, own_group: str | None) -> list[CloudLeftover]:
    tagged = [{"Name": "tag-key", "Values": [rq.RUN_ID_TAG]}]
    found: list[CloudLeftover] = []

    def ours(kind: str, name: str, tag_list: list[dict[str, str]] | None) -> None:
        tags = {t["Key"]: t["Value"] for t in tag_list or []}
        if tags.get(rq.STORE_TAG) == store.root_uri:
            found.append(_leftover(tags[rq.RUN_ID_TAG], kind, name, _ttl(tags)))

    filters = [*tagged, {"Name": "instance-state-name", "Values": list(LIVE_STATES)}]
    for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
        for reservation in page["Reservations"]:
            for inst in reservation["Instances"]:
                ours("instance", inst["InstanceId"], inst.get("Tags"))
    for group in ec2.describe_security_groups(Filters=tagged).get("SecurityGroups", []):
        if group["GroupId"] != own_group:
            ours("security group", group["GroupId"], group.get("Tags"))
    for group in ec2.describe_placement_groups(Filters=tagged).get("PlacementGroups", []):
        if group.get("State") != "deleted":
            ours("placement group", group["GroupName"], group.get("Tags"))
    return found


def _role_leftovers(store: "Store", iam: Any) -> list[CloudLeftover]:
    """Job roles (``job_roles=True``) of this store's runs."""
    return [_leftover(run_id, "IAM role", roles.role_name(run_id), _ttl(tags))
            for run_id, tags in roles.job_role_runs(iam, store.scope).items()
            if tags.get(rq.STORE_TAG) == store.root_uri]


def _ssm_leftovers(store: "Store", ssm: Any) -> list[CloudLeftover]:
    """The job parameters tagged with this store (the driver tags them as it writes them)."""
    filters = [{"Key": "Name", "Option": "BeginsWith", "Values": [ssm_root(store.scope)]},
               {"Key": f"tag:{rq.STORE_TAG}", "Values": [store.root_uri]}]
    found = []
    for page in ssm.get_paginator("describe_parameters").paginate(ParameterFilters=filters):
        for parameter in page.get("Parameters", []):
            match = _SSM_NAME.match(parameter["Name"])
            if match and parameter["Name"] in (ssm_key_parameter(match["run"], store.scope),
                                               ssm_secrets_parameter(match["run"], store.scope)):
                found.append(_leftover(match["run"], "SSM parameter", parameter["Name"]))
    return found


def remove_leftovers(run_id: str, leftovers: list[CloudLeftover], wait: bool, *,
                     terminate: Callable[[str, bool], list[str]], ssm: Any, iam: Any | None) -> list[CloudLeftover]:
    """Instances and groups through ``terminate`` (the run's, by tag), then SSM parameters one by
    one, then the run's job role; those this call removed (one already gone is not)."""
    removed: list[CloudLeftover] = []
    if any(x.category in ("machine", "group") for x in leftovers):
        gone = set(terminate(run_id, wait))
        removed += [x for x in leftovers if (x.kind == "instance" and x.name in gone)
                    or (x.category == "group" and f"{x.kind} {x.name}" in gone)]
    for parameter in (x for x in leftovers if x.kind == "SSM parameter"):
        if _delete_parameter(ssm, parameter.name):
            removed.append(parameter)
    identities = [x for x in leftovers if x.kind == "IAM role"]
    if identities and iam is not None:
        if any(g.startswith("IAM role") for g in roles.delete(iam, run_id)):
            removed += identities
    return removed


def _delete_parameter(ssm: Any, name: str) -> bool:
    try:
        ssm.delete_parameter(Name=name)
        return True
    except Exception as exc:  # noqa: BLE001
        if aws.error_code(exc) == "ParameterNotFound":
            return False
        raise
