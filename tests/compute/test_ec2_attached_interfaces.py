"""The driver never launches a node onto an existing network interface (issue 49, part B).

``RunInstances`` accepts, in a network interface spec, the ``NetworkInterfaceId`` of an interface
that already exists (AWS EC2 API reference, "InstanceNetworkInterfaceSpecification"): the node
would come up with that interface's subnet, security groups and addresses, none of them the run's.
The shipped driver policy allows ``ec2:RunInstances`` on ``network-interface/*`` without a condition
(the interfaces EC2 creates for a node are that resource too), so it cannot refuse this; the
request builder does, for every request the driver sends.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from prefect_sgpu import spec
from prefect_sgpu.compute.ec2.instances import EC2Provisioner, EC2Settings
from prefect_sgpu.compute.ec2.request import LaunchAttempt, refuse_attached_interfaces
from prefect_sgpu.errors import SGPUConfigError

USER_DATA = "#!/bin/bash\necho node-bootstrap\n"
SUBNET, GROUP, ENI = "subnet-0123456789abcdef0", "sg-0123456789abcdef0", "eni-0badc0ffee0123456"


def request_for(gpus: int, gpu_type: str) -> dict[str, Any]:
    prov = EC2Provisioner(EC2Settings(subnet_ids=[SUBNET], security_group_id=GROUP))
    plan = spec.plan_remote(spec.JobSpec(gpus=gpus, gpu_type=gpu_type, remote=True))
    return prov.run_instances_request("r-eni", plan, USER_DATA)


def test_what_the_driver_renders_creates_every_interface_it_names() -> None:
    for gpus, gpu_type in ((16, "A100"), (16, "H100"), (2, "A10")):
        request = request_for(gpus, gpu_type)
        refuse_attached_interfaces(request)  # passes: EC2 creates each interface
        assert all("NetworkInterfaceId" not in nic for nic in request.get("NetworkInterfaces", []))


def test_a_launch_that_would_attach_an_existing_interface_is_refused_naming_it() -> None:
    request = request_for(16, "A100")  # p4d.24xlarge: four interfaces, one per card
    params = copy.deepcopy(request)
    params["NetworkInterfaces"][2]["NetworkInterfaceId"] = ENI  # as an override or an extra field would
    attempt = LaunchAttempt("on-demand", SUBNET, params)

    with pytest.raises(SGPUConfigError) as raised:
        attempt.resolved("ami-0123456789abcdef0", GROUP, "/dev/sda1")  # what provisioning sends
    assert raised.value.field == "NetworkInterfaces[2].NetworkInterfaceId"
    assert raised.value.value == ENI
    assert "EC2 creates" in raised.value.allowed
    assert ENI in str(raised.value)

    # the same request without it is sent as rendered
    clean = LaunchAttempt("on-demand", SUBNET, request).resolved("ami-0123456789abcdef0", GROUP, "/dev/sda1")
    assert clean["NetworkInterfaces"] == request["NetworkInterfaces"]


def test_an_existing_interface_on_a_plain_instance_type_is_refused_too() -> None:
    request = request_for(2, "A10")  # no EFA: SubnetId and SecurityGroupIds, no interface specs
    params = {**request, "NetworkInterfaces": [{"DeviceIndex": 0, "NetworkInterfaceId": ENI}]}
    with pytest.raises(SGPUConfigError, match=r"NetworkInterfaces\[0\]\.NetworkInterfaceId="):
        LaunchAttempt("spot", SUBNET, params).resolved("ami-0123456789abcdef0", GROUP, "/dev/sda1")
