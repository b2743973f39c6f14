"""What EC2 capacity asks of a launch beyond the rendered request: reservations, Capacity Blocks, boot times.

- A **Capacity Block** (the usual way to get p5) is a capacity reservation of type
  ``capacity-block``: instances launch into it only with ``InstanceMarketOptions.MarketType=
  capacity-block`` (AWS docs, "Launch instances into Capacity Blocks"), and it ends at its
  ``EndDate``: what runs in it then is terminated. A reservation made in a cluster placement group
  (every multi-instance Capacity Block is) takes launches into that group only, never the run's own.
  Both are read from DescribeCapacityReservations at launch (:func:`reservation_of`) and applied to
  the rendered request (:func:`into_reservation`).
- **Slots come back late**: the capacity of a terminated instance in a reservation or block is not
  available again for minutes (AWS docs, "Capacity Blocks for ML"), so a lost node's replacement
  waits for it (:data:`SLOT_ERRORS`, :data:`SLOT_WAIT_FLOOR_S`) instead of failing the job.
- **Boot times** differ by family: a p5 or trn2 spends many minutes between ``running`` and an
  agent (EFA, NVSwitch and fabric manager, eight GPUs of drivers) where a g5 spends a few.
  :func:`boot_timeout_s` is the wait for the agents, counted from ``running``.
"""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass
from typing import Any

#: launch errors that, inside a reservation, mean "the slot is not free yet" (a terminated instance's)
SLOT_ERRORS = frozenset({"ReservationCapacityExceeded", "InsufficientInstanceCapacity"})
#: the least pause between tries for a reservation slot: it comes back in minutes, not seconds
SLOT_WAIT_FLOOR_S = 30.0
SLOT_WAIT_CAP_S = 120.0

#: seconds from ``running`` until every agent must be up, by instance family (the block's
#: ``agent_timeout_s`` left at its default): the big multi-GPU, EFA families boot for many minutes
BOOT_TIMEOUTS_S: dict[str, float] = {
    "g4dn": 900.0, "g5": 900.0, "g5g": 900.0, "g6": 900.0, "g6e": 900.0, "gr6": 900.0,
    "p3": 1200.0, "p3dn": 1200.0,
    "p4d": 1800.0, "p4de": 1800.0, "trn1": 1800.0, "trn1n": 1800.0,
    "p5": 2700.0, "p5e": 2700.0, "p5en": 2700.0, "trn2": 2700.0,
}
DEFAULT_BOOT_TIMEOUT_S = 900.0


def instance_family(instance_type: str) -> str:
    """``p5.48xlarge`` -> ``p5``."""
    return instance_type.split(".", 1)[0].lower()


def boot_timeout_s(instance_type: str, configured: float | None = None) -> float:
    """The agents' timeout for ``instance_type``: ``configured`` when the user set one, else the
    family's (:data:`BOOT_TIMEOUTS_S`), else :data:`DEFAULT_BOOT_TIMEOUT_S`."""
    if configured is not None:
        return configured
    return BOOT_TIMEOUTS_S.get(instance_family(instance_type), DEFAULT_BOOT_TIMEOUT_S)


@dataclass(frozen=True)
class Reservation:
    """What a launch needs of one capacity reservation (DescribeCapacityReservations)."""

    reservation_id: str
    zone: str
    reservation_type: str = "default"
    placement_group: str | None = None
    end: _dt.datetime | None = None

    @property
    def capacity_block(self) -> bool:
        return self.reservation_type == "capacity-block"

    def ends_before(self, when: _dt.datetime) -> bool:
        return self.end is not None and self.end < when

    def warning(self, job_end: _dt.datetime) -> str | None:
        """Why the job may not finish in this reservation, or None."""
        if not self.ends_before(job_end):
            return None
        kind = "capacity block" if self.capacity_block else "capacity reservation"
        assert self.end is not None
        return (f"{kind} {self.reservation_id} ends at {self.end:%Y-%m-%dT%H:%M:%SZ}, before the job's "
                f"deadline ({job_end:%Y-%m-%dT%H:%M:%SZ}): its instances are terminated when it ends")


def reservation_of(found: dict[str, Any]) -> Reservation:
    """One item of DescribeCapacityReservations' ``CapacityReservations``."""
    arn = str(found.get("PlacementGroupArn") or "")
    group = re.sub(r"^.*:placement-group/", "", arn) or None
    end = found.get("EndDate")
    if isinstance(end, str):
        end = _dt.datetime.fromisoformat(end.replace("Z", "+00:00"))
    if isinstance(end, _dt.datetime) and end.tzinfo is None:
        end = end.replace(tzinfo=_dt.timezone.utc)
    return Reservation(str(found.get("CapacityReservationId", "")), str(found.get("AvailabilityZone", "")),
                       str(found.get("ReservationType") or "default"), group, end)


def into_reservation(params: dict[str, Any], reservation: Reservation) -> dict[str, Any]:
    """A rendered reserved-market request as the reservation takes it: into its placement group
    when it has one, and as ``capacity-block`` market when it is a Capacity Block."""
    params = dict(params)
    if reservation.placement_group:
        params["Placement"] = {**params.get("Placement", {}), "GroupName": reservation.placement_group}
    if reservation.capacity_block:
        params["InstanceMarketOptions"] = {"MarketType": "capacity-block"}
    return params
