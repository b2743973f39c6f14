"""What a simulated EC2 node costs the test process, beside what runs on the node.

The simulator (``support.ec2_simulator``) polls moto every 0.3 s for instances to boot and to power
off. moto keeps terminated instances for a whole session (EC2 forgets them after about an hour:
EC2 User Guide, "Terminated instances"), and a test worker's moto server holds every instance of
every test before: a tick that described them all cost more with each test of the session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

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


def test_a_file_uv_linked_into_two_venvs_is_compiled_once_for_both(tmp_path: Path) -> None:
    """What a node's new venv does not pay again: bytecode of a hard-linked file is kept by the file, not
    by the venv's path (support/node_pycache). A file of one link keeps its own ``__pycache__``."""
    import os
    import subprocess
    import sys

    from support.ec2_simulator import NODE_PYCACHE

    cache, source = tmp_path / "uv-cache", tmp_path / "shared"
    source.mkdir()
    (source / "linked_mod.py").write_text("VALUE = 42\n")
    venvs = [tmp_path / "venv-a", tmp_path / "venv-b"]
    for venv in venvs:
        venv.mkdir()
        os.link(source / "linked_mod.py", venv / "linked_mod.py")  # as uv links from its cache
        (venv / "own_mod.py").write_text("VALUE = 7\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    env["SGPU_TEST_NODE_PYCACHE"] = str(cache)

    def imported(venv: Path) -> list[str]:
        code = "import linked_mod, own_mod; print(linked_mod.__cached__); print(own_mod.__cached__)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**env, "PYTHONPATH": f"{NODE_PYCACHE}{os.pathsep}{venv}"}, cwd=tmp_path)
        return out.stdout.split()

    first = imported(venvs[0])
    assert Path(first[0]).is_relative_to(cache) and Path(first[0]).exists(), first
    compiled = Path(first[0]).stat().st_mtime_ns
    second = imported(venvs[1])
    assert second[0] == first[0], "the second venv's linked file has the first one's bytecode"
    assert Path(second[0]).stat().st_mtime_ns == compiled, "and did not compile it again"
    for venv, (_, own) in zip(venvs, (first, second)):
        assert Path(own).is_relative_to(venv / "__pycache__") and Path(own).exists(), own
        assert not (venv / "__pycache__" / Path(first[0]).name).exists(), "no copy beside the linked file"


def test_the_tests_boto3_sessions_parse_each_service_model_once() -> None:
    """Beside the nodes, what every EC2 test's computes and stores cost the test process: each gets a
    session of its own (``MotoAWS.session``), and a session with a loader of its own parsed EC2's model
    and endpoints.json again (about 0.35 CPU s for EC2, S3 and SSM clients; 0.06 s with the shared loader)."""
    from support.aws_fixtures import FAKE_CREDENTIALS, boto3_session

    first, second = boto3_session(), boto3_session()
    loader = first._session.get_component("data_loader")
    assert second._session.get_component("data_loader") is loader
    for session in (first, second):
        assert session.get_credentials().access_key == FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"], "the fake keys"
        assert session.client("ec2", endpoint_url="http://127.0.0.1:9").meta.region_name == session.region_name


def test_with_moto_in_this_process_a_tick_describes_instances_only_when_moto_changed(
        aws_env: MotoAWS, aws_network: Network, aws_faults: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tick through the proxy costs ~15 ms of CPU every 0.3 s of every EC2 test; moto's own state says
    whether anything changed. The nodes still boot and power off on the next tick after the change."""
    from support import ec2_simulator

    ec2 = aws_env.client("ec2")
    launch = {"ImageId": aws_env.image_id(), "InstanceType": "t3.micro", "SubnetId": aws_network.subnet_ids[0]}
    node_env = {k: v for k, v in aws_env.env.items() if k != "AWS_ENDPOINT_URL"}
    simulator = EC2Simulator(ec2, node_env, tmp_path / "nodes", moto_in_process=True)  # ticked by the test
    ids: list[str] = []
    try:
        ids = [i["InstanceId"] for i in ec2.run_instances(
            MinCount=2, MaxCount=2, UserData="#!/bin/bash\nexec sleep 600\n", **launch)["Instances"]]
        simulator.tick()
        assert sorted(simulator.nodes) == sorted(ids)
        aws_faults.reset()
        for _ in range(5):
            simulator.tick()
        assert aws_faults.calls("DescribeInstances") == [], "nothing changed: no description"

        ec2.terminate_instances(InstanceIds=[ids[0]])
        aws_faults.reset()
        simulator.tick()
        assert len(aws_faults.calls("DescribeInstances")) == 1, "an instance changed state: one description"
        assert simulator.nodes[ids[0]].killed and simulator.nodes[ids[0]].proc.poll() is not None
        assert simulator.nodes[ids[1]].proc.poll() is None

        simulator.describe_every_s = 0.0  # the floor: a description however quiet moto is
        aws_faults.reset()
        simulator.tick()
        assert len(aws_faults.calls("DescribeInstances")) == 1

        # a moto elsewhere (this process's backends do not hold what it answers): every tick describes
        simulator.describe_every_s = 5.0
        monkeypatch.setattr(ec2_simulator, "in_process_moto_states", lambda: frozenset())
        aws_faults.reset()
        simulator.tick()
        simulator.tick()
        assert not simulator.moto_in_process and len(aws_faults.calls("DescribeInstances")) == 2
        assert not simulator.errors, simulator.errors
    finally:
        if ids:
            ec2.terminate_instances(InstanceIds=ids)
        simulator.close()


def test_the_moto_server_routes_requests_without_listing_motos_package_folder(
        aws_env: MotoAWS, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request of every test reaches moto's dispatcher; moto 5 listed its own package folder (a stat
    per entry) for each one, under the dispatcher's lock (support.aws_fixtures.threaded_moto_server)."""
    import os

    import moto

    folder = os.path.dirname(moto.__file__)
    listed: list[str] = []
    real = os.listdir

    def listdir(path: Any = ".") -> list[str]:
        listed.append(str(path))
        return real(path)

    s3 = aws_env.client("s3")
    s3.create_bucket(Bucket="sgpu-routing-probe")
    monkeypatch.setattr(os, "listdir", listdir)
    s3.put_object(Bucket="sgpu-routing-probe", Key="k", Body=b"v")
    assert s3.get_object(Bucket="sgpu-routing-probe", Key="k")["Body"].read() == b"v"
    aws_env.client("ec2").describe_vpcs()
    assert folder not in listed, f"moto listed {folder} while routing a request"
