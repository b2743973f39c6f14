"""What a ``@ray_launch`` cluster exposes: where its processes listen, and who may talk to it.

One real single-node job on this host: its driver lists the listening TCP sockets of
every process of the job's Ray cluster while the cluster is up, and, while it waits,
this test process knocks on the cluster's GCS without the job's token.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from prefect_sgpu.ray import ray_launch

# @ray_launch clusters sit on the local compute's node addresses (127.0.0.1, 127.0.0.2): these
# modules share one xdist worker, so two such clusters never run at once (docs/testing.md)
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("ray-launch")]

#: how long either side waits for the other; a limit on a hang, not a timing assertion
HANDOFF_TIMEOUT_S = 300.0


def _call(address: str, server: str, token: str | None) -> str:
    """One harmless read from the cluster's GCS or raylet at ``address``; the gRPC status code's name.

    ``GetClusterId`` (GCS) and ``GetSystemConfig`` (raylet) need no cluster id and no
    arguments, so a refusal can only come from the token check.
    """
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc

    metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
    with grpc.insecure_channel(address) as channel:
        try:
            if server == "gcs":
                gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                    gcs_service_pb2.GetClusterIdRequest(), timeout=30, metadata=metadata)
            else:
                node_manager_pb2_grpc.NodeManagerServiceStub(channel).GetSystemConfig(
                    node_manager_pb2.GetSystemConfigRequest(), timeout=30, metadata=metadata)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    return "OK"


def _job_processes() -> list[Any]:
    """This job's node process on this host and everything it started (Ray's processes, this driver)."""
    import psutil

    node = psutil.Process()
    while "prefect_sgpu.ray.node" not in " ".join(node.cmdline()):
        parent = node.parent()
        assert parent is not None, "the driver runs under the job's node process"
        node = parent
    return [node, *node.children(recursive=True)]


def _listening_sockets() -> list[dict[str, Any]]:
    import psutil

    found = []
    for proc in _job_processes():
        try:
            name = proc.name()
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append({"pid": proc.pid, "name": name, "ip": conn.laddr.ip,
                                  "port": conn.laddr.port})
        except psutil.NoSuchProcess:
            continue
    return found


def _ray_temp_dirs() -> set[str]:
    """The ``--temp-dir`` the job's ``ray start`` was given."""
    import psutil

    found = set()
    for proc in _job_processes():
        try:
            found |= {arg.split("=", 1)[1] for arg in proc.cmdline() if arg.startswith("--temp-dir=")}
        except psutil.NoSuchProcess:
            continue
    return found


def _report_then_wait(handoff: str) -> dict[str, Any]:
    """The job's driver: start a worker, report the cluster's listeners, wait for the outside probe."""
    import os

    import ray

    ray.init()  # RAY_ADDRESS points at the job's head

    @ray.remote(num_cpus=1)
    def square(x: int) -> int:
        return x * x

    value = ray.get(square.remote(7))  # a worker process is up and listening too
    (node,) = ray.nodes()
    raylet = f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"
    servers = {"gcs": os.environ["RAY_ADDRESS"], "raylet": raylet}
    token = os.environ["RAY_AUTH_TOKEN"]
    report = {"servers": servers, "driver_pid": os.getpid(), "listening": _listening_sockets(),
              "with_token": {server: _call(address, server, token) for server, address in servers.items()}}
    report["temp_dirs"] = {path: os.stat(Path(path).parent).st_mode & 0o777 for path in _ray_temp_dirs()}
    folder = Path(handoff)
    (folder / "report.json.tmp").write_text(json.dumps(report))
    (folder / "report.json.tmp").rename(folder / "report.json")
    deadline = time.monotonic() + HANDOFF_TIMEOUT_S
    while not (folder / "probed").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return {**report, "value": value}


def _wait_for(path: Path, future: Any) -> None:
    deadline = time.monotonic() + HANDOFF_TIMEOUT_S
    while not path.exists():
        if future.done():
            future.result()  # raises the job's failure
            pytest.fail("the driver finished without reporting its cluster's listeners")
        assert time.monotonic() < deadline, f"the driver never wrote {path.name}"
        time.sleep(0.5)


def _unmapped(ip: str) -> str:
    import ipaddress

    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped) if mapped is not None else str(address)


def test_a_local_cluster_listens_on_loopback_only_and_refuses_clients_without_the_job_token(
        tmp_path: Path) -> None:
    handoff = tmp_path / "handoff"
    handoff.mkdir()
    fn = ray_launch(gpus=1, mlflow=False)(_report_then_wait)
    future = fn.submit(str(handoff))
    try:
        _wait_for(handoff / "report.json", future)
        report = json.loads((handoff / "report.json").read_text())
        # while the cluster is up: this process holds no token, or the wrong one
        refused = {f"{server} with {what}": _call(address, server, token)
                   for server, address in report["servers"].items()
                   for what, token in (("no token", None), ("a wrong token", "0" * 64))}
    finally:
        (handoff / "probed").write_text("done")
    result = future.result(timeout=HANDOFF_TIMEOUT_S)

    assert result["value"] == 49, "the job, which holds the token, ran on its cluster"
    assert result["with_token"] == {"gcs": "OK", "raylet": "OK"}, "the same calls with the job's token"
    for who, outcome in refused.items():
        assert outcome.startswith("UNAUTHENTICATED") and "token" in outcome.lower(), f"{who}: {outcome}"

    listening = result["listening"]
    names = {row["name"] for row in listening}
    assert {"gcs_server", "raylet"} <= names, f"the job's Ray processes were found: {listening}"
    assert any(row["pid"] == result["driver_pid"] for row in listening), "the driver's own gRPC server"
    assert any(name.startswith("ray::") for name in names), "the agents and the worker"
    exposed = [row for row in listening if _unmapped(row["ip"]) != "127.0.0.1"]
    assert exposed == [], f"bound to a wildcard or another address than the node's 127.0.0.1: {exposed}"

    # ray start --temp-dir=...; Ray makes that folder 0777 itself, so what guards it is its parent
    (temp, mode), = result["temp_dirs"].items()
    private = Path(temp).parent
    assert private.name.startswith("sgpu-ray0-") and mode == 0o700, f"{private} (mode {mode:o})"
    assert len(temp) + len("/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store") <= 107
    assert not private.exists(), "removed after a clean run"
