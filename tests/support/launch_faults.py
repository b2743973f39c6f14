"""EC2's launch-side lateness and losses that moto does not model, applied by the fault proxy.

Each behaviour is off until a test turns it on (:attr:`AWSFaultProxy.launch_faults
<support.aws_fault_proxy.AWSFaultProxy.launch_faults>`), and ends with the test (``aws_faults`` resets it):

- :meth:`LaunchFaults.late_profile`: an instance profile EC2 does not accept until some seconds after IAM
  wrote it. AWS: "Changes that I make are not always immediately visible" (IAM User Guide,
  troubleshooting: IAM is eventually consistent); hashicorp/terraform-provider-aws#838 and
  hashicorp/packer#3672 show ``InvalidParameterValue: Value (...) for parameter iamInstanceProfile.name
  is invalid. Invalid IAM Instance Profile name`` for a profile created seconds before. Time is read from
  :attr:`LaunchFaults.clock` (a test's virtual clock), restarted when IAM writes the profile or adds a
  role to it.
- :meth:`LaunchFaults.die_pending`: an accepted launch whose instances go ``pending`` -> ``terminated``
  with a state reason. AWS: "Troubleshoot Amazon EC2 instance launch issues: Instance terminates
  immediately" (``Client.InternalError``: an encrypted EBS volume whose KMS key cannot be used;
  ``Server.InsufficientInstanceCapacity``) and the ``StateReason`` codes of the EC2 API reference
  (``Server.SpotInstanceTermination``). moto terminates the instances (before RunInstances answers, so no
  DescribeInstances ever sees them running) and the proxy writes the reason into DescribeInstances.
- :meth:`LaunchFaults.forget`: an instance id EC2 no longer knows (terminated instances drop out of
  DescribeInstances after about an hour, per the EC2 User Guide "Terminated instances"). A request that
  names it (DescribeInstances or TerminateInstances with ``InstanceId.N``) fails as a whole with
  ``InvalidInstanceID.NotFound``, as EC2 answers for explicit ids (EC2 API reference, DescribeInstances:
  "If you specify an instance ID that is not valid, an error is returned"); a filtered DescribeInstances
  leaves it out. moto keeps terminated instances forever.
"""

from __future__ import annotations

import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

EC2_NS = "http://ec2.amazonaws.com/doc/2016-11-15/"

Params = dict[str, str]


@dataclass
class _LateProfile:
    name: str
    seconds: float
    code: str
    since: float
    refused: int = 0


@dataclass
class _DiePending:
    code: str
    message: str
    nth: int
    count: int
    where: Callable[[Params], bool] | None
    seen: int = 0


class LaunchFaults:
    """The state of the behaviours above; the proxy calls :meth:`refuse` before forwarding a request,
    :meth:`launched` after a RunInstances moto accepted and :meth:`rewrite` on every EC2 answer."""

    def __init__(self) -> None:
        #: anything with ``monotonic()`` (tests pass their ``virtual_clock``); None: real time
        self.clock: Any = None
        self._late: dict[str, _LateProfile] = {}
        self._dying: list[_DiePending] = []
        self._reasons: dict[str, tuple[str, str]] = {}
        self._forgotten: set[str] = set()
        self._counted: set[str] = set()
        self._lock = threading.Lock()

    def now(self) -> float:
        return self.clock.monotonic() if self.clock is not None else time.monotonic()

    # -- what a test turns on ------------------------------------------------------

    def late_profile(self, name: str, seconds: float, code: str = "InvalidParameterValue") -> None:
        """RunInstances naming instance profile ``name`` fails with ``code`` (``InvalidParameterValue``, or
        ``UnauthorizedOperation`` as iam:PassRole on a role IAM has not propagated) until ``seconds`` after
        IAM last wrote the profile (or after this call, for a profile written before)."""
        with self._lock:
            self._late[name] = _LateProfile(name, seconds, code, self.now())

    def die_pending(self, code: str, message: str = "", *, nth: int = 1, count: int = 1,
                    where: Callable[[Params], bool] | None = None) -> None:
        """Of the instances launched from now on by RunInstances calls whose parameters satisfy ``where``,
        numbers ``nth`` .. ``nth + count - 1`` (1-based, in launch order) die pending with state reason
        ``code``."""
        with self._lock:
            self._dying.append(_DiePending(code, message or f"{code}: injected", nth, count, where))

    def forget(self, *instance_ids: str) -> None:
        """EC2 no longer knows these ids (see the module docstring)."""
        with self._lock:
            self._forgotten.update(instance_ids)

    def refused_profile(self, name: str) -> int:
        """How many launches naming profile ``name`` were refused as not propagated yet."""
        with self._lock:
            late = self._late.get(name)
            return late.refused if late else 0

    def reset(self) -> None:
        with self._lock:
            self.clock = None
            self._late.clear()
            self._dying.clear()
            self._reasons.clear()
            self._forgotten.clear()
            self._counted.clear()

    # -- what the proxy calls --------------------------------------------------------

    def saw(self, service: str, action: str, params: Params) -> None:
        """IAM wrote a profile: its propagation starts again."""
        if service == "iam" and action in ("CreateInstanceProfile", "AddRoleToInstanceProfile"):
            with self._lock:
                late = self._late.get(params.get("InstanceProfileName", ""))
                if late is not None:
                    late.since = self.now()

    def refuse(self, service: str, action: str, params: Params) -> tuple[str, str] | None:
        """(code, message) of an error to answer instead of forwarding, or None."""
        if service != "ec2":
            return None
        if action in ("DescribeInstances", "TerminateInstances"):
            with self._lock:
                unknown = [v for k, v in sorted(params.items()) if k.startswith("InstanceId.")
                           and v in self._forgotten]
            if len(unknown) == 1:
                return "InvalidInstanceID.NotFound", f"The instance ID '{unknown[0]}' does not exist"
            if unknown:
                return "InvalidInstanceID.NotFound", f"The instance IDs '{', '.join(unknown)}' do not exist"
        if action == "RunInstances":
            profile = params.get("IamInstanceProfile.Name") or params.get("IamInstanceProfile.Arn", "").split("/")[-1]
            with self._lock:
                late = self._late.get(profile)
                if late is None or self.now() - late.since >= late.seconds:
                    return None
                late.refused += 1
            if late.code == "UnauthorizedOperation":
                return late.code, ("You are not authorized to perform this operation. User: "
                                   "arn:aws:iam::123456789012:user/driver is not authorized to perform: "
                                   f"iam:PassRole on resource: arn:aws:iam::123456789012:role/{profile}")
            return late.code, (f"Value ({profile}) for parameter iamInstanceProfile.name is invalid. "
                               "Invalid IAM Instance Profile name")
        return None

    def launched(self, params: Params, instance_ids: list[str]) -> list[str]:
        """The ids of this new launch that die pending (the proxy terminates them in moto)."""
        dead = []
        with self._lock:
            fresh = [i for i in instance_ids if i not in self._counted]  # a retried token: the same launch
            self._counted.update(fresh)
            for rule in self._dying:
                if rule.where is not None and not rule.where(params):
                    continue
                for instance_id in fresh:
                    rule.seen += 1
                    if rule.nth <= rule.seen < rule.nth + rule.count:
                        self._reasons[instance_id] = (rule.code, rule.message)
                        dead.append(instance_id)
        return dead

    def rewrite(self, action: str, payload: bytes) -> bytes:
        """A DescribeInstances answer with the state reasons of instances that died pending, and without
        the instances EC2 no longer knows."""
        if action != "DescribeInstances":
            return payload
        with self._lock:
            reasons, forgotten = dict(self._reasons), set(self._forgotten)
        if not (reasons or forgotten) or not any(i.encode() in payload for i in (*reasons, *forgotten)):
            return payload
        root = ET.fromstring(payload)
        ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
        ET.register_namespace("", ns.strip("{}") or EC2_NS)
        for reservations in root.iter(f"{ns}reservationSet"):
            for reservation in list(reservations):
                instances = reservation.find(f"{ns}instancesSet")
                for item in list(instances if instances is not None else ()):
                    instance_id = item.findtext(f"{ns}instanceId", "")
                    if instance_id in forgotten:
                        instances.remove(item)  # type: ignore[union-attr]
                    elif instance_id in reasons:
                        code, message = reasons[instance_id]
                        for old in item.findall(f"{ns}stateReason"):
                            item.remove(old)
                        reason = ET.SubElement(item, f"{ns}stateReason")
                        ET.SubElement(reason, f"{ns}code").text = code
                        ET.SubElement(reason, f"{ns}message").text = message
                        transition = item.find(f"{ns}reason")
                        if transition is not None:
                            transition.text = message
                if instances is not None and len(instances) == 0:
                    reservations.remove(reservation)
        return ET.tostring(root, encoding="utf-8", xml_declaration=True)
