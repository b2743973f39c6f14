"""AWS's price sources, answered in front of moto: the Price List API and EC2's spot price history.

Moto 5.2 has no Price List service (``pricing``) at all, and answers DescribeSpotPriceHistory with one
made-up price (0.00001) stamped 2006 for every zone and type, whatever window is asked. The fault
proxy (:attr:`support.aws_fault_proxy.AWSFaultProxy.prices`) hands both to a :class:`PriceFeeds`,
each off until a test lists a price:

- ``GetProducts`` (https://docs.aws.amazon.com/aws-cost-management/latest/APIReference/API_pricing_GetProducts.html):
  ``FormatVersion`` and ``PriceList``, a list of JSON *strings*, each one product with its ``product``
  attributes and ``terms.OnDemand.<sku.term>.priceDimensions.<sku.term.rate>.pricePerUnit.USD``
  (https://docs.aws.amazon.com/awsaccountbilling/latest/aboutv2/reading-an-offer.html); filters are
  ``TERM_MATCH`` on attributes, a product answering only when every filter matches;
- ``DescribeSpotPriceHistory`` (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeSpotPriceHistory.html):
  the changes between ``StartTime`` and ``EndTime`` *and the last change before the start* ("the
  results include the price that was in effect at the start time"), newest first, in pages of
  ``page_size`` with ``nextToken``;
- ``DescribeCapacityBlockOfferings`` (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeCapacityBlockOfferings.html;
  moto 5.2 has none): the listed offerings of the asked ``InstanceType``, ``InstanceCount`` and
  ``CapacityDurationHours`` starting inside ``StartDateRange``..``EndDateRange``, each with its
  ``UpfrontFee`` in USD: a Capacity Block is paid once, up front, not per hour
  (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ec2-capacity-blocks.html).
"""

from __future__ import annotations

import datetime as _dt
import json
import threading
import uuid
from typing import Any
from xml.sax.saxutils import escape

EC2_NS = "http://ec2.amazonaws.com/doc/2016-11-15/"
JSON = [("Content-Type", "application/x-amz-json-1.1")]


def _epoch(text: str) -> float:
    return _dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _iso(epoch: float) -> str:
    return _dt.datetime.fromtimestamp(epoch, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


class PriceFeeds:
    """The prices a test listed, served as AWS serves them (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            #: (region code, instance type) -> on-demand USD per hour; None: GetProducts goes to moto
            self.on_demand: dict[tuple[str, str], float] | None = None
            #: (zone, instance type) -> [(epoch seconds, USD per hour)]; None: DescribeSpotPriceHistory goes to moto
            self.spot: dict[tuple[str, str], list[tuple[float, float]]] | None = None
            self.page_size = 1000
            #: listed Capacity Block offerings; None: DescribeCapacityBlockOfferings goes to moto
            self.block_offers: list[dict[str, Any]] | None = None

    def list_on_demand(self, region: str, instance_type: str, usd_per_hour: float) -> None:
        with self._lock:
            self.on_demand = {**(self.on_demand or {}), (region, instance_type): usd_per_hour}

    def list_spot(self, zone: str, instance_type: str, changes: list[tuple[float, float]]) -> None:
        with self._lock:
            self.spot = {**(self.spot or {}), (zone, instance_type): sorted(changes)}

    def list_capacity_block_offering(self, zone: str, instance_type: str, count: int, start: float, hours: int,
                                     upfront_usd: float) -> str:
        """A Capacity Block EC2 offers: ``count`` x ``instance_type`` in ``zone`` from ``start`` (epoch
        seconds) for ``hours``, for ``upfront_usd`` paid once; returns its offering id."""
        offer = {"id": f"cb-{uuid.uuid4().hex[:17]}", "zone": zone, "type": instance_type, "count": count,
                 "start": start, "hours": hours, "fee": upfront_usd}
        with self._lock:
            self.block_offers = [*(self.block_offers or []), offer]
        return offer["id"]

    def serves(self, service: str, action: str) -> bool:
        if service == "json:AWSPriceListService" and action == "GetProducts":
            return self.on_demand is not None
        if service == "ec2" and action == "DescribeCapacityBlockOfferings":
            return self.block_offers is not None
        return service == "ec2" and action == "DescribeSpotPriceHistory" and self.spot is not None

    def answer(self, action: str, params: dict[str, str]) -> tuple[int, list, bytes]:
        if action == "DescribeCapacityBlockOfferings":
            return self._block_offerings(params)
        return self._get_products(params) if action == "GetProducts" else self._spot_history(params)

    def _block_offerings(self, params: dict[str, str]) -> tuple[int, list, bytes]:
        after = _epoch(params["StartDateRange"]) if params.get("StartDateRange") else float("-inf")
        before = _epoch(params["EndDateRange"]) if params.get("EndDateRange") else float("inf")
        with self._lock:
            offers = list(self.block_offers or [])
        body = "".join(
            f"<item><capacityBlockOfferingId>{o['id']}</capacityBlockOfferingId>"
            f"<instanceType>{escape(o['type'])}</instanceType><availabilityZone>{escape(o['zone'])}</availabilityZone>"
            f"<instanceCount>{o['count']}</instanceCount><startDate>{_iso(o['start'])}</startDate>"
            f"<endDate>{_iso(o['start'] + o['hours'] * 3600)}</endDate>"
            f"<capacityBlockDurationHours>{o['hours']}</capacityBlockDurationHours>"
            f"<upfrontFee>{o['fee']:.2f}</upfrontFee><currencyCode>USD</currencyCode><tenancy>default</tenancy></item>"
            for o in offers
            if o["type"] == params.get("InstanceType") and str(o["count"]) == params.get("InstanceCount")
            and str(o["hours"]) == params.get("CapacityDurationHours")
            and after <= o["start"] and o["start"] + o["hours"] * 3600 <= before)
        xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<DescribeCapacityBlockOfferingsResponse xmlns="{EC2_NS}">'
               f"<requestId>{uuid.uuid4()}</requestId><capacityBlockOfferingSet>{body}</capacityBlockOfferingSet>"
               "</DescribeCapacityBlockOfferingsResponse>")
        return 200, [("Content-Type", "text/xml;charset=UTF-8")], xml.encode()

    def _get_products(self, params: dict[str, str]) -> tuple[int, list, bytes]:
        filters = {f["Field"]: f["Value"] for f in json.loads(params.get("Filters") or "[]")}
        with self._lock:
            listed = dict(self.on_demand or {})
        products = []
        for (region, instance_type), usd in sorted(listed.items()):
            attributes = {"instanceType": instance_type, "regionCode": region, "operatingSystem": "Linux",
                          "tenancy": "Shared", "preInstalledSw": "NA", "capacitystatus": "Used",
                          "servicecode": "AmazonEC2"}
            if any(attributes.get(k) != v for k, v in filters.items()):
                continue
            sku = uuid.uuid5(uuid.NAMESPACE_DNS, f"{region}/{instance_type}").hex[:16].upper()
            term = f"{sku}.JRTCKXETXF"
            products.append(json.dumps({
                "product": {"productFamily": "Compute Instance", "attributes": attributes, "sku": sku},
                "serviceCode": "AmazonEC2",
                "terms": {"OnDemand": {term: {"sku": sku, "offerTermCode": "JRTCKXETXF", "priceDimensions": {
                    f"{term}.6YS6EN2CT7": {"unit": "Hrs", "pricePerUnit": {"USD": f"{usd:.10f}"},
                                           "description": f"${usd} per On Demand Linux {instance_type} Instance Hour"}}}}},
                "version": "20261101000000", "publicationDate": "2026-11-01T00:00:00Z"}))
        return 200, JSON, json.dumps({"FormatVersion": "aws_v1", "PriceList": products}).encode()

    def _spot_history(self, params: dict[str, str]) -> tuple[int, list, bytes]:
        types = [v for k, v in sorted(params.items()) if k.startswith("InstanceType.")]
        zone = params.get("AvailabilityZone")
        start = _epoch(params["StartTime"]) if params.get("StartTime") else float("-inf")
        end = _epoch(params["EndTime"]) if params.get("EndTime") else float("inf")
        with self._lock:
            listed = dict(self.spot or {})
            page_size = min(self.page_size, int(params.get("MaxResults") or self.page_size))
        items = []
        for (where, instance_type), changes in sorted(listed.items()):
            if (zone and where != zone) or (types and instance_type not in types):
                continue
            before = [c for c in changes if c[0] < start]
            inside = [c for c in changes if start <= c[0] <= end]
            for when, usd in sorted(before[-1:] + inside, reverse=True):
                items.append((where, instance_type, when, usd))
        first = int(params.get("NextToken") or 0)
        page = items[first:first + page_size]
        token = str(first + page_size) if first + page_size < len(items) else ""
        body = "".join(
            f"<item><instanceType>{escape(t)}</instanceType><productDescription>Linux/UNIX</productDescription>"
            f"<spotPrice>{usd:.6f}</spotPrice><timestamp>{_iso(when)}</timestamp>"
            f"<availabilityZone>{escape(z)}</availabilityZone></item>" for z, t, when, usd in page)
        xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<DescribeSpotPriceHistoryResponse xmlns="{EC2_NS}">'
               f"<requestId>{uuid.uuid4()}</requestId><spotPriceHistorySet>{body}</spotPriceHistorySet>"
               f"<nextToken>{token}</nextToken></DescribeSpotPriceHistoryResponse>")
        return 200, [("Content-Type", "text/xml;charset=UTF-8")], xml.encode()


__all__ = ["PriceFeeds"]
