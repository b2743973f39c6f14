"""An HTTP proxy in front of moto that injects real AWS error responses by rule.

Code under test keeps its real boto3 clients; only their endpoint points here. Each
request is recorded (action and parameters, as they crossed the wire) and then, by
rule, either answered with an AWS error in the service's own wire format (EC2 XML
``<Response><Errors>`` with the HTTP status AWS uses, or the JSON ``__type`` body of
JSON-protocol services) or forwarded to moto unchanged. That lets tests drive
botocore's real retry, error parsing and waiter paths: a capacity error in one
subnet, the first N calls throttled, a response lost after the launch happened.
A delay rule (:meth:`AWSFaultProxy.delay`) holds matching requests (say, uploads
under one key pattern) for a while before forwarding them, as a slow link would;
other requests pass meanwhile.

Moto 5.2 lacks three EC2 behaviours that provisioning relies on, so the proxy
supplies them in front of moto, following the EC2 API reference:

- placement groups (``CreatePlacementGroup``, ``DescribePlacementGroups``,
  ``DeletePlacementGroup``; ``RunInstances`` into an unknown group fails with
  ``InvalidPlacementGroup.Unknown``);
- ``RunInstances`` idempotency: a repeated ``ClientToken`` with the same parameters
  returns the first launch instead of launching again, and with other parameters
  fails with ``IdempotentParameterMismatch``;
- capacity reservations (``DescribeCapacityReservations`` for reservations a test
  adds with :meth:`AWSFaultProxy.add_capacity_reservation`; a targeted launch
  larger than what is left fails with ``ReservationCapacityExceeded``).

Three more, each off by default (a test turns it on):

- ``bind_placement_zones``: a cluster placement group is bound to the Availability Zone of its
  first instance; a launch into it from a subnet of another zone fails with
  ``InvalidPlacementGroup.InUse`` (AWS docs, "Placement groups: rules and limitations": a cluster
  placement group can't span multiple Availability Zones).
- ``reservation_release_s``: a reservation's slot comes back that many seconds (on
  :data:`prefect_sgpu.retry.CLOCK`, which the ``virtual_clock`` fixture makes virtual) after its
  instance was terminated; until then a launch into it fails with ``ReservationCapacityExceeded``
  (AWS docs, "Capacity Blocks for ML": a terminated instance's capacity is not available again for
  some minutes). ``None`` (the default): a slot, once used, never comes back.
- capacity blocks (``add_capacity_reservation(reservation_type="capacity-block", ...)``):
  DescribeCapacityReservations returns ``ReservationType``, ``PlacementGroupArn`` and ``EndDate``;
  a launch into a capacity block without ``InstanceMarketOptions.MarketType=capacity-block`` fails
  with ``InvalidParameterValue`` "The market type (purchasing) option is not valid" (the error
  users report, terraform-aws-modules/terraform-aws-ec2-instance PR #404; RunInstances docs,
  InstanceMarketOptionsRequest), and a launch into a reservation made in a cluster placement group
  that names another group fails with ``InvalidParameterCombination`` (AWS docs, "Capacity
  Reservations in cluster placement groups": instances must be launched into that group).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit
from xml.sax.saxutils import escape

EC2_NS = "http://ec2.amazonaws.com/doc/2016-11-15/"

#: HTTP status AWS answers each error code with (EC2 "server errors" are 5xx and retried by SDKs)
ERROR_STATUS = {
    "InsufficientInstanceCapacity": 500,
    "InsufficientCapacity": 500,
    "InsufficientReservedInstanceCapacity": 500,
    "InternalError": 500,
    "Unavailable": 503,
    "ServiceUnavailable": 503,
    "ReservationCapacityExceeded": 400,
    "RequestLimitExceeded": 503,
    "Throttling": 400,
    "ThrottlingException": 400,
    "SpotMaxPriceTooLow": 400,
    "MaxSpotInstanceCountExceeded": 400,
    "InstanceLimitExceeded": 400,
    "UnauthorizedOperation": 403,
    "AuthFailure": 401,
}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "proxy-connection"}

Params = dict[str, str]


@dataclass
class FaultRule:
    """Answer ``action`` with ``code`` when ``where(params)`` holds, ``times`` times (None: always)."""

    action: str
    code: str
    message: str = ""
    status: int | None = None
    times: int | None = None
    where: Callable[[Params], bool] | None = None
    after_forward: bool = False  # forward first (the call takes effect), then lose the response
    hits: int = 0

    def matches(self, action: str, params: Params) -> bool:
        if action != self.action or (self.times is not None and self.hits >= self.times):
            return False
        return self.where is None or bool(self.where(params))


@dataclass
class DelayRule:
    """Hold requests whose method is ``method`` (None: any) and whose path matches ``path``
    (a regular expression, searched) ``seconds`` before forwarding them, ``times`` times (None: always)."""

    path: str
    seconds: float
    method: str | None = None
    times: int | None = None
    hits: int = 0
    #: how many of the held requests were forwarded and answered
    done: int = 0

    def matches(self, method: str, path: str) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        return (self.method is None or method == self.method) and re.search(self.path, path) is not None


@dataclass
class Recorded:
    """One request as it crossed the proxy, and how it was answered."""

    service: str
    action: str
    params: Params
    status: int = 0
    error: str | None = None


@dataclass
class _Reservation:
    reservation_id: str
    instance_type: str
    availability_zone: str
    total: int
    available: int
    state: str = "active"
    reservation_type: str = "default"
    placement_group: str | None = None
    end_date: str | None = None
    #: the instances launched into it, and when each terminated one's slot comes back
    instances: set[str] = field(default_factory=set)
    releasing: list[float] = field(default_factory=list)


@dataclass
class _PlacementGroup:
    name: str
    strategy: str
    group_id: str
    tags: dict[str, str] = field(default_factory=dict)
    #: the Availability Zone of its first instance (``bind_placement_zones``)
    zone: str | None = None


def _tag_specifications(params: Params, resource_type: str) -> dict[str, str]:
    tags: dict[str, str] = {}
    n = 1
    while f"TagSpecification.{n}.ResourceType" in params:
        if params[f"TagSpecification.{n}.ResourceType"] == resource_type:
            m = 1
            while f"TagSpecification.{n}.Tag.{m}.Key" in params:
                tags[params[f"TagSpecification.{n}.Tag.{m}.Key"]] = params.get(
                    f"TagSpecification.{n}.Tag.{m}.Value", ""
                )
                m += 1
        n += 1
    return tags


def _indexed(params: Params, prefix: str) -> list[str]:
    values, n = [], 1
    while f"{prefix}.{n}" in params:
        values.append(params[f"{prefix}.{n}"])
        n += 1
    return values


def _filters(params: Params) -> dict[str, list[str]]:
    found, n = {}, 1
    while f"Filter.{n}.Name" in params:
        found[params[f"Filter.{n}.Name"]] = _indexed(params, f"Filter.{n}.Value")
        n += 1
    return found


def ec2_error_body(code: str, message: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error>'
        f"<Code>{escape(code)}</Code><Message>{escape(message)}</Message>"
        f"</Error></Errors><RequestID>{uuid.uuid4()}</RequestID></Response>"
    ).encode()


class AWSFaultProxy:
    """Forward to ``upstream`` (moto), answering matching requests with AWS errors."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or 80
        self.rules: list[FaultRule] = []
        self.delays: list[DelayRule] = []
        self.requests: list[Recorded] = []
        self._groups: dict[str, _PlacementGroup] = {}
        self._tokens: dict[str, tuple[str, int, bytes]] = {}
        self._reservations: dict[str, _Reservation] = {}
        self._lock = threading.RLock()
        #: called with the instance ids of every TerminateInstances moto accepted, before the caller
        #: hears back: moto marks instances terminated at once, a real one is powered off by then
        self.on_terminate: Callable[[list[str]], None] | None = None
        #: per-resource IAM authorization of the identities it watches (support.iam_gate), when set
        self.iam_gate: Any = None
        #: the account's applied EC2 quotas (Service Quotas code -> value); moto knows none of EC2's
        self.ec2_quotas: dict[str, float] = {}
        #: a cluster placement group keeps to the zone of its first instance (module docstring)
        self.bind_placement_zones = False
        #: seconds after a termination until its reservation slot is free again; None: never
        self.reservation_release_s: float | None = None
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="aws-fault-proxy", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> AWSFaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- rules and records ---------------------------------------------------------

    def fail(
        self,
        action: str,
        code: str,
        *,
        message: str = "",
        status: int | None = None,
        times: int | None = None,
        where: Callable[[Params], bool] | None = None,
        after_forward: bool = False,
    ) -> FaultRule:
        rule = FaultRule(action, code, message or f"injected {code}", status, times, where, after_forward)
        with self._lock:
            self.rules.append(rule)
        return rule

    def delay(self, path: str, seconds: float, *, method: str | None = None,
              times: int | None = None) -> DelayRule:
        """Hold every request whose path matches ``path`` (a regular expression; for S3 the path is
        ``/<bucket>/<key>``) ``seconds`` before forwarding it: a slow upload or download, while
        every other request is answered at once."""
        rule = DelayRule(path, seconds, method, times)
        with self._lock:
            self.delays.append(rule)
        return rule

    def reset(self) -> None:
        """Drop rules and records (placement groups and tokens stay: they mirror moto's state)."""
        with self._lock:
            self.rules.clear()
            self.delays.clear()
            self.requests.clear()
            self.ec2_quotas.clear()
            self.bind_placement_zones = False
            self.reservation_release_s = None

    def add_capacity_reservation(
        self, instance_type: str, availability_zone: str, count: int, state: str = "active", *,
        reservation_type: str = "default", placement_group: str | None = None, end_date: str | None = None,
    ) -> str:
        """A targeted EC2 capacity reservation; returns its id (cr-...). ``reservation_type``
        ``"capacity-block"`` makes it a Capacity Block; ``placement_group``: the cluster placement
        group it was made in (created here, as AWS creates it with the block); ``end_date``: ISO 8601."""
        reservation_id = f"cr-{uuid.uuid4().hex[:17]}"
        with self._lock:
            self._reservations[reservation_id] = _Reservation(
                reservation_id, instance_type, availability_zone, count, count, state,
                reservation_type, placement_group, end_date,
            )
            if placement_group and placement_group not in self._groups:
                self._groups[placement_group] = _PlacementGroup(
                    placement_group, "cluster", f"pg-{uuid.uuid4().hex[:17]}")
        return reservation_id

    def calls(self, action: str) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.action == action]

    # -- request handling ----------------------------------------------------------

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            # HTTP/1.1: botocore's "Expect: 100-continue" is answered at once (an HTTP/1.0 handler never
            # answers it, and every upload then waited botocore's 1 s for the continue)
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return

            def _body(self) -> bytes | None:
                """The request body, or None when the client went away before sending all of it."""
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        line = self.rfile.readline()
                        if not line:
                            return None
                        size = int(line.split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            self.rfile.readline()
                            break
                        chunk = self.rfile.read(size)
                        if len(chunk) < size:
                            return None
                        chunks.append(chunk)
                        self.rfile.readline()
                    return b"".join(chunks)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                return body if len(body) == length else None

            def _handle(self) -> None:
                body = self._body()
                if body is None:  # as a real endpoint does: a cut-short request is dropped, not stored
                    self.close_connection = True
                    return
                status, headers, payload = proxy._dispatch(self.command, self.path, dict(self.headers), body)
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in HOP_BY_HOP:
                        self.send_header(name, value)
                if self.command == "HEAD":
                    length = next((v for k, v in headers if k.lower() == "content-length"), "0")
                    self.send_header("Content-Length", length)
                    self.end_headers()
                    return
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _handle

        return Handler

    def _dispatch(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, list, bytes]:
        service, action, params = _identify(headers, body)
        record = Recorded(service, action, params)
        with self._lock:
            self.requests.append(record)
            rule = next((r for r in self.rules if r.matches(action, params)), None)
            if rule is not None:
                rule.hits += 1
            held = next((d for d in self.delays if d.matches(method, path)), None)
            if held is not None:
                held.hits += 1
        if held is not None:
            try:
                time.sleep(held.seconds)  # this request's own thread: the others go on
                return self._answer(record, rule, method, path, headers, body, service, action, params)
            finally:
                with self._lock:
                    held.done += 1
        return self._answer(record, rule, method, path, headers, body, service, action, params)

    def _answer(self, record: Recorded, rule: FaultRule | None, method: str, path: str, headers: dict[str, str],
                body: bytes, service: str, action: str, params: Params) -> tuple[int, list, bytes]:
        gate = self.iam_gate
        if gate is not None:
            gate.placement_group_tags = lambda name: dict(self._groups[name].tags) if name in self._groups else {}
            refused = gate.check(method, path, headers, body, service, action, params)
            if refused is not None:
                code, status = {"ec2": ("UnauthorizedOperation", 403), "rest": ("AccessDenied", 403)}.get(
                    service, ("AccessDeniedException", 400) if service.startswith("json:") else ("AccessDenied", 403))
                message = (f"User: {refused.identity} is not authorized to perform: {refused.action} on resource: "
                           f"{refused.resource}")
                return self._error(record, code, message, status, service)
        if rule is not None and not rule.after_forward:
            return self._error(record, rule.code, rule.message, rule.status, service)
        if service == "ec2" and action in (
            "CreatePlacementGroup",
            "DescribePlacementGroups",
            "DeletePlacementGroup",
        ):
            result = self._placement_groups(action, params)
        elif service == "ec2" and action == "DescribeCapacityReservations":
            result = self._describe_reservations(params)
        elif service == "ec2" and action == "RunInstances":
            result = self._run_instances(method, path, headers, body, params)
        elif service == "iam" and action == "SimulatePrincipalPolicy":
            from support.iam_gate import simulate_principal_policy

            result = 200, [("Content-Type", "text/xml")], simulate_principal_policy(params)
        elif service == "json:ServiceQuotasV20190624" and params.get("ServiceCode") == "ec2" and action in (
                "GetServiceQuota", "GetAWSDefaultServiceQuota"):
            result = self._ec2_quota(record, params, service)
        else:
            result = self._forward(method, path, headers, body)
        if service == "ec2" and action == "TerminateInstances" and result[0] < 400:
            self._release_slots([v for k, v in params.items() if k.startswith("InstanceId.")])
        hook = self.on_terminate
        if service == "ec2" and action == "TerminateInstances" and result[0] < 400 and hook is not None:
            hook([v for k, v in sorted(params.items()) if k.startswith("InstanceId.")])
        if rule is not None:  # the call happened upstream; the caller never hears back
            return self._error(record, rule.code, rule.message, rule.status, service)
        record.status = result[0]
        if result[0] >= 400:  # moto's own errors and the EC2 behaviour above, recorded alike
            found = re.search(rb"<Code>([^<]+)</Code>|\"__type\"\s*:\s*\"([^\"]+)\"", result[2])
            record.error = (found.group(1) or found.group(2)).decode() if found else str(result[0])
        return result

    def _error(self, record: Recorded, code: str, message: str, status: int | None, service: str):
        """The error in the wire format of the service that was called."""
        status = status or ERROR_STATUS.get(code, 400)
        record.status, record.error = status, code
        xml = [("Content-Type", "text/xml;charset=UTF-8")]
        request_id = uuid.uuid4()
        if service.startswith("json:"):
            body = json.dumps({"__type": code, "message": message}).encode()
            return status, [("Content-Type", "application/x-amz-json-1.1")], body
        if service == "ec2":
            return status, xml, ec2_error_body(code, message)
        if service == "rest":  # S3
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{escape(code)}</Code>'
                f"<Message>{escape(message)}</Message><RequestId>{request_id}</RequestId></Error>"
            )
            return status, xml, body.encode()
        body = (  # other query-protocol services (IAM, STS, ...)
            f'<?xml version="1.0" encoding="UTF-8"?>\n<ErrorResponse><Error><Type>Sender</Type>'
            f"<Code>{escape(code)}</Code><Message>{escape(message)}</Message></Error>"
            f"<RequestId>{request_id}</RequestId></ErrorResponse>"
        )
        return status, xml, body.encode()

    def _forward(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, list, bytes]:
        conn = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=60)
        try:
            out = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}
            out["Host"] = f"{self.upstream_host}:{self.upstream_port}"
            if body or method in ("POST", "PUT", "PATCH"):
                out["Content-Length"] = str(len(body))
            conn.request(method, path, body=body or None, headers=out)
            resp = conn.getresponse()
            payload = resp.read()
            return resp.status, resp.getheaders(), payload
        finally:
            conn.close()

    def _ec2_quota(self, record: Recorded, params: Params, service: str) -> tuple[int, list, bytes]:
        """An EC2 quota the test set (``ec2_quotas``); an unset one is one this account never changed,
        and has no default here either."""
        code = params.get("QuotaCode", "")
        with self._lock:
            value = self.ec2_quotas.get(code)
        if value is None:
            return self._error(record, "NoSuchResourceException", f"quota {code} is not set", 400, service)
        body = {"Quota": {"ServiceCode": "ec2", "QuotaCode": code, "QuotaName": code, "Value": value,
                          "Unit": "None", "Adjustable": True, "GlobalQuota": False}}
        return 200, [("Content-Type", "application/x-amz-json-1.1")], json.dumps(body).encode()

    # -- EC2 behaviour moto lacks ----------------------------------------------------

    def _ec2_ok(self, action: str, inner: str) -> tuple[int, list, bytes]:
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<{action}Response xmlns="{EC2_NS}">'
            f"<requestId>{uuid.uuid4()}</requestId>{inner}</{action}Response>"
        ).encode()
        return 200, [("Content-Type", "text/xml;charset=UTF-8")], body

    def _ec2_fail(self, code: str, message: str) -> tuple[int, list, bytes]:
        return (
            ERROR_STATUS.get(code, 400),
            [("Content-Type", "text/xml;charset=UTF-8")],
            ec2_error_body(code, message),
        )

    @staticmethod
    def _group_xml(group: _PlacementGroup, tag: str = "item") -> str:
        tags = "".join(
            f"<item><key>{escape(k)}</key><value>{escape(v)}</value></item>" for k, v in group.tags.items()
        )
        return (
            f"<{tag}><groupName>{escape(group.name)}</groupName><state>available</state>"
            f"<strategy>{escape(group.strategy)}</strategy><groupId>{group.group_id}</groupId>"
            f"<tagSet>{tags}</tagSet></{tag}>"
        )

    def _placement_groups(self, action: str, params: Params) -> tuple[int, list, bytes]:
        with self._lock:
            if action == "CreatePlacementGroup":
                name = params.get("GroupName", "")
                if name in self._groups:
                    return self._ec2_fail(
                        "InvalidPlacementGroup.Duplicate", f"The placement group '{name}' already exists."
                    )
                group = _PlacementGroup(
                    name,
                    params.get("Strategy", "cluster"),
                    f"pg-{uuid.uuid4().hex[:17]}",
                    _tag_specifications(params, "placement-group"),
                )
                self._groups[name] = group
                return self._ec2_ok(
                    action, "<return>true</return>" + self._group_xml(group, "placementGroup")
                )
            if action == "DeletePlacementGroup":
                name = params.get("GroupName", "")
                if self._groups.pop(name, None) is None:
                    return self._ec2_fail(
                        "InvalidPlacementGroup.Unknown", f"The Placement Group '{name}' is unknown."
                    )
                return self._ec2_ok(action, "<return>true</return>")
            names = _indexed(params, "GroupName")
            for name in names:
                if name not in self._groups:
                    return self._ec2_fail(
                        "InvalidPlacementGroup.Unknown", f"The Placement Group '{name}' is unknown."
                    )
            groups = [g for g in self._groups.values() if not names or g.name in names]
            for key, values in _filters(params).items():
                if key.startswith("tag:"):
                    groups = [g for g in groups if g.tags.get(key[4:]) in values]
                elif key == "group-name":
                    groups = [g for g in groups if g.name in values]
                elif key == "strategy":
                    groups = [g for g in groups if g.strategy in values]
            items = "".join(self._group_xml(g) for g in groups)
            return self._ec2_ok(action, f"<placementGroupSet>{items}</placementGroupSet>")

    def _run_instances(self, method: str, path: str, headers: dict[str, str], body: bytes, params: Params):
        group = params.get("Placement.GroupName")
        if group:
            with self._lock:
                known = group in self._groups
            if not known:
                return self._ec2_fail(
                    "InvalidPlacementGroup.Unknown", f"The Placement Group '{group}' is unknown."
                )
        token = params.get("ClientToken", "")
        fingerprint = hashlib.sha256(
            json.dumps({k: v for k, v in sorted(params.items()) if k != "ClientToken"}).encode()
        ).hexdigest()
        with self._lock:  # one launch per token, even when retries race
            seen = self._tokens.get(token) if token else None
            if seen is not None:
                if seen[0] != fingerprint:
                    return self._ec2_fail(
                        "IdempotentParameterMismatch",
                        "The client token you have provided is associated with a resource that is already "
                        "deleted or has different parameters.",
                    )
                return seen[1], [("Content-Type", "text/xml;charset=UTF-8")], seen[2]
            reservation_id = params.get(
                "CapacityReservationSpecification.CapacityReservationTarget.CapacityReservationId"
            )
            reservation = self._reservations.get(reservation_id or "")
            if reservation_id and reservation is None:
                return self._ec2_fail(
                    "InvalidCapacityReservationId.NotFound",
                    f"The capacity reservation ID '{reservation_id}' does not exist",
                )
            if reservation is not None and reservation.reservation_type == "capacity-block" and params.get(
                    "InstanceMarketOptions.MarketType") != "capacity-block":
                return self._ec2_fail(
                    "InvalidParameterValue",
                    "The market type (purchasing) option is not valid. Choose a different market type and "
                    "try again.",
                )
            if (reservation is not None and reservation.placement_group
                    and group != reservation.placement_group):
                return self._ec2_fail(
                    "InvalidParameterCombination",
                    f"The Capacity Reservation ({reservation_id}) is in placement group "
                    f"'{reservation.placement_group}': launch into that placement group.",
                )
            if reservation is not None:
                self._take_released(reservation)
            if reservation is not None and int(params.get("MinCount", "1")) > reservation.available:
                return self._ec2_fail(
                    "ReservationCapacityExceeded",
                    f"The targeted Capacity Reservation ({reservation_id}) does not have enough available "
                    "instance capacity to fulfill your request.",
                )
            bound = self._bound_zone_refusal(group, headers, params) if self.bind_placement_zones else None
            if bound is not None:
                return bound
            status, resp_headers, payload = self._forward(method, path, headers, body)
            if status == 200:
                if token:
                    self._tokens[token] = (fingerprint, status, payload)
                if reservation is not None:
                    reservation.available -= int(params.get("MaxCount", "1"))
                    reservation.instances.update(re.findall(r"<instanceId>(i-[0-9a-f]+)</instanceId>",
                                                            payload.decode("utf-8", "replace")))
                if group and group in self._groups and self._groups[group].zone is None:
                    found = re.search(rb"<availabilityZone>([^<]+)</availabilityZone>", payload)
                    self._groups[group].zone = found.group(1).decode() if found else None
            return status, resp_headers, payload

    def _bound_zone_refusal(self, group: str | None, headers: dict[str, str],
                            params: Params) -> tuple[int, list, bytes] | None:
        """``InvalidPlacementGroup.InUse`` for a launch into a cluster group bound to another zone."""
        placed = self._groups.get(group or "")
        if placed is None or placed.strategy != "cluster" or placed.zone is None:
            return None
        subnet = params.get("SubnetId") or params.get("NetworkInterface.1.SubnetId")
        zone = params.get("Placement.AvailabilityZone")
        if zone is None and subnet:
            zone = self._subnet_zone(subnet, headers)
        if zone is None or zone == placed.zone:
            return None
        return self._ec2_fail(
            "InvalidPlacementGroup.InUse",
            f"The placement group '{placed.name}' is in use in another availability zone: {placed.zone}",
        )

    def _subnet_zone(self, subnet_id: str, headers: dict[str, str]) -> str | None:
        """The zone of a subnet, asked of moto with the caller's own (unchecked) signature headers."""
        body = f"Action=DescribeSubnets&Version=2016-11-15&SubnetId.1={subnet_id}".encode()
        keep = ("authorization", "x-amz-date", "content-type")
        out = {k: v for k, v in headers.items() if k.lower() in keep}
        status, _, payload = self._forward("POST", "/", out, body)
        found = re.search(rb"<availabilityZone>([^<]+)</availabilityZone>", payload)
        found = found if status == 200 else None
        return found.group(1).decode() if found else None

    def _release_slots(self, ids: list[str]) -> None:
        """Terminated instances' reservation slots come back ``reservation_release_s`` later."""
        if self.reservation_release_s is None:
            return
        from prefect_sgpu import retry

        now = retry.CLOCK.monotonic()
        with self._lock:
            for reservation in self._reservations.values():
                for instance_id in set(ids) & reservation.instances:
                    reservation.instances.discard(instance_id)
                    reservation.releasing.append(now + self.reservation_release_s)

    def _take_released(self, reservation: _Reservation) -> None:
        """Slots whose time has come are available again."""
        if not reservation.releasing:
            return
        from prefect_sgpu import retry

        now = retry.CLOCK.monotonic()
        due = [t for t in reservation.releasing if t <= now]
        reservation.releasing = [t for t in reservation.releasing if t > now]
        reservation.available = min(reservation.total, reservation.available + len(due))

    def _describe_reservations(self, params: Params) -> tuple[int, list, bytes]:
        with self._lock:
            for reservation in self._reservations.values():
                self._take_released(reservation)
            ids = _indexed(params, "CapacityReservationId")
            for rid in ids:
                if rid not in self._reservations:
                    return self._ec2_fail(
                        "InvalidCapacityReservationId.NotFound",
                        f"The capacity reservation ID '{rid}' does not exist",
                    )
            items = "".join(
                f"<item><capacityReservationId>{r.reservation_id}</capacityReservationId>"
                f"<instanceType>{r.instance_type}</instanceType>"
                "<instancePlatform>Linux/UNIX</instancePlatform>"
                f"<availabilityZone>{r.availability_zone}</availabilityZone><tenancy>default</tenancy>"
                f"<totalInstanceCount>{r.total}</totalInstanceCount>"
                f"<availableInstanceCount>{r.available}</availableInstanceCount><state>{r.state}</state>"
                "<instanceMatchCriteria>targeted</instanceMatchCriteria>"
                f"<reservationType>{r.reservation_type}</reservationType>"
                + (f"<placementGroupArn>arn:aws:ec2:us-east-1:123456789012:placement-group/"
                   f"{r.placement_group}</placementGroupArn>" if r.placement_group else "")
                + (f"<endDate>{r.end_date}</endDate>" if r.end_date else "")
                + "</item>"
                for r in self._reservations.values()
                if not ids or r.reservation_id in ids
            )
        return self._ec2_ok(
            "DescribeCapacityReservations", f"<capacityReservationSet>{items}</capacityReservationSet>"
        )


def _identify(headers: dict[str, str], body: bytes) -> tuple[str, str, Params]:
    """(service, action, flat parameters) of a query-protocol or JSON-protocol request."""
    lower = {k.lower(): v for k, v in headers.items()}
    target = lower.get("x-amz-target")
    if target:
        try:
            params = json.loads(body or b"{}")
        except ValueError:
            params = {}
        flat = {k: json.dumps(v) if not isinstance(v, str) else v for k, v in params.items()}
        return f"json:{target.split('.')[0]}", target.split(".")[-1], flat
    ctype = lower.get("content-type", "")
    if "x-www-form-urlencoded" in ctype:
        params = dict(parse_qsl(body.decode(), keep_blank_values=True))
        auth = lower.get("authorization", "")
        service = auth.split("Credential=")[-1].split("/")[3] if "Credential=" in auth else "query"
        return service, params.get("Action", ""), params
    return "rest", "", {k: v for k, v in lower.items() if k.startswith("x-amz-") and k not in (
        "x-amz-date", "x-amz-content-sha256", "x-amz-security-token")}
