"""EC2 capacity that comes later: ``InsufficientInstanceCapacity`` for an instance type in a zone until it returns.

AWS: "Troubleshoot Amazon EC2 instance launch issues: Insufficient instance capacity"
(https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/troubleshooting-launch.html#troubleshooting-launch-capacity):
a launch fails with ``InsufficientInstanceCapacity`` when AWS does not have enough capacity for the request
in that zone; capacity shifts, so the same request may succeed minutes later, or in another zone. The
RunInstances API reference says how a launch of several instances meets a shortage: "If you specify more
instances than Amazon EC2 can launch in the target Availability Zone, Amazon EC2 launches the largest
possible number of instances above MinCount", and none when it cannot place MinCount.

The fault proxy (:attr:`AWSFaultProxy.capacity_later <support.aws_fault_proxy.AWSFaultProxy.capacity_later>`)
asks :meth:`CapacityLater.launch` before it forwards a RunInstances to moto. Off until a test calls
:meth:`CapacityLater.short`: while a shortage lasts, a launch of its instance type in its zone gets at most
``available`` instances (``MaxCount`` lowered, ``available`` used up), and one whose ``MinCount`` is more than
that fails with ``InsufficientInstanceCapacity``. The shortage ends after ``refusals`` refused launches, once
``after_s`` seconds passed on :data:`prefect_sgpu.retry.CLOCK` (a test's virtual clock), or when the test
calls :meth:`CapacityLater.restore`; then launches go through unchanged.

How many instances a launch gets (``up_to_max_count``, off by default; a test turns it on): EC2 launches the
largest number from ``MinCount`` to ``MaxCount`` that fits (the RunInstances API reference above), so with
room for all of them a launch of ``MinCount=2, MaxCount=3`` gets 3. moto launches ``MinCount`` instances
whatever ``MaxCount`` says (moto 5.x ``ec2/responses/instances.py``: ``run_instances`` reads ``MinCount``
alone), so an elastic job's first launch got min nodes there with capacity for max. On, the proxy forwards
such a launch with ``MinCount`` raised to its ``MaxCount`` (after a shortage trimmed it: to what fits).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode

Params = dict[str, str]


@dataclass
class Shortage:
    instance_type: str
    #: the zone it is short in; None: every zone
    zone: str | None
    available: int
    refusals: int | None
    until: float | None
    refused: int = 0
    restored: bool = False

    def lasts(self, now: float) -> bool:
        if self.restored or (self.refusals is not None and self.refused >= self.refusals):
            return False
        return self.until is None or now < self.until


class CapacityLater:
    """The shortages a test set (module docstring); the proxy calls :meth:`launch` for every RunInstances."""

    def __init__(self) -> None:
        self.shortages: list[Shortage] = []
        #: (instance type, zone, MinCount, MaxCount, what happened) of every launch a shortage saw
        self.seen: list[tuple[str, str | None, int, int, str]] = []
        #: a launch gets up to MaxCount instances, as EC2's does (module docstring; moto's gets MinCount)
        self.up_to_max_count = False
        self._lock = threading.Lock()

    def short(self, instance_type: str, *, zone: str | None = None, available: int = 0,
              refusals: int | None = None, after_s: float | None = None) -> Shortage:
        """From now on EC2 has room for ``available`` more ``instance_type`` instances in ``zone`` (None:
        in every zone) until ``refusals`` launches were refused, ``after_s`` seconds passed, or
        :meth:`restore`; with neither limit, until :meth:`restore`."""
        from prefect_sgpu import retry

        until = None if after_s is None else retry.CLOCK.monotonic() + after_s
        shortage = Shortage(instance_type, zone, available, refusals, until)
        with self._lock:
            self.shortages.append(shortage)
        return shortage

    def restore(self) -> None:
        """Capacity is back for every shortage."""
        with self._lock:
            for shortage in self.shortages:
                shortage.restored = True

    def reset(self) -> None:
        with self._lock:
            self.shortages.clear()
            self.seen.clear()
            self.up_to_max_count = False

    def up_to_max(self, body: bytes) -> bytes:
        """The RunInstances body to forward to moto: with :attr:`up_to_max_count`, ``MinCount`` raised to
        ``MaxCount`` (as many as EC2 would launch; a shortage already lowered ``MaxCount`` to what fits)."""
        if not self.up_to_max_count:
            return body
        fields = parse_qsl(body.decode(), keep_blank_values=True)
        most = next((v for k, v in fields if k == "MaxCount"), None)
        if most is None:
            return body
        return urlencode([(k, most if k == "MinCount" else v) for k, v in fields]).encode()

    def launch(self, params: Params, body: bytes, zone_of: Callable[[str], str | None]) -> tuple[
            tuple[str, str] | None, bytes]:
        """(the error to answer, or None; the body to forward) for one RunInstances."""
        from prefect_sgpu import retry

        with self._lock:
            if not self.shortages:
                return None, body
        itype = params.get("InstanceType", "")
        subnet = params.get("SubnetId") or params.get("NetworkInterface.1.SubnetId") or ""
        zone = params.get("Placement.AvailabilityZone") or (zone_of(subnet) if subnet else None)
        low, high = int(params.get("MinCount", "1")), int(params.get("MaxCount", "1"))
        now = retry.CLOCK.monotonic()
        with self._lock:
            shortage = next((s for s in self.shortages if s.instance_type == itype and s.zone in (None, zone)
                             and s.lasts(now)), None)
            if shortage is None:
                return None, body
            if low > shortage.available:
                shortage.refused += 1
                self.seen.append((itype, zone, low, high, "InsufficientInstanceCapacity"))
                return ("InsufficientInstanceCapacity",
                        f"We currently do not have sufficient {itype} capacity in the Availability Zone you "
                        f"requested ({zone}). Our system will be working on provisioning additional capacity. "
                        "You can currently get capacity by not specifying an Availability Zone in your request "
                        "or choosing a different Availability Zone."), body
            granted = min(high, shortage.available)
            shortage.available -= granted
            self.seen.append((itype, zone, low, high, f"launched {granted}"))
        if granted == high:
            return None, body
        fields = [(k, str(granted) if k == "MaxCount" else v)
                  for k, v in parse_qsl(body.decode(), keep_blank_values=True)]
        return None, urlencode(fields).encode()
