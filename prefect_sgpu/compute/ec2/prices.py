"""What an EC2 job cost, from the prices AWS itself publishes, each figure with its source.

- **On-demand**: the AWS Price List API (``pricing:GetProducts``, served from us-east-1 for every
  region), one product per instance type and region (Linux, shared tenancy, no pre-installed
  software, capacity status ``Used``). Source ``price-list``.
- **Spot**: what EC2 charged in the zone the instance ran in, over its lifetime
  (``ec2:DescribeSpotPriceHistory``: the answer holds every change in the window and the last one
  before it, which was in effect at its start), averaged over that time. Source ``spot-history``.
- **Reservations**: a default capacity reservation is billed at the on-demand rate whether it is used
  or not. A Capacity Block is paid once, up front, when it is bought: its cost is that fee, not a rate
  per hour, and the instances that run in it cost nothing more
  (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ec2-capacity-blocks.html, "Capacity Blocks
  pricing and billing"). EC2 reports no fee for a block after the purchase (DescribeCapacityReservations
  carries none), so the fee is EC2's own quote for a block like it (``DescribeCapacityBlockOfferings``:
  the same instance type, count and length, the offering whose start is nearest the block's), an
  ``estimate``; unknown where EC2 quotes none. Source ``reservation`` (with ``usd_upfront``) or ``estimate``.
- **Offline**: where the Price List API cannot be reached or refuses (AccessDenied), the catalog's
  table of us-east-1 list prices (:mod:`prefect_sgpu.catalog`), labelled ``fallback-table``.
- **Requests and bytes**: the driver's own S3 requests and bytes, counted on its store client
  (:class:`S3Meter`), and the nodes' own requests, each node counting its own and reporting them with
  its status (:func:`nodes_requests`), priced at S3 Standard's published request and internet transfer
  rates: an ``estimate`` (a driver inside the bucket's region pays no transfer).

Prices read from AWS are kept on disk for a day (:class:`PriceCache`, under the user's cache folder),
so a job asks the Price List API at most once per instance type and region a day; the cache holds
prices and dates only, never credentials. Prices are optional, so they are read in one try (a release
never waits out a retry for one; a throttled read is the table this once); a refusal or an unreachable
endpoint is remembered in the process for an hour, so a driver without ``pricing:GetProducts`` asks
once, not once per job.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

from prefect_sgpu import aws, catalog

logger = logging.getLogger("prefect_sgpu.compute.ec2.prices")

#: every source a figure of ``result.cost`` may name
SOURCES = ("price-list", "spot-history", "reservation", "fallback-table", "estimate")
#: the Price List API answers from here for every region (AWS docs, "Using the AWS Price List Query API")
PRICING_REGION = "us-east-1"
#: a folder for the price cache instead of ``$XDG_CACHE_HOME/prefect-sgpu/prices``
CACHE_ENV = "PREFECT_SGPU_PRICE_CACHE"
#: seconds a price read from AWS is used before it is read again
CACHE_TTL_S = 86400.0
#: seconds a failed read keeps the process from asking again
FAILURE_MEMO_S = 3600.0
#: answers that mean "this identity may not read prices": asked again only after FAILURE_MEMO_S
REFUSALS = frozenset({"AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "UnrecognizedClientException",
                      "InvalidClientTokenId", "ExpiredTokenException"})
#: S3 Standard request prices (USD per 1,000) and internet transfer (USD per GB, first 10 TB a month),
#: https://aws.amazon.com/s3/pricing/ ("Requests & data retrievals", "Data Transfer"), us-east-1
S3_WRITE_USD_PER_1000 = 0.005
S3_READ_USD_PER_1000 = 0.0004
S3_INTERNET_USD_PER_GB = 0.09
#: S3 requests by price tier: PUT, COPY, POST and LIST at the write tier, GET and HEAD at the read tier
S3_WRITE_KINDS = ("PUT", "POST", "LIST")
S3_READ_KINDS = ("GET", "HEAD")
#: runs whose S3 requests a meter keeps at once (runs it counted but no release took are dropped oldest first)
METER_RUNS_KEPT = 1024


@dataclass(frozen=True)
class Price:
    """USD per hour of one instance (None: unknown), where it came from and what to know about it;
    ``usd_upfront``: a fee paid once for the whole reservation (a Capacity Block's), not per hour."""

    usd_per_hour: float | None
    source: str
    note: str = ""
    usd_upfront: float | None = None

    def shown(self) -> dict[str, Any]:
        return {"usd_per_hour": self.usd_per_hour, "source": self.source, **({"note": self.note} if self.note else {}),
                **({"usd_upfront": self.usd_upfront} if self.usd_upfront is not None else {})}


def cache_dir() -> Path:
    """``$PREFECT_SGPU_PRICE_CACHE``, else ``$XDG_CACHE_HOME/prefect-sgpu/prices`` (``~/.cache`` by default)."""
    given = os.environ.get(CACHE_ENV)
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "prefect-sgpu" / "prices"


class PriceCache:
    """One JSON file per (market, region or zone, instance type), with the time it was read."""

    def __init__(self, folder: Path | None = None, ttl_s: float = CACHE_TTL_S,
                 now: Callable[[], float] = time.time) -> None:
        self.folder = folder or cache_dir()
        self.ttl_s = ttl_s
        self.now = now

    def path(self, market: str, where: str, instance_type: str) -> Path:
        name = "_".join(re.sub(r"[^A-Za-z0-9.-]", "-", part) for part in (market, where, instance_type))
        return self.folder / f"{name}.json"

    def get(self, market: str, where: str, instance_type: str) -> dict[str, Any] | None:
        """The entry read from AWS less than a day ago, or None."""
        try:
            entry = json.loads(self.path(market, where, instance_type).read_text(encoding="utf-8"))
            read = _dt.datetime.fromisoformat(entry["read_at"]).timestamp()
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return entry if 0 <= self.now() - read < self.ttl_s else None

    def put(self, market: str, where: str, instance_type: str, entry: dict[str, Any]) -> None:
        """Keep ``entry`` (prices and dates only) with the time it was read; a cache that cannot be
        written is logged and skipped: the price is still right, only read again next time."""
        stamped = {**entry, "read_at": _dt.datetime.fromtimestamp(self.now(), _dt.timezone.utc).isoformat()}
        path = self.path(market, where, instance_type)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(stamped, sort_keys=True), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("could not keep a price in %s: %s", path, exc)


def _fallback(instance_type: str, why: str) -> Price:
    known = catalog.instance_type_by_name(instance_type)
    price = known.price_per_hour if known else None
    return Price(price, "fallback-table",
                 f"the catalog's {catalog.PRICE_REGION} on-demand list price ({why})" if price is not None
                 else f"no price: {why}, and the catalog has none for {instance_type}")


def on_demand_of(products: list[Any]) -> float | None:
    """USD per hour of the first hourly on-demand price of GetProducts' ``PriceList`` (JSON strings)."""
    for item in products:
        product = item if isinstance(item, dict) else json.loads(item)
        for term in (product.get("terms", {}).get("OnDemand") or {}).values():
            for dimension in (term.get("priceDimensions") or {}).values():
                usd = (dimension.get("pricePerUnit") or {}).get("USD")
                if usd is not None and str(dimension.get("unit", "Hrs")).lower().startswith("hr"):
                    return float(usd)
    return None


def spot_average(points: list[tuple[float, float]], start: float, end: float) -> float | None:
    """The time-weighted mean of a spot price over ``[start, end]`` from its changes ``(when, usd)``:
    each price holds from its change to the next; before the first change known, the first price."""
    if not points:
        return None
    points = sorted(points)
    if end <= start:
        return next((p for t, p in reversed(points) if t <= start), points[0][1])
    total = 0.0
    for n, (when, usd) in enumerate(points):
        since = start if n == 0 else max(start, when)
        until = min(end, points[n + 1][0]) if n + 1 < len(points) else end
        if until > since:
            total += usd * (until - since)
    return total / (end - start)


class PriceBook:
    """Prices of one account's EC2 instances: on-demand, spot and reserved (module docstring).

    ``client(service, region)``: a boto3 client (the provisioner's, with botocore's retries)."""

    def __init__(self, client: Callable[[str, str], Any], cache: PriceCache | None = None) -> None:
        self.client = client
        self.cache = cache or PriceCache()
        self._failed: dict[tuple[str, ...], tuple[float, str]] = {}
        self._lock = threading.Lock()

    def _failure(self, key: tuple[str, ...]) -> str | None:
        with self._lock:
            found = self._failed.get(key)
        return found[1] if found and time.monotonic() < found[0] else None

    def _remember_failure(self, key: tuple[str, ...], why: str) -> None:
        with self._lock:
            self._failed[key] = (time.monotonic() + FAILURE_MEMO_S, why)

    def on_demand(self, instance_type: str, region: str) -> Price:
        """The Price List API's on-demand price (cached a day); the catalog's table when it cannot be read."""
        cached = self.cache.get("on-demand", region, instance_type)
        if cached is not None:
            return Price(cached.get("usd_per_hour"), "price-list", cached.get("note", ""))
        failed = self._failure(("pricing",))
        if failed:
            return _fallback(instance_type, failed)
        filters = {"ServiceCode": "AmazonEC2", "FormatVersion": "aws_v1", "MaxResults": 10, "Filters": [
            {"Type": "TERM_MATCH", "Field": field, "Value": value} for field, value in (
                ("instanceType", instance_type), ("regionCode", region), ("operatingSystem", "Linux"),
                ("tenancy", "Shared"), ("preInstalledSw", "NA"), ("capacitystatus", "Used"))]}
        try:
            answer = self.client("pricing", PRICING_REGION).get_products(**filters)
        except Exception as exc:  # noqa: BLE001 - unreachable, refused: the table, labelled as such
            code, message = aws.error_of(exc)
            why = f"the Price List API answered {code}" if code else f"the Price List API is unreachable: {message}"
            logger.warning("on-demand price of %s in %s: %s; using the catalog's table", instance_type, region, why)
            if not code or code in REFUSALS:  # unreachable or refused stays so for a while; a throttle does not
                self._remember_failure(("pricing",), why)
            return _fallback(instance_type, why)
        usd = on_demand_of(answer.get("PriceList") or [])
        note = ("" if usd is not None
                else f"the Price List API lists no Linux on-demand price for {instance_type} in {region}")
        self.cache.put("on-demand", region, instance_type, {"usd_per_hour": usd, **({"note": note} if note else {})})
        return Price(usd, "price-list", note)

    def spot(self, instance_type: str, zone: str, region: str, start: float, end: float) -> Price:
        """The mean spot price of ``instance_type`` in ``zone`` between ``start`` and ``end`` (epoch
        seconds); the on-demand price, said to be an upper bound, where EC2 gives no history."""
        cached = self.cache.get("spot", zone, instance_type)
        if cached is not None and cached["from"] <= start and end <= cached["until"]:
            points = [(float(t), float(p)) for t, p in cached["points"]]
        else:
            points = self._spot_history(instance_type, zone, region, start, end)
            if points is None:
                upper = self.on_demand(instance_type, region)
                return Price(upper.usd_per_hour, upper.source,
                             "no spot price history: the on-demand price, an upper bound")
            if points:
                self.cache.put("spot", zone, instance_type, {"from": start, "until": end, "points": points})
        usd = spot_average(points, start, end)
        if usd is None:
            upper = self.on_demand(instance_type, region)
            return Price(upper.usd_per_hour, upper.source, "no spot price history: the on-demand price, an upper bound")
        return Price(round(usd, 6), "spot-history", f"mean spot price in {zone} over the instances' lifetime")

    def _spot_history(self, instance_type: str, zone: str, region: str, start: float,
                      end: float) -> list[tuple[float, float]] | None:
        utc = _dt.timezone.utc
        try:
            pages = self.client("ec2", region).get_paginator("describe_spot_price_history").paginate(
                InstanceTypes=[instance_type], AvailabilityZone=zone, ProductDescriptions=["Linux/UNIX"],
                StartTime=_dt.datetime.fromtimestamp(start, utc),
                EndTime=_dt.datetime.fromtimestamp(max(end, start), utc))
            found = [(item["Timestamp"].timestamp(), float(item["SpotPrice"]))
                     for page in pages for item in page.get("SpotPriceHistory", [])
                     if item.get("AvailabilityZone", zone) == zone]
        except Exception as exc:  # noqa: BLE001 - a missing history makes an upper bound, not an error
            logger.warning("spot price history of %s in %s: %s", instance_type, zone, aws.error_of(exc))
            return None
        return found

    def reservation(self, reservation_id: str, instance_type: str, region: str) -> Price:
        """A capacity reservation's price: a default one's is the on-demand rate; a Capacity Block's is its
        upfront fee (:meth:`_capacity_block`)."""
        try:
            found = self.client("ec2", region).describe_capacity_reservations(
                CapacityReservationIds=[reservation_id])["CapacityReservations"]
            kind = str((found[0] if found else {}).get("ReservationType") or "default")
        except Exception as exc:  # noqa: BLE001 - the kind unknown: so is the price
            return Price(None, "reservation", f"{reservation_id} could not be read: {aws.error_of(exc)[0] or exc}")
        if kind == "capacity-block":
            return self._capacity_block(reservation_id, found[0], instance_type, region)
        rate = self.on_demand(instance_type, region)
        return Price(rate.usd_per_hour, rate.source, f"capacity reservation {reservation_id}: billed at the "
                                                     "on-demand rate whether used or not")


    def _capacity_block(self, reservation_id: str, block: dict[str, Any], instance_type: str,
                        region: str) -> Price:
        """A Capacity Block's fee: EC2's quote for a block like it (module docstring), paid once."""
        start, end = block.get("StartDate"), block.get("EndDate")
        count = int(block.get("TotalInstanceCount") or 0)
        unknown = (f"unknown: Capacity Block {reservation_id} was paid up front, and EC2 reports no fee for it "
                   "after the purchase")
        if not isinstance(start, _dt.datetime) or not isinstance(end, _dt.datetime) or count < 1:
            return Price(None, "reservation", f"{unknown} (its start, end or instance count is not known)")
        hours = round((end - start).total_seconds() / 3600.0)
        try:
            offers = self.client("ec2", region).describe_capacity_block_offerings(
                InstanceType=str(block.get("InstanceType") or instance_type), InstanceCount=count,
                CapacityDurationHours=hours)["CapacityBlockOfferings"]
        except Exception as exc:  # noqa: BLE001 - no quote: the fee stays unknown
            return Price(None, "reservation", f"{unknown}; no quote: {aws.error_of(exc)[0] or exc}")
        offers = [o for o in offers if str(o.get("CurrencyCode") or "USD") == "USD" and o.get("UpfrontFee")]
        if not offers:
            return Price(None, "reservation", f"{unknown}, and EC2 quotes no {count} x {instance_type} block of "
                                              f"{hours} h now")
        zone = block.get("AvailabilityZone")
        nearest = min(offers, key=lambda o: (o.get("AvailabilityZone") != zone,
                                             abs((o["StartDate"] - start).total_seconds())))
        return Price(0.0, "estimate", f"Capacity Block {reservation_id}: paid once, up front, for {count} x "
                                      f"{instance_type} over {hours} h, whether used or not; the fee is EC2's quote "
                                      f"for a block like it ({nearest.get('CapacityBlockOfferingId')}), not what "
                                      "was paid", usd_upfront=round(float(nearest["UpfrontFee"]), 2))


class S3Meter:
    """The driver's own S3 requests and bytes, per run, counted on the store's client as they are sent
    (every HTTP attempt, retries included: each is billed). A run is the key's first folder under the
    store's prefix (``<prefix>/<run_id>/...``)."""

    def __init__(self, s3_client: Any, bucket: str, prefix: str) -> None:
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self._counts: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()
        events = s3_client.meta.events
        events.register("request-created.s3", self._sent, unique_id=f"sgpu-s3-meter-{id(self)}")
        events.register("before-call.s3", self._called, unique_id=f"sgpu-s3-meter-call-{id(self)}")
        events.register("after-call.s3", self._answered, unique_id=f"sgpu-s3-meter-answer-{id(self)}")

    def _run_of(self, url: str) -> str | None:
        parts = urlsplit(url)
        path = unquote(parts.path).lstrip("/")
        if not (parts.hostname or "").startswith(f"{self.bucket}."):
            head, _, path = path.partition("/")
            if head != self.bucket:
                return None
        listed = parse_qs(parts.query).get("prefix")
        key = listed[0] if listed and not path else path
        if self.prefix:
            if not key.startswith(self.prefix + "/"):
                return None
            key = key[len(self.prefix) + 1:]
        run = key.split("/", 1)[0]
        return run or None

    def _add(self, run: str, what: str, n: int) -> None:
        with self._lock:
            if run not in self._counts and len(self._counts) >= METER_RUNS_KEPT:
                self._counts.pop(next(iter(self._counts)))  # a run nobody took (a sweep's): the oldest goes
            counts = self._counts.setdefault(run, {})
            counts[what] = counts.get(what, 0) + n

    def _sent(self, request: Any, **_: Any) -> None:
        run = self._run_of(str(getattr(request, "url", "")))
        if run is None:
            return
        method = str(request.method).upper()
        query = urlsplit(str(request.url)).query
        kind = ("LIST" if method == "GET" and ("list-type" in query or "prefix=" in query)
                else "DELETE" if method == "POST" and "delete" in query.split("&") else method)
        self._add(run, kind, 1)
        size = _length(getattr(request, "body", None), getattr(request, "headers", {}))
        if size:
            self._add(run, "bytes_up", size)

    def _called(self, params: Any = None, context: Any = None, **_: Any) -> None:
        """Which run a call is about, kept in its context for the answer (which carries no URL)."""
        if isinstance(params, dict) and isinstance(context, dict):
            context["sgpu_run"] = self._run_of(str(params.get("url", "")))

    def _answered(self, http_response: Any = None, model: Any = None, context: Any = None, **_: Any) -> None:
        if http_response is None or getattr(model, "name", "") != "GetObject":
            return
        run = (context or {}).get("sgpu_run")
        size = int(http_response.headers.get("content-length") or 0)
        if run and size:
            self._add(run, "bytes_down", size)

    def take(self, run_id: str) -> dict[str, int]:
        """The counts of ``run_id`` since the last take (a job's gangs each report their own)."""
        with self._lock:
            return self._counts.pop(run_id, {})


def _length(body: Any, headers: Any) -> int:
    """Bytes of a request's body: its Content-Length, else the bytes or the seekable stream it holds."""
    try:
        given = headers.get("Content-Length") if headers is not None else None
        if given:
            return int(given)
        if isinstance(body, (bytes, bytearray)):
            return len(body)
        if hasattr(body, "seek") and hasattr(body, "tell"):
            here = body.tell()
            body.seek(0, os.SEEK_END)
            size = body.tell() - here
            body.seek(here)
            return size
    except (OSError, ValueError, TypeError):
        pass
    return 0


def _requests_usd(requests: dict[str, int]) -> float:
    writes = sum(v for k, v in requests.items() if k in S3_WRITE_KINDS)
    reads = sum(v for k, v in requests.items() if k in S3_READ_KINDS)
    return writes / 1000 * S3_WRITE_USD_PER_1000 + reads / 1000 * S3_READ_USD_PER_1000


#: what :func:`requests_cost` is given of the nodes: each reporting node's counts by node index, and how
#: many nodes the gang had
NodeCounts = tuple[dict[int, dict[str, int]], int]


def nodes_requests(nodes: NodeCounts) -> dict[str, Any]:
    """``result.cost["storage"]["nodes"]``: the nodes' own S3 requests (each node counts its own and reports
    them with its status, :mod:`prefect_sgpu.protocol.node_requests`), priced as the driver's. ``counted``:
    ``measured`` when every node reported; ``estimated`` when some did not (lost, or stopped before they
    could): the reporting nodes' mean stands in for each of them; ``not reported`` when none did."""
    reported, total = nodes
    summed: dict[str, int] = {}
    for counts in reported.values():
        for kind, n in counts.items():
            summed[kind] = summed.get(kind, 0) + n
    if reported and len(reported) < total:
        summed = {k: round(v * total / len(reported)) for k, v in summed.items()}
    counted = "measured" if reported and len(reported) == total else "estimated" if reported else "not reported"
    return {"requests": dict(sorted(summed.items())), "usd": round(_requests_usd(summed), 9), "counted": counted,
            "reported": len(reported), "nodes": total,
            "note": f"{len(reported)} of {total} node(s) counted their own requests to the job store, at S3 "
                    "Standard's us-east-1 request prices; a bare image's first stage (fetching the environment, "
                    "once per boot) is not counted"}


def requests_cost(counts: dict[str, int], nodes: NodeCounts | None = None) -> dict[str, Any]:
    """``result.cost["storage"]``: the driver's S3 requests of one run, counted (``requests``), and with
    ``nodes`` the nodes' own (``nodes``, :func:`nodes_requests`); ``usd`` prices both (an estimate)."""
    requests = {k: v for k, v in sorted(counts.items()) if not k.startswith("bytes_")}
    usd = _requests_usd(requests)
    storage = {"requests": requests, "usd": round(usd, 9), "source": "estimate", "counted": "measured",
               "note": "the driver's own S3 requests, counted, at S3 Standard's us-east-1 request prices; the nodes' "
                       "requests are not counted"}
    if nodes is not None:
        storage["nodes"] = nodes_requests(nodes)
        storage["usd"] = round(usd + storage["nodes"]["usd"], 9)
        storage["note"] = ("the driver's own S3 requests (requests) and the nodes' (nodes), each counted where it "
                           "was sent, at S3 Standard's us-east-1 request prices")
    return storage


def transfer_cost(counts: dict[str, int]) -> dict[str, Any]:
    """``result.cost["transfer"]``: the bytes the driver read from S3 at the internet rate (an estimate: free
    when the driver runs in the bucket's region; uploads are free)."""
    down, up = counts.get("bytes_down", 0), counts.get("bytes_up", 0)
    return {"bytes_down": down, "bytes_up": up, "usd": round(down / 1e9 * S3_INTERNET_USD_PER_GB, 9),
            "source": "estimate",
            "note": f"bytes the driver read from S3 at ${S3_INTERNET_USD_PER_GB}/GB (S3 to the internet); free when "
                    "the driver runs in the bucket's region, uploads are free"}


def with_requests(cost: dict[str, Any], counts: dict[str, int], nodes: NodeCounts | None = None) -> dict[str, Any]:
    """``cost`` (the instances') with the run's S3 requests (the driver's, and the nodes' where given) and
    transfer, and the sum of the three known figures as ``total_usd`` (``usd`` stays the instances')."""
    storage, transfer = requests_cost(counts, nodes), transfer_cost(counts)
    total = (cost.get("usd") or 0.0) + storage["usd"] + transfer["usd"]
    return {**cost, "storage": storage, "transfer": transfer, "total_usd": round(total, 9)}
