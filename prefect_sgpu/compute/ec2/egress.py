"""Whether a node of a multi-NIC launch can reach AWS from its subnet, checked before anything is spent.

EC2 assigns no public IPv4 address to an instance launched with more than one network interface
(AWS docs, "Assign a public IPv4 address during instance launch": "You can't auto-assign a public
IP address if you specify more than one network interface"; the EFA docs repeat it for p4d, p5 and
the other multi-card types). In a subnet whose only way out is an internet gateway such a node
reaches neither S3 (the store), SSM (the job key) nor a package index: it waits out its TTL and
powers itself off, and a replacement falls into the same trap.

So for a launch whose request carries more than one network interface, each subnet's route table
(its own association, else the VPC's main table) must give one of:

- a ``0.0.0.0/0`` route to a NAT gateway (or another NAT path: a transit gateway, a NAT
  instance or its interface), which reaches everything; or
- an S3 gateway endpoint on that route table **and** an SSM interface endpoint in the VPC, which
  reach the store and the job key only: enough when the image has the environment
  (``environment="image"``), not when nodes build it from a package index.

Everything here is a read (``DescribeRouteTables``, ``DescribeVpcEndpoints``).
"""

from __future__ import annotations

from typing import Any

from prefect_sgpu.errors import SGPUConfigError

#: route targets that give a node without a public address a way out (NAT of some kind)
NAT_TARGETS = ("NatGatewayId", "TransitGatewayId", "InstanceId", "NetworkInterfaceId")


def interfaces_of(request: dict[str, Any]) -> int:
    """How many network interfaces a rendered ``run_instances`` request gives each instance."""
    return max(1, len(request.get("NetworkInterfaces", [])))


def route_table(ec2: Any, subnet_id: str, vpc_id: str) -> dict[str, Any] | None:
    """The subnet's route table: its explicit association, else its VPC's main table."""
    tables = ec2.describe_route_tables(
        Filters=[{"Name": "association.subnet-id", "Values": [subnet_id]}])["RouteTables"]
    if tables:
        return tables[0]
    tables = ec2.describe_route_tables(Filters=[{"Name": "vpc-id", "Values": [vpc_id]}])["RouteTables"]
    return next((t for t in tables if any(a.get("Main") for a in t.get("Associations", []))), None)


def way_out(ec2: Any, region: str, subnet_id: str, vpc_id: str, needs_index: bool) -> tuple[bool, str]:
    """(usable, what the subnet offers) for a node with no public IPv4 in ``subnet_id``."""
    table = route_table(ec2, subnet_id, vpc_id)
    if table is None:
        return False, "no route table"
    default = [r for r in table.get("Routes", []) if r.get("DestinationCidrBlock") == "0.0.0.0/0"
               and r.get("State", "active") == "active"]
    for route in default:
        for target in NAT_TARGETS:
            if route.get(target):
                return True, f"0.0.0.0/0 via {route[target]} ({table['RouteTableId']})"
    endpoints = ec2.describe_vpc_endpoints(Filters=[{"Name": "vpc-id", "Values": [vpc_id]}])["VpcEndpoints"]
    live = [e for e in endpoints if str(e.get("State", "available")).lower() in ("available", "pending")]
    s3 = [e for e in live if e.get("ServiceName") == f"com.amazonaws.{region}.s3"
          and e.get("VpcEndpointType", "Gateway") == "Gateway" and table["RouteTableId"] in e.get("RouteTableIds", [])]
    ssm = [e for e in live if e.get("ServiceName") == f"com.amazonaws.{region}.ssm"
           and e.get("VpcEndpointType") == "Interface"]
    igw = [r["GatewayId"] for r in default if str(r.get("GatewayId", "")).startswith("igw-")]
    found = (f"0.0.0.0/0 only via internet gateway {igw[0]}" if igw else "no 0.0.0.0/0 route to a NAT gateway")
    found += f" in {table['RouteTableId']}"
    if s3 and ssm:
        if not needs_index:
            return True, f"{found}; S3 gateway endpoint {s3[0]['VpcEndpointId']} and SSM endpoint " \
                         f"{ssm[0]['VpcEndpointId']}"
        return False, f"{found}; S3 and SSM endpoints, but the nodes build the environment from a package index"
    missing = [name for name, have in (("an S3 gateway endpoint on that route table", s3),
                                       (f"an SSM interface endpoint (com.amazonaws.{region}.ssm)", ssm)) if not have]
    return False, f"{found}; no {' and no '.join(missing)}"


def fixes(region: str) -> str:
    return ("a NAT gateway as the subnet's 0.0.0.0/0 route; or an S3 gateway endpoint on its route table and an "
            f"SSM interface endpoint (com.amazonaws.{region}.ssm) in the VPC, with environment='image'; or "
            "subnet_ids naming a subnet that has them (docs/ec2.md, 'Multi-NIC types have no public IPv4')")


def subnets_with_way_out(ec2: Any, region: str, instance_type: str, interfaces: int,
                         subnets: dict[str, dict[str, Any]], needs_index: bool) -> set[str]:
    """The subnets of ``subnets`` a launch of ``interfaces`` network interfaces may use (all of them for
    one interface); none is a :class:`SGPUConfigError` naming each subnet, what it offers, and the fixes."""
    if interfaces <= 1:
        return set(subnets)
    found = {sid: way_out(ec2, region, sid, s["VpcId"], needs_index) for sid, s in subnets.items()}
    usable = {sid for sid, (ok, _) in found.items() if ok}
    if usable:
        return usable
    detail = "; ".join(f"{sid}: {what}" for sid, (_, what) in found.items())
    raise SGPUConfigError(
        "subnet_ids", list(subnets),
        f"a subnet where {instance_type} (launched with {interfaces} network interfaces, so EC2 gives it no "
        f"public IPv4 address) can reach S3 and SSM: {fixes(region)}",
        hint=detail,
    )
