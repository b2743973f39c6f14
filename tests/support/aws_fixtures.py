"""AWS test fixtures: one moto server per test session, reached through real boto3 clients.

Tests never patch boto3. Code under test talks HTTP to a ``ThreadedMotoServer`` on
127.0.0.1 exactly as it would talk to AWS, so retries, error parsing, waiters and
request serialisation are all the real botocore paths.

Fixtures (wired into every test module by ``tests/conftest.py``):

- ``moto_server``   session: moto's own endpoint URL (``http://127.0.0.1:PORT``).
- ``aws_proxy``     session: :class:`~aws_fault_proxy.AWSFaultProxy` in front of moto.
                    It adds the EC2 behaviour moto lacks (placement groups, ClientToken
                    idempotency), injects AWS errors by rule and holds requests by
                    path (``delay``: a slow upload).
- ``aws_env``       function: fake credentials, region and ``AWS_ENDPOINT_URL`` (the
                    proxy) in the environment, so any ``boto3.client(...)`` made by code
                    under test lands on moto. Returns a :class:`MotoAWS` handle.
- ``aws_faults``    function: the proxy, with its rules and request records cleared
                    before and after the test.
- ``aws_network``   function: a fresh VPC with one subnet in each of two availability
                    zones, for placement and failover tests. Its CIDR is in 127.0.0.0/8,
                    so the private IPs moto hands out are loopback addresses of this host:
                    simulated nodes really listen on the address EC2 reports for them.
- ``no_leaked_instances``  function: fails the test if any moto instance is still
                    pending/running/stopping when it ends.
"""

from __future__ import annotations

import functools
import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from support.aws_fault_proxy import AWSFaultProxy

REGION = "us-east-1"
FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_SESSION_TOKEN": "testing",
}
_IMAGE_IDS: dict[str, str] = {}
LIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]


def free_port() -> int:
    """A port on 127.0.0.1 for a server a test starts: free now, outside the kernel's ephemeral range
    (no outgoing connection takes it before the server binds it, and no client connects to itself
    on it while the server starts) and not handed out to another suite on this machine lately
    (:func:`prefect_sgpu.compute.ports.free_port`)."""
    from prefect_sgpu.compute import ports

    return ports.free_port("127.0.0.1")


def aws_environment(endpoint_url: str, region: str = REGION) -> dict[str, str]:
    """Environment that points every boto3 client at ``endpoint_url`` with fake keys."""
    return {
        **FAKE_CREDENTIALS,
        "AWS_DEFAULT_REGION": region,
        "AWS_REGION": region,
        "AWS_ENDPOINT_URL": endpoint_url,
    }


def boto3_client(service: str, endpoint_url: str, region: str = REGION, **config: Any) -> Any:
    """A real boto3 client bound to the moto endpoint (explicit keys: no env needed)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        service,
        region_name=region,
        endpoint_url=endpoint_url,
        aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        config=Config(**config) if config else None,
    )


def boto3_session(region: str = REGION) -> Any:
    """A boto3 session with the fake keys (pair it with ``endpoint_url=`` on clients).

    Its botocore session shares this process's data loader (:func:`shared_data_loader`), as
    ``prefect_sgpu.aws.new_session`` does for the product: each new session otherwise parses
    endpoints.json and every service model it makes a client of again (EC2's is megabytes of JSON),
    about a CPU second per EC2 test whose computes and stores each get a session of their own."""
    import boto3
    import botocore.session

    core = botocore.session.get_session()
    core.register_component("data_loader", shared_data_loader())
    return boto3.Session(
        aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=region,
        botocore_session=core,
    )


@functools.lru_cache(maxsize=1)
def shared_data_loader() -> Any:
    """This test process's botocore data loader, which keeps every model and endpoint file it parsed."""
    import botocore.loaders

    return botocore.loaders.create_loader()


def live_instances(ec2: Any, filters: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Instances moto still holds in a non-terminated state (optionally filtered)."""
    flt = [{"Name": "instance-state-name", "Values": LIVE_STATES}, *(filters or [])]
    found = []
    for page in ec2.get_paginator("describe_instances").paginate(Filters=flt):
        for reservation in page["Reservations"]:
            found.extend(reservation["Instances"])
    return found


@dataclass
class MotoAWS:
    """Handle on the moto server a test talks to."""

    endpoint_url: str
    region: str = REGION
    env: dict[str, str] = field(default_factory=dict)

    def client(self, service: str, **config: Any) -> Any:
        return boto3_client(service, self.endpoint_url, self.region, **config)

    def session(self) -> Any:
        return boto3_session(self.region)

    def live_instances(self, filters: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        return live_instances(self.client("ec2"), filters)

    def image_id(self) -> str:
        """An AMI id moto knows (looked up once per session: moto's image list is long)."""
        if self.endpoint_url not in _IMAGE_IDS:
            images = self.client("ec2").describe_images(Owners=["amazon"])["Images"]
            _IMAGE_IDS[self.endpoint_url] = min(img["ImageId"] for img in images)
        return _IMAGE_IDS[self.endpoint_url]

    def instance_profile(self, name: str = "sgpu-node") -> str:
        """An IAM instance profile (moto, like AWS, rejects launches naming an unknown one)."""
        iam = self.client("iam")
        try:
            iam.create_instance_profile(InstanceProfileName=name)
        except iam.exceptions.EntityAlreadyExistsException:
            pass
        return name

    def instance_profile_with_role(self, name: str = "test-nodes") -> str:
        """An IAM instance profile holding a role of the same name that EC2 may assume (as ``prefect-sgpu
        setup aws`` makes the shared one), made once per moto server. Instances launched with it get the
        role's temporary keys from IMDS (support.ec2_simulator); a profile with no role gives none, as on
        EC2. The role has no policy: moto enforces none, and the IAM gate judges only identities a test
        names (a name outside ``sgpu-*``, the job roles' pattern the gated tests watch)."""
        import json

        iam = self.client("iam")
        trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                          "Principal": {"Service": "ec2.amazonaws.com"}}]}
        try:
            iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust))
        except iam.exceptions.EntityAlreadyExistsException:
            pass
        self.instance_profile(name)
        held = iam.get_instance_profile(InstanceProfileName=name)["InstanceProfile"]["Roles"]
        if not held:
            iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)
        return name

    def reset(self) -> None:
        """Drop every resource in moto (all services). Use sparingly: it is server-wide."""
        import urllib.request

        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=10).close()


def threaded_moto_server(port: int) -> Any:
    """moto's ThreadedMotoServer on 127.0.0.1:``port`` (not started), routing requests without rescanning
    moto's package folder.

    moto 5's dispatcher asks whether a request's host names one of moto's modules by listing moto's
    package folder (``moto.backends.list_of_moto_modules``: about 190 entries, a ``stat`` each) on every
    request, under the dispatcher's one lock: 0.8 ms of CPU per request against 0.07 ms with the list
    read once. The folder does not change while a test session runs."""
    import moto.backends
    from moto.server import ThreadedMotoServer

    if not getattr(moto.backends.list_of_moto_modules, "read_once", False):
        modules = tuple(moto.backends.list_of_moto_modules())

        def list_of_moto_modules() -> tuple[str, ...]:
            return modules

        list_of_moto_modules.read_once = True  # type: ignore[attr-defined]
        moto.backends.list_of_moto_modules = list_of_moto_modules
    return ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """A moto server on a free 127.0.0.1 port for the whole session; yields its URL."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    port = free_port()
    server = threaded_moto_server(port)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def aws_proxy(moto_server: str) -> Iterator[AWSFaultProxy]:
    """The fault-injecting proxy every test client talks to (moto behind it)."""
    proxy = AWSFaultProxy(moto_server).start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def aws_faults(aws_proxy: AWSFaultProxy) -> Iterator[AWSFaultProxy]:
    """The proxy with no rules and no records; rules added by the test end with it."""
    aws_proxy.reset()
    yield aws_proxy
    aws_proxy.reset()


@pytest.fixture
def aws_env(aws_proxy: AWSFaultProxy, monkeypatch: pytest.MonkeyPatch) -> MotoAWS:
    """Fake credentials + the AWS endpoint in the environment, for code that builds its own clients."""
    env = aws_environment(aws_proxy.url)
    for name in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return MotoAWS(endpoint_url=aws_proxy.url, env=env)


@dataclass
class Network:
    vpc_id: str
    subnet_ids: list[str]
    availability_zones: list[str]


def network_octet() -> int:
    """The second octet of a new VPC's CIDR (127.X.0.0/16), between 64 and 253.

    Each xdist worker has its own moto server, whose first instances get the same private IPs
    in the same CIDR; simulated nodes listen on those IPs. So each worker draws from its own
    residue class (worker index modulo the worker count), and two workers' nodes never share
    an address."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    slots = 190 // count
    return 64 + index % count + count * (uuid.uuid4().int % slots)


def create_network(aws: MotoAWS, egress: str = "nat") -> Network:
    """A fresh VPC (in 127.0.0.0/8: see above) with one subnet in each of two availability zones, and
    a way out for its instances (``egress``: see :func:`give_egress`)."""
    ec2 = aws.client("ec2")
    octet = network_octet()
    vpc_id = ec2.create_vpc(CidrBlock=f"127.{octet}.0.0/16")["Vpc"]["VpcId"]
    zones = [f"{aws.region}a", f"{aws.region}b"]
    subnets = [
        ec2.create_subnet(VpcId=vpc_id, CidrBlock=f"127.{octet}.{i}.0/24", AvailabilityZone=az)["Subnet"][
            "SubnetId"
        ]
        for i, az in enumerate(zones)
    ]
    give_egress(aws, vpc_id, subnets[0], egress)
    return Network(vpc_id=vpc_id, subnet_ids=subnets, availability_zones=zones)


def give_egress(aws: MotoAWS, vpc_id: str, nat_subnet: str, egress: str) -> None:
    """The VPC's main route table's way out: ``"nat"`` (0.0.0.0/0 to a NAT gateway, what an instance
    with no public IPv4, such as a multi-NIC p4d, needs: AWS docs "Assign a public IPv4 address during
    instance launch"), ``"igw"`` (0.0.0.0/0 to an internet gateway only, a default VPC's), or ``"none"``."""
    if egress == "none":
        return
    ec2 = aws.client("ec2")
    (table,) = ec2.describe_route_tables(Filters=[{"Name": "vpc-id", "Values": [vpc_id]}])["RouteTables"]
    if egress == "nat":
        allocation = ec2.allocate_address(Domain="vpc")["AllocationId"]
        nat = ec2.create_nat_gateway(SubnetId=nat_subnet, AllocationId=allocation)["NatGateway"]["NatGatewayId"]
        ec2.create_route(RouteTableId=table["RouteTableId"], DestinationCidrBlock="0.0.0.0/0", NatGatewayId=nat)
    elif egress == "igw":
        igw = ec2.create_internet_gateway()["InternetGateway"]["InternetGatewayId"]
        ec2.attach_internet_gateway(InternetGatewayId=igw, VpcId=vpc_id)
        ec2.create_route(RouteTableId=table["RouteTableId"], DestinationCidrBlock="0.0.0.0/0", GatewayId=igw)
    else:
        raise ValueError(f"egress={egress!r}: one of nat, igw, none")


@pytest.fixture
def aws_network(aws_env: MotoAWS) -> Iterator[Network]:
    """A fresh VPC (in 127.0.0.0/8: see above) with one subnet in each of two availability zones."""
    yield create_network(aws_env)


@pytest.fixture
def no_leaked_instances(aws_env: MotoAWS) -> Iterator[None]:
    """Fail the test if it leaves any instance alive in moto."""
    before = {i["InstanceId"] for i in aws_env.live_instances()}
    yield
    leaked = [i["InstanceId"] for i in aws_env.live_instances() if i["InstanceId"] not in before]
    assert not leaked, f"instances left alive after the test: {leaked}"


@contextmanager
def offline_aws() -> Iterator[tuple[MotoAWS, AWSFaultProxy]]:
    """Outside pytest (the benchmarks): a moto server on a free loopback port behind the fault
    proxy (which adds what moto lacks, placement groups), this process's environment pointed at
    it with fake credentials and no AWS config files."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    port = free_port()
    server = threaded_moto_server(port)
    server.start()
    proxy = AWSFaultProxy(f"http://127.0.0.1:{port}").start()
    try:
        env_vars = aws_environment(proxy.url)
        os.environ.update(env_vars)
        os.environ["AWS_CONFIG_FILE"] = os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
        yield MotoAWS(endpoint_url=proxy.url, env=env_vars), proxy
    finally:
        proxy.stop()
        server.stop()


def iam_user_session(aws: "MotoAWS", *policies: dict[str, Any], prefix: str = "sgpu-user") -> tuple[str, Any]:
    """An IAM user of the moto account holding ``policies`` (inline), and a boto3 session of its keys."""
    import json
    import uuid

    import boto3

    iam = aws.client("iam")
    user = f"{prefix}-{uuid.uuid4().hex[:8]}"
    iam.create_user(UserName=user)
    for number, policy in enumerate(policies):
        iam.put_user_policy(UserName=user, PolicyName=f"p{number}", PolicyDocument=json.dumps(policy))
    keys = iam.create_access_key(UserName=user)["AccessKey"]
    return user, boto3.Session(aws_access_key_id=keys["AccessKeyId"], aws_secret_access_key=keys["SecretAccessKey"],
                               region_name=REGION)
