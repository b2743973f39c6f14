"""What an EC2 job costs, priced from AWS's own sources through real boto3 clients: the Price List API and
EC2's spot price history as the fault proxy serves them (``support.aws_prices``; moto has neither), the
capacity reservations the proxy models, and the shipped driver policy judged by the IAM gate."""

from __future__ import annotations

import datetime as _dt
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from prefect_sgpu.compute.base import total_cost
from prefect_sgpu.compute.ec2 import prices
from prefect_sgpu.compute.ec2.instances import EC2Provisioner, EC2Settings, Instance
from support.aws_fixtures import FAKE_CREDENTIALS

T0 = 1_790_000_000.0  # when the instances of these tests started (epoch seconds)
HOUR = 3600.0


@pytest.fixture
def price_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "prices"
    monkeypatch.setenv(prices.CACHE_ENV, str(folder))
    return folder


def _provisioner(aws_env: Any, region: str, session: Any = None, **settings: Any) -> EC2Provisioner:
    return EC2Provisioner(EC2Settings(region=region, endpoint_url=aws_env.endpoint_url, **settings), session=session)


def _nodes(zone: str, market: str, n: int = 2, instance_type: str = "g5.xlarge") -> list[Instance]:
    return [Instance(f"i-{uuid.uuid4().hex[:8]}", "10.0.0.1", "subnet-1", zone, i, instance_type, market)
            for i in range(n)]


def _aws_prices(faults: Any) -> None:
    faults.prices.list_on_demand("us-east-1", "g5.xlarge", 1.006)
    faults.prices.list_on_demand("eu-west-1", "g5.xlarge", 1.123)
    # eu-west-1a's spot price: 0.40 since before the job, 0.50 from half-way through it; eu-west-1b's differs
    faults.prices.list_spot("eu-west-1a", "g5.xlarge", [(T0 - 5 * HOUR, 0.30), (T0 - HOUR, 0.40),
                                                        (T0 + HOUR / 2, 0.50), (T0 + 2 * HOUR, 0.90)])
    faults.prices.list_spot("eu-west-1b", "g5.xlarge", [(T0 - HOUR, 0.70)])


def test_a_spot_job_in_eu_west_1_costs_other_than_on_demand_in_us_east_1_each_figure_sourced(
        aws_env: Any, aws_faults: Any, price_cache: Path) -> None:
    _aws_prices(aws_faults)
    aws_faults.prices.page_size = 1  # the history comes in pages, as the paginator reads it

    home = _provisioner(aws_env, "us-east-1").cost(_nodes("us-east-1a", "on-demand"), T0, T0 + HOUR)
    away = _provisioner(aws_env, "eu-west-1").cost(_nodes("eu-west-1a", "spot"), T0, T0 + HOUR)

    assert home["usd"] == pytest.approx(2 * 1.006) and home["price_source"] == "price-list"
    assert home["compute"] == {"on-demand us-east-1": {"market": "on-demand", "region": "us-east-1",
                                                       "instance_hours": 2.0, "usd": pytest.approx(2.012),
                                                       "source": "price-list"}}
    # half an hour at 0.40 and half an hour at 0.50, two instances
    assert away["usd"] == pytest.approx(2 * 0.45) and away["price_source"] == "spot-history"
    assert away["compute"]["spot eu-west-1"]["source"] == "spot-history"
    assert [i["usd_per_hour"] for i in away["instances"]] == [pytest.approx(0.45)] * 2
    assert away["usd"] != home["usd"]

    # one price read per (market, type, zone), in the zone the instances ran in, over their lifetime
    spot_calls = aws_faults.calls("DescribeSpotPriceHistory")
    assert {c.params["AvailabilityZone"] for c in spot_calls} == {"eu-west-1a"}
    assert spot_calls[0].params["StartTime"].startswith("2026-09-21T") and len(spot_calls) == 2  # two pages
    products = aws_faults.calls("GetProducts")
    assert len(products) == 1
    filters = {f["Field"]: f["Value"] for f in json.loads(products[0].params["Filters"])}
    assert filters == {"instanceType": "g5.xlarge", "regionCode": "us-east-1", "operatingSystem": "Linux",
                       "tenancy": "Shared", "preInstalledSw": "NA", "capacitystatus": "Used"}


def test_prices_are_kept_a_day_on_disk_without_credentials(aws_env: Any, aws_faults: Any, price_cache: Path) -> None:
    _aws_prices(aws_faults)
    first = _provisioner(aws_env, "eu-west-1").cost(_nodes("eu-west-1b", "on-demand", 1), T0, T0 + HOUR)
    again = _provisioner(aws_env, "eu-west-1").cost(_nodes("eu-west-1b", "on-demand", 1), T0, T0 + HOUR)
    assert first["usd"] == again["usd"] == pytest.approx(1.123)
    assert len(aws_faults.calls("GetProducts")) == 1, "the second job read the cache"
    kept = list(price_cache.glob("*.json"))
    assert [p.name for p in kept] == ["on-demand_eu-west-1_g5.xlarge.json"]
    text = kept[0].read_text()
    assert not any(secret in text for secret in set(FAKE_CREDENTIALS.values())), text
    assert "endpoint" not in text and "Credential" not in text

    entry = json.loads(text)  # a day later the price is read again
    entry["read_at"] = (_dt.datetime.now(_dt.timezone.utc) - _dt.timedelta(days=1, minutes=1)).isoformat()
    kept[0].write_text(json.dumps(entry))
    aws_faults.prices.list_on_demand("eu-west-1", "g5.xlarge", 1.2)
    assert _provisioner(aws_env, "eu-west-1").cost(_nodes("eu-west-1b", "on-demand", 1), T0, T0 + HOUR)["usd"] \
        == pytest.approx(1.2)
    assert len(aws_faults.calls("GetProducts")) == 2


def test_the_shipped_table_stands_in_when_the_price_list_refuses_labelled_as_such(
        aws_env: Any, aws_faults: Any, price_cache: Path) -> None:
    aws_faults.fail("GetProducts", "AccessDeniedException", message="not authorized to perform: pricing:GetProducts")
    prov = _provisioner(aws_env, "eu-west-1")
    cost = prov.cost(_nodes("eu-west-1a", "on-demand"), T0, T0 + HOUR)
    assert cost["price_source"] == "fallback-table" and cost["usd"] == pytest.approx(2 * 1.006)
    note = cost["instances"][0]["note"]
    assert "us-east-1 on-demand list price" in note and "AccessDeniedException" in note
    prov.cost(_nodes("eu-west-1a", "on-demand"), T0, T0 + HOUR)
    assert len(aws_faults.calls("GetProducts")) == 1, "a refusal is asked once, not once per job"
    assert list(price_cache.glob("*.json")) == [], "a stand-in price is never kept as AWS's"


def test_a_throttled_price_read_is_the_table_once_and_read_again_next_time(
        aws_env: Any, aws_faults: Any, price_cache: Path) -> None:
    """Prices are read in one try (a release never waits out a retry for one); a throttle, unlike a refusal,
    is not remembered."""
    _aws_prices(aws_faults)
    aws_faults.fail("GetProducts", "ThrottlingException", times=1)
    prov = _provisioner(aws_env, "eu-west-1")
    first = prov.cost(_nodes("eu-west-1a", "on-demand", 1), T0, T0 + HOUR)
    assert first["price_source"] == "fallback-table" and "ThrottlingException" in first["instances"][0]["note"]
    assert prov.cost(_nodes("eu-west-1a", "on-demand", 1), T0, T0 + HOUR)["price_source"] == "price-list"
    assert [c.error for c in aws_faults.calls("GetProducts")] == ["ThrottlingException", None]


def test_reserved_capacity_at_the_on_demand_rate_and_a_capacity_block_unknown(
        aws_env: Any, aws_faults: Any, price_cache: Path) -> None:
    _aws_prices(aws_faults)
    default = aws_faults.add_capacity_reservation("g5.xlarge", "us-east-1a", 2)
    block = aws_faults.add_capacity_reservation("g5.xlarge", "us-east-1a", 2, reservation_type="capacity-block")
    reserved = _provisioner(aws_env, "us-east-1", capacity_reservation_id=default, market="reserved").cost(
        _nodes("us-east-1a", "reserved"), T0, T0 + HOUR)
    assert reserved["usd"] == pytest.approx(2.012) and reserved["price_source"] == "price-list"
    assert "billed at the on-demand rate" in reserved["instances"][0]["note"]
    blocked = _provisioner(aws_env, "us-east-1", capacity_reservation_id=block, market="reserved").cost(
        _nodes("us-east-1a", "reserved"), T0, T0 + HOUR)
    assert blocked["price_source"] == "reservation" and blocked["usd"] == 0.0
    assert blocked["unpriced_instance_types"] == ["g5.xlarge"] and blocked["compute"]["reserved us-east-1"]["unpriced"]
    assert blocked["instances"][0]["usd_per_hour"] is None and "unknown" in blocked["instances"][0]["note"]


def test_the_shipped_driver_policy_allows_reading_prices(aws_env: Any, aws_faults: Any, price_cache: Path) -> None:
    """A driver user under ``driver-policy.json``, every call judged by the IAM gate, reads both price sources."""
    import boto3

    from prefect_sgpu.compute.ec2 import roles
    from support.iam_gate import ACCOUNT, IAMGate

    _aws_prices(aws_faults)
    iam, tag = aws_env.client("iam"), uuid.uuid4().hex[:8]
    user = f"sgpu-driver-prices-{tag}"
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="prefect-sgpu-driver", PolicyDocument=json.dumps(
        roles.driver_policy("s3://sgpu-prices/jobs", "eu-west-1", ACCOUNT, f"arn:aws:iam::{ACCOUNT}:policy/b")))
    keys = iam.create_access_key(UserName=user)["AccessKey"]
    driver = boto3.Session(aws_access_key_id=keys["AccessKeyId"], aws_secret_access_key=keys["SecretAccessKey"],
                           region_name="eu-west-1")
    gate = IAMGate("eu-west-1")
    gate.watch_user(user)
    aws_faults.iam_gate = gate
    try:
        cost = _provisioner(aws_env, "eu-west-1", session=driver).cost(
            [*_nodes("eu-west-1a", "spot", 1), *_nodes("eu-west-1b", "on-demand", 1)], T0, T0 + HOUR)
    finally:
        aws_faults.iam_gate = None
    assert gate.denied == [], gate.denied
    assert {"pricing:GetProducts", "ec2:DescribeSpotPriceHistory"} <= {a for _, a in gate.allowed}
    assert cost["price_source"] == "price-list, spot-history"
    assert cost["usd"] == pytest.approx(0.45 + 1.123)


def test_the_driver_s_s3_requests_are_counted_per_run_and_priced_as_an_estimate(aws_env: Any, aws_faults: Any) -> None:
    from prefect_sgpu.store.s3 import S3Store

    bucket = f"sgpu-meter-{uuid.uuid4().hex[:8]}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    store = S3Store(f"s3://{bucket}/jobs", region=aws_env.region, endpoint_url=aws_env.endpoint_url)
    meter = prices.S3Meter(store.client, store.bucket, store.prefix)
    aws_faults.reset()
    for n in range(3):
        store.put("r-one", f"logs/{n}", b"x" * 1000)
    assert store.get("r-one", "logs/1") == b"x" * 1000
    store.put("r-two", "payload.bin", b"y")
    store.client.list_objects_v2(Bucket=bucket, Prefix="jobs/r-one/")

    one = meter.take("r-one")
    sent = aws_faults.s3_requests()  # what crossed the wire, by kind, for both runs
    assert one == {"PUT": 3, "GET": 1, "LIST": 1, "bytes_up": 3000, "bytes_down": 1000}
    assert sent["PUT"] == 4 and sent["GET"] == 1 and sent["LIST"] == 1
    assert meter.take("r-one") == {}, "taken once: a later gang reports only its own"
    cost = prices.with_requests({"instance_hours": 1.0, "usd": 1.0}, one)
    assert cost["storage"]["source"] == cost["transfer"]["source"] == "estimate"
    assert cost["storage"]["usd"] == pytest.approx(4 / 1000 * 0.005 + 1 / 1000 * 0.0004)
    assert cost["total_usd"] == pytest.approx(1.0 + cost["storage"]["usd"] + cost["transfer"]["usd"])
    assert meter.take("r-two")["PUT"] == 1


def test_a_job_s_gangs_add_up_part_by_part() -> None:
    gang = {"usd": 1.0, "price_source": "price-list", "compute": {"spot eu-west-1": {"usd": 1.0, "source": "x"}},
            "storage": {"usd": 0.1, "requests": {"PUT": 2}, "source": "estimate"}, "instances": [{"id": "i-1"}]}
    other = {"usd": 2.0, "price_source": "price-list", "compute": {"on-demand eu-west-1": {"usd": 2.0}},
             "storage": {"usd": 0.2, "requests": {"PUT": 3, "GET": 1}, "source": "estimate"}, "instances": [{"id": "i-2"}]}
    total = total_cost([gang, other])
    assert total is not None and total["usd"] == 3.0
    assert total["compute"] == {"spot eu-west-1": {"usd": 1.0, "source": "x"}, "on-demand eu-west-1": {"usd": 2.0}}
    assert total["storage"] == {"usd": pytest.approx(0.3), "requests": {"PUT": 5, "GET": 1}, "source": "estimate"}
    assert [i["id"] for i in total["instances"]] == ["i-1", "i-2"]


def test_a_capacity_block_costs_its_upfront_fee_once_not_per_hour(aws_env: Any, aws_faults: Any,
                                                                   price_cache: Path) -> None:
    """A Capacity Block is paid once, up front (AWS docs, "Capacity Blocks for ML"): a 2 x g5.xlarge block
    of 24 h costs EC2's quote for a block like it, whatever the job's hours, and its instances cost nothing
    more; read by a driver user under the shipped ``driver-policy.json``, every call judged by the IAM gate."""
    import boto3

    from prefect_sgpu.compute.ec2 import roles
    from support.iam_gate import ACCOUNT, IAMGate

    _aws_prices(aws_faults)
    day = 24 * HOUR
    iso = lambda t: _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")  # noqa: E731
    block = aws_faults.add_capacity_reservation("g5.xlarge", "us-east-1a", 2, reservation_type="capacity-block",
                                                start_date=iso(T0), end_date=iso(T0 + day))
    far = aws_faults.prices.list_capacity_block_offering("us-east-1a", "g5.xlarge", 2, T0 + 30 * day, 24, 99.0)
    near = aws_faults.prices.list_capacity_block_offering("us-east-1a", "g5.xlarge", 2, T0 + 2 * day, 24, 61.5)
    aws_faults.prices.list_capacity_block_offering("us-east-1a", "g5.xlarge", 4, T0 + 2 * day, 24, 120.0)
    aws_faults.prices.list_capacity_block_offering("us-east-1a", "g5.xlarge", 2, T0 + 2 * day, 48, 118.0)
    iam, tag = aws_env.client("iam"), uuid.uuid4().hex[:8]
    user = f"sgpu-driver-block-{tag}"
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="prefect-sgpu-driver", PolicyDocument=json.dumps(
        roles.driver_policy("s3://sgpu-prices/jobs", "us-east-1", ACCOUNT, f"arn:aws:iam::{ACCOUNT}:policy/b")))
    keys = iam.create_access_key(UserName=user)["AccessKey"]
    driver = boto3.Session(aws_access_key_id=keys["AccessKeyId"], aws_secret_access_key=keys["SecretAccessKey"],
                           region_name="us-east-1")
    gate = IAMGate("us-east-1")
    gate.watch_user(user)
    aws_faults.iam_gate = gate
    try:
        prov = _provisioner(aws_env, "us-east-1", session=driver, capacity_reservation_id=block, market="reserved")
        short = prov.cost(_nodes("us-east-1a", "reserved"), T0, T0 + HOUR / 6)
        long = prov.cost(_nodes("us-east-1a", "reserved"), T0, T0 + 3 * HOUR)
    finally:
        aws_faults.iam_gate = None
    assert gate.denied == [], gate.denied
    assert "ec2:DescribeCapacityBlockOfferings" in {a for _, a in gate.allowed}
    for cost in (short, long):  # the fee once, for the block, not per instance or per hour
        assert cost["usd"] == pytest.approx(61.5) and cost["unpriced_instance_types"] == []
        assert cost["compute"]["reserved us-east-1"]["upfront_usd"] == pytest.approx(61.5)
        assert cost["price_source"] == "estimate"
        first = cost["instances"][0]
        assert first["usd_upfront"] == 61.5 and first["usd_per_hour"] == 0.0
        assert near in first["note"] and far not in first["note"] and "not what was paid" in first["note"]
    aws_faults.prices.reset()
    aws_faults.prices.block_offers = []  # EC2 quotes no block like it now: the fee is unknown, and said so
    unquoted = _provisioner(aws_env, "us-east-1", capacity_reservation_id=block, market="reserved").cost(
        _nodes("us-east-1a", "reserved"), T0, T0 + HOUR)
    assert unquoted["unpriced_instance_types"] == ["g5.xlarge"] and unquoted["usd"] == 0.0
    assert "quotes no 2 x g5.xlarge block of 24 h" in unquoted["instances"][0]["note"]


def test_a_node_counts_its_own_s3_requests_as_the_proxy_records_them_and_reports_them_sealed(
        aws_env: Any, aws_faults: Any, tmp_path: Path) -> None:
    """A node's bootstrap ships a rank's log, its progress, reads the heartbeat and the stop through its own
    store client; the counts it reports (with the two writes that end its part) are what crossed the wire, by
    kind. The driver prices them with its own; a gang where one node of two reported is an estimate, and a
    document that is not the node's own is not counted."""
    from prefect_sgpu.launch.bootstrap import NodeBootstrap, NodeIdentity
    from prefect_sgpu.protocol import node_requests
    from prefect_sgpu.protocol.jobfolder import new_key
    from prefect_sgpu.store.s3 import S3Store

    bucket = f"sgpu-node-meter-{uuid.uuid4().hex[:8]}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    opened = lambda: S3Store(f"s3://{bucket}/jobs", region=aws_env.region, endpoint_url=aws_env.endpoint_url)  # noqa: E731
    node_store, driver_store, key = opened(), opened(), new_key()
    aws_faults.reset()
    node = NodeBootstrap(node_store, "run-1", NodeIdentity("i-0123456789abcdef0", 1, "10.0.0.6"), tmp_path / "node",
                         heartbeat_ttl=60)
    node.use_key(key)
    log = tmp_path / "node" / "run-1" / "logs" / "rank-00001.log"
    log.parent.mkdir(parents=True)
    for tick in range(3):
        with open(log, "ab") as fh:
            fh.write(f"step {tick}\n".encode())
        node.sync_up(final=True)
        node.heartbeat_stale()
        node.stop_requested()
    node.seal_appended()
    node.put_requests()
    sent = aws_faults.s3_requests()  # the node's requests only: the driver sent none yet
    counts = node_requests.read(driver_store, "run-1", key, 1, instance_id="i-0123456789abcdef0")
    assert counts is not None
    # the proxy's meter keeps a batch delete (POST ?delete, the sealed log's pieces) a POST; the node's counts it
    # as S3 bills it, a DELETE (free)
    as_sent = {("POST" if k == "DELETE" else k): v for k, v in counts.items()}
    assert as_sent == {**sent, "PUT": sent["PUT"] + 1}, "the status that follows is the one PUT not yet sent"
    assert counts["PUT"] >= 4 and counts["GET"] >= 6
    for who in ({"node": 0}, {"instance_id": "i-0fffffffffffffff0"}, {"gang": 1}):  # bound to node, instance, gang
        assert node_requests.read(driver_store, "run-1", key, who.get("node", 1),
                                  instance_id=who.get("instance_id", "i-0123456789abcdef0"), gang=who.get("gang", 0)) is None
    driver_store.put("run-1", node_requests.requests_key(1), b'{"node": 1, "counts": {"PUT": 1}}')  # unsealed
    assert node_requests.read(driver_store, "run-1", key, 1, instance_id="i-0123456789abcdef0") is None

    cost = prices.with_requests({"usd": 1.0}, {"PUT": 10}, ({1: counts}, 1))
    nodes = cost["storage"]["nodes"]
    assert nodes["counted"] == "measured" and nodes["requests"] == dict(sorted(counts.items()))
    assert cost["storage"]["usd"] == pytest.approx(prices.requests_cost({"PUT": 10})["usd"] + nodes["usd"])
    half = prices.with_requests({"usd": 1.0}, {}, ({1: {"PUT": 3, "GET": 5}}, 2))["storage"]["nodes"]
    assert half["counted"] == "estimated" and half["requests"] == {"GET": 10, "PUT": 6} and half["reported"] == 1
    assert prices.with_requests({"usd": 1.0}, {}, ({}, 2))["storage"]["nodes"]["counted"] == "not reported"
