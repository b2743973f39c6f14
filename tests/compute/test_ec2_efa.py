"""EFA instance types: the interfaces each family is launched with, and what its ranks are told.

The layouts follow AWS's "Maximize network bandwidth on Amazon EC2 instances with multiple network
cards" (efa-acc-inst-types.html); the fault proxy's ``efa_rules`` refuse what EC2 refuses there
(an ``efa-only`` primary interface, two interfaces on one card and device index, a card the type
lacks), which moto would accept.
"""

from __future__ import annotations

from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from prefect_sgpu import catalog, spec
from prefect_sgpu.compute.ec2 import efa
from prefect_sgpu.compute.ec2.instances import EC2Provisioner, EC2Settings

USER_DATA = "#!/bin/bash\necho node-bootstrap\n"
SUBNET, GROUP = "subnet-0123456789abcdef0", "sg-0123456789abcdef0"


def request_for(gpus: int, gpu_type: str) -> dict[str, Any]:
    prov = EC2Provisioner(EC2Settings(subnet_ids=[SUBNET], security_group_id=GROUP))
    plan = spec.plan_remote(spec.JobSpec(gpus=gpus, gpu_type=gpu_type, remote=True))
    return prov.run_instances_request("r-efa", plan, USER_DATA)


def layout_of(request: dict[str, Any]) -> list[tuple[int, int, str]]:
    return [(n["NetworkCardIndex"], n["DeviceIndex"], n["InterfaceType"]) for n in request["NetworkInterfaces"]]


def test_p4d_gets_an_efa_interface_on_each_of_its_four_cards() -> None:
    request = request_for(16, "A100")
    assert request["InstanceType"] == "p4d.24xlarge"
    assert layout_of(request) == [(0, 0, "efa"), (1, 1, "efa"), (2, 1, "efa"), (3, 1, "efa")]
    assert "SubnetId" not in request and "SecurityGroupIds" not in request
    assert all(n["SubnetId"] == SUBNET and n["Groups"] == [GROUP] and n["DeleteOnTermination"]
               for n in request["NetworkInterfaces"])


def test_p5_gets_efa_on_card_zero_and_efa_only_on_its_other_31_cards() -> None:
    request = request_for(16, "H100")
    assert request["InstanceType"] == "p5.48xlarge"
    layout = layout_of(request)
    assert layout[0] == (0, 0, "efa")  # the primary interface: EFA with ENA, the instance's IP address
    assert layout[1:] == [(card, 0, "efa-only") for card in range(1, 32)]


def test_a_type_without_efa_gets_a_plain_interface() -> None:
    request = request_for(2, "A10")
    assert "NetworkInterfaces" not in request
    assert request["SubnetId"] == SUBNET and request["SecurityGroupIds"] == [GROUP]


def test_the_layout_table_agrees_with_the_catalog() -> None:
    for accelerator in catalog.CATALOG.values():
        for itype in accelerator.instance_types:
            layout = efa.layout_for(itype.name)
            if itype.efa_interfaces:
                assert layout is not None and layout.cards == itype.efa_interfaces, itype.name
                assert len(efa.network_interfaces(itype.name, None, ["sg"])) == itype.efa_interfaces
            else:
                assert layout is None and efa.network_interfaces(itype.name, None, ["sg"]) == []


def test_ranks_on_efa_types_are_told_their_network_and_floor() -> None:
    assert efa.rank_hints("p4d.24xlarge") == {"SGPU_EFA": "1", "SGPU_EFA_RDMA": "1",
                                              "SGPU_INSTANCE_TYPE": "p4d.24xlarge", "SGPU_EFA_MIN_BUS_GBPS": "40"}
    assert efa.rank_hints("p5.48xlarge")["SGPU_EFA_MIN_BUS_GBPS"] == "150"
    g5 = efa.rank_hints("g5.48xlarge")
    assert g5["SGPU_EFA_RDMA"] == "0" and "SGPU_EFA_MIN_BUS_GBPS" not in g5  # no RDMA, no published floor
    assert efa.rank_hints("g5.xlarge") == {}


def test_ec2_refuses_what_the_layout_must_never_send(aws_env: Any, aws_faults: Any) -> None:
    """The proxy's rules, against the requests EC2 refuses (moto alone accepts them)."""
    aws_faults.efa_rules = True
    ec2 = boto3.client("ec2", region_name=aws_env.region, endpoint_url=aws_faults.url)
    base = {"ImageId": aws_env.image_id(), "MinCount": 1, "MaxCount": 1, "InstanceType": "p5.48xlarge"}
    for interfaces, code in (
        ([{"NetworkCardIndex": 0, "DeviceIndex": 0, "InterfaceType": "efa-only"}], "InvalidParameterCombination"),
        ([{"NetworkCardIndex": 0, "DeviceIndex": 0, "InterfaceType": "efa"},
          {"NetworkCardIndex": 1, "DeviceIndex": 0, "InterfaceType": "efa-only"},
          {"NetworkCardIndex": 1, "DeviceIndex": 0, "InterfaceType": "efa-only"}], "InvalidParameterValue"),
        ([{"NetworkCardIndex": 0, "DeviceIndex": 0, "InterfaceType": "efa"},
          {"NetworkCardIndex": 32, "DeviceIndex": 0, "InterfaceType": "efa-only"}], "InvalidParameterValue"),
    ):
        with pytest.raises(ClientError) as info:
            ec2.run_instances(**base, NetworkInterfaces=interfaces)
        assert info.value.response["Error"]["Code"] == code


@pytest.mark.usefixtures("no_leaked_instances")
def test_p5_layout_is_accepted_by_ec2s_rules(aws_env: Any, aws_network: Any, aws_faults: Any) -> None:
    aws_faults.efa_rules = True
    prov = EC2Provisioner(EC2Settings(
        region=aws_env.region, subnet_ids=aws_network.subnet_ids[:1], instance_profile=aws_env.instance_profile(),
        ami_id=aws_env.image_id(), endpoint_url=aws_env.endpoint_url, max_attempts=1, waiter_delay_s=0.2,
        running_timeout_s=30))
    plan = spec.plan_remote(spec.JobSpec(gpus=16, gpu_type="H100", remote=True))
    try:
        instances = prov.provision("r-p5", plan, USER_DATA)
        assert [i.instance_type for i in instances] == ["p5.48xlarge"] * 2
        call = [c.params for c in aws_faults.calls("RunInstances")][-1]
        assert call["NetworkInterface.1.InterfaceType"] == "efa"
        assert {call[f"NetworkInterface.{n}.InterfaceType"] for n in range(2, 33)} == {"efa-only"}
    finally:
        prov.terminate("r-p5")


def test_the_launch_tells_ranks_their_efa_network_without_overriding_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute

    compute = SimpleNamespace(region="us-east-1", store=SimpleNamespace(env=dict), endpoint_url=None)

    def launch_env(instance_type: str, job_env: dict[str, str]) -> dict[str, str]:
        request = SimpleNamespace(instance_type=instance_type, spec=SimpleNamespace(env=job_env))
        return EC2InstanceCompute._launch_env(compute, SimpleNamespace(request=request))  # type: ignore[arg-type]

    env = launch_env("p5.48xlarge", {})
    assert env["SGPU_EFA"] == "1" and env["SGPU_EFA_RDMA"] == "1" and env["SGPU_EFA_MIN_BUS_GBPS"] == "150"
    assert "SGPU_EFA_MIN_BUS_GBPS" not in launch_env("p5.48xlarge", {"SGPU_EFA_MIN_BUS_GBPS": "0"})
    assert "SGPU_EFA" not in launch_env("g5.12xlarge", {})


def _network_env() -> dict[str, str | None]:
    import os

    return {name: os.environ.get(name) for name in ("FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "NCCL_NET_PLUGIN")}


@pytest.mark.e2e
def test_ranks_on_an_efa_node_get_nccl_environment_and_keep_the_jobs(ec2: Any) -> None:
    """Booted nodes, real ranks: the hints an EFA type's launch carries (given here through the job's env,
    as the simulator boots no p4d) become NCCL's environment in every rank; what the job set stays."""
    from prefect_sgpu import distributed

    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(), mlflow=False, timeout=300,
                     env={"SGPU_EFA": "1", "SGPU_EFA_RDMA": "1", "NCCL_NET_PLUGIN": "mine"})(_network_env)
    values = fn.job().run().values
    assert values == [{"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_NET_PLUGIN": "mine"}] * 2
