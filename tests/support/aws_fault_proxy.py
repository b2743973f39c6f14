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

Requests of REST and JSON services (S3 GET/PUT, SSM's JSON API) that the node's hand-written stage makes
can be failed by method and path (:meth:`AWSFaultProxy.fail_http`): S3's ``503 SlowDown`` and ``500
InternalError``, SSM's ``ThrottlingException``, or a reset connection (TCP RST, no answer). A bucket can be
put in another region (:attr:`AWSFaultProxy.bucket_regions`): a request signed for any other region is
answered ``301 PermanentRedirect`` with ``x-amz-bucket-region``, as S3 does. An access key can be made
expired (:attr:`AWSFaultProxy.expired_keys`): its requests are answered ``ExpiredToken``.

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

Groups stay in use after their instances ended (:meth:`AWSFaultProxy.hold_groups`, off by default):
``DeleteSecurityGroup`` answers ``DependencyViolation`` while the network interfaces of terminated
instances detach (minutes on AWS: https://github.com/cloud-barista/cb-spider/issues/460 "Deleting
the SG after terminating the VM makes DependencyViolation error", and
https://github.com/hashicorp/terraform-provider-aws/issues/1671 "aws_security_group:
DependencyViolation: resource sg-XXX has a dependent object"), and ``DeletePlacementGroup`` answers
``InvalidPlacementGroup.InUse`` for a short while (EC2 API reference, DeletePlacementGroup: "You
must terminate all instances in the placement group before you can delete the placement group").
The proxy records each launch's groups and each termination it forwards, and refuses for the set
number of seconds after the group's last member instance was terminated, on
:data:`prefect_sgpu.retry.CLOCK` (a test's virtual clock lets the minutes pass at once).
Prices (``prices``, :class:`support.aws_prices.PriceFeeds`, off until a test lists one): the Price List
API's ``GetProducts``, which moto lacks, and ``DescribeSpotPriceHistory`` with real windows and prices.
Capacity that comes later (``capacity_later``, :mod:`support.capacity_later`, off until a test sets a
shortage): ``InsufficientInstanceCapacity`` for an instance type in a zone, a launch of several instances
trimmed to what fits, until capacity returns (AWS docs, "Troubleshoot instance launch issues: Insufficient
instance capacity"). Three more, each off by default (a test turns it on):

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
  ``start_date`` gives the block its ``StartDate`` (a block's length is its end less its start); what
  a block like it costs is quoted by ``DescribeCapacityBlockOfferings`` from the offerings a test lists
  (``prices.list_capacity_block_offering``, :mod:`support.aws_prices`).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit
from xml.sax.saxutils import escape

from support.aws_prices import PriceFeeds
from support.capacity_later import CapacityLater
from support.launch_faults import LaunchFaults

EC2_NS = "http://ec2.amazonaws.com/doc/2016-11-15/"

#: HTTP status AWS answers each error code with (EC2 "server errors" are 5xx and retried by SDKs)
ERROR_STATUS = {
    "InsufficientInstanceCapacity": 500,
    "InsufficientCapacity": 500,
    "InsufficientReservedInstanceCapacity": 500,
    "InternalError": 500,
    "Unavailable": 503,
    "SlowDown": 503,
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
class HttpFault:
    """Answer requests whose method is ``method`` (None: any) and whose path matches ``path`` (a regular
    expression, searched; for S3 ``/<bucket>/<key>``) and, when given, whose action (``X-Amz-Target``'s
    operation or a query ``Action``) is ``action`` and whose ``User-Agent`` matches ``client`` (a regular
    expression: ``Python-urllib`` is the node's stage, ``Boto3`` the driver and the bootstrap), with
    ``code`` and ``status``, or by resetting the connection (``reset``), ``times`` times (None: always)."""

    path: str
    code: str = ""
    status: int | None = None
    method: str | None = None
    action: str | None = None
    reset: bool = False
    times: int | None = None
    message: str = ""
    client: str | None = None
    hits: int = 0

    def matches(self, method: str, path: str, action: str, agent: str = "") -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if self.action is not None and action != self.action:
            return False
        if self.client is not None and re.search(self.client, agent) is None:
            return False
        return (self.method is None or method == self.method) and re.search(self.path, path) is not None


#: the answer that tells the handler to reset the connection instead of answering
RESET = -1


@dataclass
class Recorded:
    """One request as it crossed the proxy, and how it was answered."""

    service: str
    action: str
    params: Params
    status: int = 0
    error: str | None = None
    #: the HTTP method and path (with its query) of the request: what tells S3's REST calls apart
    method: str = ""
    path: str = ""
    #: the access key that signed the request (SigV4's ``Credential=``): whose request it was, a node's
    #: (its instance profile's keys, from IMDS) or the driver's
    access_key: str = ""
    #: the request's User-Agent: botocore's (the driver, a node's bootstrap and ranks) or urllib's (a node's
    #: first stage, :mod:`prefect_sgpu.launch.ec2_stage`)
    agent: str = ""


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
    start_date: str | None = None


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
        #: REST/JSON requests failed by method and path (:meth:`fail_http`)
        self.http_faults: list[HttpFault] = []
        #: bucket -> the region it is in, for buckets not in moto's region. S3 answers a request signed for
        #: another region "301 PermanentRedirect" with the bucket's region in ``x-amz-bucket-region``
        #: (AWS S3 docs, "Making requests" / "Request redirection and the REST API"; botocore's
        #: S3RegionRedirector follows the same header)
        self.bucket_regions: dict[str, str] = {}
        #: access keys whose temporary credentials have expired: S3 answers "400 ExpiredToken", JSON
        #: services "ExpiredTokenException" (AWS docs "Retrieve security credentials from instance
        #: metadata": an instance's credentials expire, and new ones are served at least 5 minutes before)
        self.expired_keys: set[str] = set()
        #: late instance profiles, launches that die pending, ids EC2 forgot (support.launch_faults)
        self.launch_faults = LaunchFaults()
        #: capacity that comes later: InsufficientInstanceCapacity until it returns (support.capacity_later; off)
        self.capacity_later = CapacityLater()
        #: every instance of a RunInstances naming an instance profile has that profile, as on EC2 (moto 5.2
        #: associates it with the first instance only: see _profile_every_instance). True: moto's gap closed
        self.profile_every_instance = True
        #: RunInstances' network-interface rules for EFA instance types (off by default; see _efa_layout_problem)
        self.efa_rules = False
        #: seconds a group stays in use after its last member instance was terminated (hold_groups)
        self.group_hold_s: dict[str, float] = {"security group": 0.0, "placement group": 0.0}
        self._members: dict[tuple[str, str], set[str]] = {}
        self._ended: dict[str, float] = {}
        #: a cluster placement group keeps to the zone of its first instance (module docstring)
        self.bind_placement_zones = False
        #: seconds after a termination until its reservation slot is free again; None: never
        self.reservation_release_s: float | None = None
        #: the Price List API and EC2's spot price history, off until a test lists a price (support.aws_prices)
        self.prices = PriceFeeds()
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

    def fail_http(self, path: str, code: str = "", *, status: int | None = None, method: str | None = None,
                  action: str | None = None, reset: bool = False, times: int | None = None,
                  message: str = "", client: str | None = None) -> HttpFault:
        """Fail REST or JSON requests by method and path (see :class:`HttpFault`): S3's "503 SlowDown"
        (AWS S3 docs, "Best practices design patterns: optimizing Amazon S3 performance": S3 answers 503
        SlowDown while it scales a prefix), "500 InternalError", SSM's "ThrottlingException" (SSM API
        reference, "Common Errors"), or ``reset=True``: the connection is reset before any answer."""
        fault = HttpFault(path, code, status, method, action, reset, times, message or f"injected {code}", client)
        with self._lock:
            self.http_faults.append(fault)
        return fault

    def reset(self) -> None:
        """Drop rules and records (placement groups and tokens stay: they mirror moto's state)."""
        with self._lock:
            self.rules.clear()
            self.delays.clear()
            self.requests.clear()
            self.ec2_quotas.clear()
            self.http_faults.clear()
            self.bucket_regions.clear()
            self.expired_keys.clear()
            self.launch_faults.reset()
            self.capacity_later.reset()
            self.efa_rules = False
            self.group_hold_s = {"security group": 0.0, "placement group": 0.0}
            self.bind_placement_zones = False
            self.reservation_release_s = None
            self.prices.reset()

    def hold_groups(self, security_group_s: float = 0.0, placement_group_s: float = 0.0) -> None:
        """From now on a security group answers ``DependencyViolation`` and a placement group
        ``InvalidPlacementGroup.InUse`` to a delete for this many seconds (on
        :data:`prefect_sgpu.retry.CLOCK`) after the last of its instances was terminated; 0: at once."""
        with self._lock:
            self.group_hold_s = {"security group": security_group_s, "placement group": placement_group_s}

    def group_free_in(self, kind: str, name: str) -> float:
        """Seconds until a delete of the group is no longer refused (0: now)."""
        from prefect_sgpu import retry

        with self._lock:
            hold = self.group_hold_s.get(kind, 0.0)
            ended = [self._ended[i] for i in self._members.get((kind, name), ()) if i in self._ended]
        if hold <= 0 or not ended:
            return 0.0
        return max(0.0, max(ended) + hold - retry.CLOCK.monotonic())

    def _record_members(self, params: Params, payload: bytes) -> None:
        ids = re.findall(rb"<instanceId>(i-[0-9a-zA-Z]+)</instanceId>", payload)
        groups = [("security group", v) for k, v in params.items()
                  if re.fullmatch(r"(NetworkInterface\.\d+\.)?SecurityGroupId\.\d+", k)]
        if params.get("Placement.GroupName"):
            groups.append(("placement group", params["Placement.GroupName"]))
        with self._lock:
            for group in groups:
                self._members.setdefault(group, set()).update(i.decode() for i in ids)

    def _held_group(self, record: Recorded, action: str, params: Params, service: str):
        """The in-use error of a group delete while its instances' end is too recent, else None."""
        if action == "DeleteSecurityGroup":
            name = params.get("GroupId", "")
            if self.group_free_in("security group", name) > 0:
                return self._error(record, "DependencyViolation", f"resource {name} has a dependent object",
                                   400, service)
        elif action == "DeletePlacementGroup":
            name = params.get("GroupName", "")
            if self.group_free_in("placement group", name) > 0:
                return self._error(record, "InvalidPlacementGroup.InUse",
                                   f"The placement group '{name}' is in use and may not be deleted.", 400, service)
        return None

    def add_capacity_reservation(
        self, instance_type: str, availability_zone: str, count: int, state: str = "active", *,
        reservation_type: str = "default", placement_group: str | None = None, end_date: str | None = None,
        start_date: str | None = None,
    ) -> str:
        """A targeted EC2 capacity reservation; returns its id (cr-...). ``reservation_type``
        ``"capacity-block"`` makes it a Capacity Block; ``placement_group``: the cluster placement
        group it was made in (created here, as AWS creates it with the block); ``end_date``, ``start_date``:
        ISO 8601."""
        reservation_id = f"cr-{uuid.uuid4().hex[:17]}"
        with self._lock:
            self._reservations[reservation_id] = _Reservation(
                reservation_id, instance_type, availability_zone, count, count, state,
                reservation_type, placement_group, end_date, start_date=start_date,
            )
            if placement_group and placement_group not in self._groups:
                self._groups[placement_group] = _PlacementGroup(
                    placement_group, "cluster", f"pg-{uuid.uuid4().hex[:17]}")
        return reservation_id

    def calls(self, action: str) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.action == action]

    # -- request handling ----------------------------------------------------------

    def s3_requests(self) -> dict[str, int]:
        """S3's REST requests so far by kind (LIST, GET, PUT, HEAD, DELETE, POST): the request meter.
        A GET whose query asks for a listing (``list-type``, ``delimiter``, ``prefix``) is a LIST,
        billed at the PUT/LIST tier (https://aws.amazon.com/s3/pricing/, "Requests & data retrievals")."""
        counts: dict[str, int] = {}
        with self._lock:
            records = [r for r in self.requests if r.service == "rest" and r.method]
        for r in records:
            query = r.path.partition("?")[2]
            kind = r.method
            if r.method == "GET" and any(q in query for q in ("list-type", "delimiter=", "prefix=")):
                kind = "LIST"
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    def s3_kms_writes(self) -> list[tuple[str, bool]]:
        """``(path, bucket key asked)`` of each SSE-KMS object write recorded (a PUT of an object, a multipart
        upload's start; a part carries no encryption headers). A write without a Bucket Key costs a KMS
        request for its object, and so does every read of that object; with one, S3 asks KMS once per
        bucket key's life (https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucket-key.html, "Reducing
        the cost of SSE-KMS with Amazon S3 Bucket Keys"): the meter of what the store's encryption bills."""
        with self._lock:
            records = [r for r in self.requests if r.service == "rest" and r.method in ("PUT", "POST")]
        found = []
        for r in records:
            query = r.path.partition("?")[2]
            first_write = (r.method == "PUT" and "partNumber=" not in query) or \
                (r.method == "POST" and re.search(r"(^|&)uploads(=|&|$)", query) is not None)
            if first_write and r.params.get("x-amz-server-side-encryption") == "aws:kms":
                asked = r.params.get("x-amz-server-side-encryption-bucket-key-enabled", "").lower() == "true"
                found.append((r.path.partition("?")[0], asked))
        return found

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
                if status == RESET:  # a TCP RST: the client reads "connection reset by peer"
                    import socket
                    import struct

                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
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
        record = Recorded(service, action, params, method=method, path=path, access_key=_access_key(headers),
                          agent=next((v for k, v in headers.items() if k.lower() == "user-agent"), ""))
        with self._lock:
            self.requests.append(record)
            agent = next((v for k, v in headers.items() if k.lower() == "user-agent"), "")
            fault = next((f for f in self.http_faults if f.matches(method, path, action, agent)), None)
            if fault is not None:
                fault.hits += 1
        if fault is not None:
            if fault.reset:
                record.error = "connection reset"
                return RESET, [], b""
            return self._error(record, fault.code, fault.message, fault.status, service)
        moved = self._s3_elsewhere(record, path, headers, service)
        if moved is not None:
            return moved
        with self._lock:
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
                if service == "ec2" and gate.encode_ec2_messages:
                    from support.iam_gate import encode_refusal

                    message = (f"You are not authorized to perform this operation. {message}. Encoded authorization "
                               f"failure message: {encode_refusal(gate, refused, refused.context or {})}")
                return self._error(record, code, message, status, service)
        if rule is not None and not rule.after_forward:
            return self._error(record, rule.code, rule.message, rule.status, service)
        self.launch_faults.saw(service, action, params)
        late = self.launch_faults.refuse(service, action, params)
        if late is not None:
            return self._error(record, late[0], late[1], None, service)
        held = self._held_group(record, action, params, service) if service == "ec2" else None
        if held is not None:
            return held
        if service == "ec2" and action in (
            "CreatePlacementGroup",
            "DescribePlacementGroups",
            "DeletePlacementGroup",
        ):
            result = self._placement_groups(action, params)
        elif service == "ec2" and action == "DescribeCapacityReservations":
            result = self._describe_reservations(params)
        elif service == "ec2" and action == "RunInstances":
            with self._lock:
                replayed = params.get("ClientToken", "") in self._tokens
            short, body = (None, body) if replayed else self.capacity_later.launch(
                params, body, lambda subnet: self._subnet_zone(subnet, headers))
            if short is not None:
                return self._error(record, short[0], short[1], None, service)
            body = self.capacity_later.up_to_max(body)  # as many as fit, up to MaxCount (support.capacity_later)
            result = self._run_instances(method, path, headers, body, params)
        elif service == "iam" and action == "SimulatePrincipalPolicy":
            from support.iam_gate import simulate_principal_policy

            result = 200, [("Content-Type", "text/xml")], simulate_principal_policy(params)
        elif service == "iam" and action == "SimulateCustomPolicy":
            from support.iam_gate import simulate_custom_policy

            result = 200, [("Content-Type", "text/xml")], simulate_custom_policy(params)
        elif service == "sts" and action == "DecodeAuthorizationMessage":
            from support.iam_gate import decode_answer

            status, answer = decode_answer(gate, params)
            result = status, [("Content-Type", "text/xml")], answer
        elif service == "ec2" and action in ("GetEbsDefaultKmsKeyId", "ResetEbsDefaultKmsKeyId"):
            result = self._ebs_default_key(action, headers)
        elif service == "json:TrentService" and action == "DescribeKey":
            result = self._describe_key(self._forward(method, path, headers, body))
        elif service == "json:ServiceQuotasV20190624" and params.get("ServiceCode") == "ec2" and action in (
                "GetServiceQuota", "GetAWSDefaultServiceQuota"):
            result = self._ec2_quota(record, params, service)
        elif self.prices.serves(service, action):
            result = self.prices.answer(action, params)
        else:
            result = self._forward(method, path, headers, body)
        if service == "ec2" and result[0] < 400:
            result = self._launch_outcome(action, params, headers, result)
        if service == "ec2" and action == "TerminateInstances" and result[0] < 400:
            from prefect_sgpu import retry

            with self._lock:
                for key, value in params.items():
                    if key.startswith("InstanceId."):
                        self._ended.setdefault(value, retry.CLOCK.monotonic())
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

    def _s3_elsewhere(self, record: Recorded, path: str, headers: dict[str, str], service: str):
        """S3's answer to a request signed for a region its bucket is not in, or with expired keys; else None."""
        auth = {k.lower(): v for k, v in headers.items()}.get("authorization", "")
        found = re.search(r"Credential=([^/]+)/\d+/([^/]+)/", auth)
        if found is None:
            return None
        with self._lock:
            expired = found.group(1) in self.expired_keys
            bucket = urlsplit(path).path.lstrip("/").split("/", 1)[0]
            region = self.bucket_regions.get(bucket) if service == "rest" else None
        if expired:
            code = "ExpiredTokenException" if service.startswith("json:") else "ExpiredToken"
            return self._error(record, code, "The security token included in the request is expired", 400, service)
        if region is None or region == found.group(2):
            return None
        record.status, record.error = 301, "PermanentRedirect"
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>PermanentRedirect</Code><Message>The bucket '
                f"you are attempting to access must be addressed using the specified endpoint.</Message>"
                f"<Bucket>{escape(bucket)}</Bucket><Endpoint>s3.{region}.amazonaws.com</Endpoint></Error>")
        return 301, [("Content-Type", "application/xml"), ("x-amz-bucket-region", region)], body.encode()

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

    def _launch_outcome(self, action: str, params: Params, headers: dict[str, str],
                        result: tuple[int, list, bytes]) -> tuple[int, list, bytes]:
        """A launch's instances that die pending are terminated in moto before the caller hears of them
        (support.launch_faults); DescribeInstances answers carry their state reasons."""
        status, resp_headers, payload = result
        if action == "RunInstances":
            ids = re.findall(rb"<instanceId>(i-[0-9a-f]+)</instanceId>", payload)
            dead = self.launch_faults.launched(params, [i.decode() for i in ids])
            if dead:
                body = "Action=TerminateInstances&Version=2016-11-15&" + "&".join(
                    f"InstanceId.{n}={i}" for n, i in enumerate(dead, 1))
                out = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}
                self._forward("POST", "/", out, body.encode())
                if self.on_terminate is not None:
                    self.on_terminate(dead)
            return result
        rewritten = self.launch_faults.rewrite(action, payload)
        if rewritten is payload:
            return result
        return status, [(k, v) for k, v in resp_headers if k.lower() != "content-length"], rewritten

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
        problem = _efa_layout_problem(params) if self.efa_rules else None
        if problem:
            return self._ec2_fail(*problem)
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
            if status == 200 and self.profile_every_instance:
                payload = self._profile_every_instance(params, headers, payload)
            if status == 200:
                self._record_members(params, payload)
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

    def _profile_every_instance(self, params: Params, headers: dict[str, str], payload: bytes) -> bytes:
        """Every instance of an accepted RunInstances that names an instance profile gets that profile, in
        moto's state (DescribeInstances, the simulator's IMDS) and in the answer. EC2 launches each instance
        of the request with the profile (EC2 API reference, RunInstances: ``IamInstanceProfile``, "The name
        or Amazon Resource Name (ARN) of an IAM instance profile"; AWS docs "Use an IAM role to grant
        permissions to applications running on Amazon EC2 instances": the role's credentials reach the
        applications of each instance launched with the profile). moto 5.2's ``run_instances``
        (moto/ec2/responses/instances.py) calls ``associate_iam_instance_profile`` for
        ``new_reservation.instances[0]`` only, so the second node of a two-node launch had none."""
        name = params.get("IamInstanceProfile.Name", "")
        arn = params.get("IamInstanceProfile.Arn", "")
        if not (name or arn):
            return payload
        root = ET.fromstring(payload)
        ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
        missing = [item for item in root.iter(f"{ns}item")
                   if item.find(f"{ns}instanceId") is not None and item.find(f"{ns}iamInstanceProfile") is None]
        if not missing:
            return payload
        out = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}
        which = f"IamInstanceProfile.Name={quote(name)}" if name else f"IamInstanceProfile.Arn={quote(arn)}"
        for item in missing:
            instance_id = item.findtext(f"{ns}instanceId", "")
            call = f"Action=AssociateIamInstanceProfile&Version=2016-11-15&InstanceId={instance_id}&{which}"
            status, _, answer = self._forward("POST", "/", out, call.encode())
            if status != 200:
                raise RuntimeError(f"moto did not associate profile {name or arn} with {instance_id}: {answer!r}")
            association = ET.fromstring(answer).find(f".//{ns}iamInstanceProfileAssociation")
            given = association.find(f"{ns}iamInstanceProfile") if association is not None else None
            profile = ET.SubElement(item, f"{ns}iamInstanceProfile")
            ET.SubElement(profile, f"{ns}arn").text = given.findtext(f"{ns}arn", arn) if given is not None else arn
            ET.SubElement(profile, f"{ns}id").text = given.findtext(f"{ns}id", "") if given is not None else ""
        ET.register_namespace("", ns.strip("{}") or EC2_NS)
        return ET.tostring(root, encoding="utf-8", xml_declaration=True)

    def _ebs_default_key(self, action: str, headers: dict[str, str]) -> tuple[int, list, bytes]:
        """EC2's default EBS key from moto's state (moto 5.2 sets it, ModifyEbsDefaultKmsKeyId, but answers
        neither the read nor the reset): ``alias/aws/ebs`` until a customer key was set. Source:
        https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_GetEbsDefaultKmsKeyId.html"""
        from moto.ec2.models import ec2_backends

        scope = re.search(r"Credential=[^/]+/[^/]+/([^/]+)/", {k.lower(): v for k, v in headers.items()}.get(
            "authorization", ""))
        backend = ec2_backends["123456789012"][scope.group(1) if scope else "us-east-1"]
        if action == "ResetEbsDefaultKmsKeyId":
            backend.default_kms_key_id = ""
        key = backend.default_kms_key_id or "alias/aws/ebs"
        return self._ec2_ok(action, f"<kmsKeyId>{escape(key)}</kmsKeyId>")

    @staticmethod
    def _describe_key(result: tuple[int, list, bytes]) -> tuple[int, list, bytes]:
        """KMS's DescribeKey with ``KeyManager: AWS`` for the keys of ``alias/aws/*`` (moto says
        CUSTOMER for every key). Source: "AWS managed keys",
        https://docs.aws.amazon.com/kms/latest/developerguide/concepts.html#aws-managed-cmk"""
        status, headers, payload = result
        if status != 200:
            return result
        from moto.kms.models import kms_backends

        answer = json.loads(payload)
        meta = answer.get("KeyMetadata", {})
        region = meta.get("Arn", "::::").split(":")[3]
        key = kms_backends[meta.get("AWSAccountId", "123456789012")][region].keys.get(meta.get("KeyId", ""))
        if key is not None and any(a.startswith("alias/aws/") for a in key.aliases):
            meta["KeyManager"] = "AWS"
            payload = json.dumps(answer).encode()
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
        return status, headers, payload
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
                + (f"<startDate>{r.start_date}</startDate>" if r.start_date else "")
                + "</item>"
                for r in self._reservations.values()
                if not ids or r.reservation_id in ids
            )
        return self._ec2_ok(
            "DescribeCapacityReservations", f"<capacityReservationSet>{items}</capacityReservationSet>"
        )


#: DescribeInstanceTypes' NetworkInfo.MaximumNetworkCards of the EFA types the catalog launches
_NETWORK_CARDS = {"p4d.24xlarge": 4, "p4de.24xlarge": 4, "p5.48xlarge": 32, "p5e.48xlarge": 32, "p5en.48xlarge": 16}


def _efa_layout_problem(params: Params) -> tuple[str, str] | None:
    """What EC2 refuses in a RunInstances' NetworkInterfaces, where moto accepts anything:
    - the primary interface (network card 0, device index 0) may not be ``efa-only`` ("You can't use an
      EFA-only network interface as the primary network interface": AWS EC2 User Guide, "Maximize network
      bandwidth on Amazon EC2 instances with multiple network cards", efa-acc-inst-types.html);
    - one interface per (network card, device index), on a network card the type has (ibid., "Network
      cards", using-eni.html#network-cards: the card index ranges over MaximumNetworkCards)."""
    seen: set[tuple[int, int]] = set()
    cards = _NETWORK_CARDS.get(params.get("InstanceType", ""))
    n = 1
    while f"NetworkInterface.{n}.DeviceIndex" in params:
        card = int(params.get(f"NetworkInterface.{n}.NetworkCardIndex", "0"))
        device = int(params[f"NetworkInterface.{n}.DeviceIndex"])
        kind = params.get(f"NetworkInterface.{n}.InterfaceType", "interface")
        if (card, device) == (0, 0) and kind == "efa-only":
            return ("InvalidParameterCombination", "An EFA-only network interface cannot be the primary network "
                    "interface (network card index 0, device index 0).")
        if (card, device) in seen:
            return ("InvalidParameterValue", f"More than one network interface has network card index {card} "
                    f"and device index {device}.")
        if cards is not None and card >= cards:
            return ("InvalidParameterValue", f"Network card index {card} is out of range for "
                    f"{params['InstanceType']} ({cards} network cards).")
        seen.add((card, device))
        n += 1
    return None


def _access_key(headers: dict[str, str]) -> str:
    """The access key id a SigV4 request was signed with (``Authorization: ... Credential=AKID/date/...``)."""
    auth = next((v for k, v in headers.items() if k.lower() == "authorization"), "")
    return auth.partition("Credential=")[2].partition("/")[0]


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
