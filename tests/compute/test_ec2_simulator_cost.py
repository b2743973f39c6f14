"""What a simulated EC2 node costs the test process, beside what runs on the node.

The simulator (``support.ec2_simulator``) polls moto every 0.3 s for instances to boot and to power
off. moto keeps terminated instances for a whole session (EC2 forgets them after about an hour:
EC2 User Guide, "Terminated instances"), and a test worker's moto server holds every instance of
every test before: a tick that described them all cost more with each test of the session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.aws_fixtures import MotoAWS, Network
from support.ec2_simulator import EC2Simulator


def test_a_tick_describes_only_live_instances_and_still_powers_off_stopped_and_terminated_nodes(
        aws_env: MotoAWS, aws_network: Network, aws_faults: Any, tmp_path: Path) -> None:
    ec2 = aws_env.client("ec2")
    launch = {"ImageId": aws_env.image_id(), "InstanceType": "t3.micro", "SubnetId": aws_network.subnet_ids[0]}
    earlier = [i["InstanceId"] for i in ec2.run_instances(
        MinCount=20, MaxCount=20, UserData="#!/bin/bash\nexit 0\n", **launch)["Instances"]]
    ec2.terminate_instances(InstanceIds=earlier)  # what the tests before left in the session's moto
    node_env = {k: v for k, v in aws_env.env.items() if k != "AWS_ENDPOINT_URL"}
    simulator = EC2Simulator(ec2, node_env, tmp_path / "nodes")  # not started: this test ticks it
    ids: list[str] = []
    try:
        ids = [i["InstanceId"] for i in ec2.run_instances(
            MinCount=2, MaxCount=2, UserData="#!/bin/bash\nexec sleep 600\n", **launch)["Instances"]]
        aws_faults.reset()
        simulator.tick()
        assert sorted(simulator.nodes) == sorted(ids), "the new instances boot, the terminated ones never"
        assert all(node.proc.poll() is None for node in simulator.nodes.values())
        described = aws_faults.calls("DescribeInstances")
        assert described, "the tick describes instances"
        for call in described:
            asked = {v for k, v in call.params.items() if k.startswith("Filter.1.Value.")}
            assert call.params.get("Filter.1.Name") == "instance-state-name" and asked == {"pending", "running"}, \
                f"a tick described more than the live instances: {call.params}"

        terminated, stopped = ids
        ec2.terminate_instances(InstanceIds=[terminated])
        ec2.stop_instances(InstanceIds=[stopped])
        simulator.tick()
        for iid in ids:
            node = simulator.nodes[iid]
            assert node.killed and node.proc.poll() is not None, f"{iid} still runs: {simulator.describe()}"
        assert not simulator.errors, simulator.errors
    finally:
        if ids:
            ec2.terminate_instances(InstanceIds=ids)
        simulator.close()
