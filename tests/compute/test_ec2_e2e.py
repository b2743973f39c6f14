"""EC2 compute end to end, offline: moto server, real boto3, real torch.distributed (gloo).

Every instance moto launches is booted by :mod:`ec2_simulator`: its real user-data runs
as a local process with a fake IMDSv2, so the bootstrap, the S3 store, the SSM-held
payload key, the launch documents, heartbeats and self-termination all run for real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable
from urllib.parse import unquote

import pytest

from support.aws_fixtures import FAKE_CREDENTIALS, MotoAWS, Network, free_port
from support.conformance_ec2 import HEARTBEAT_TTL_S, EC2Env
from support.ec2_simulator import REPO_ROOT
from prefect_sgpu import LaunchTimeout, distributed, runtime
from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute
from prefect_sgpu.compute.ec2.request import RUN_ID_TAG
from prefect_sgpu.errors import DocumentRefused, InfrastructureLost, SGPUConfigError
from prefect_sgpu.protocol.jobfolder import (LAUNCH_KEY, Alive, JobFolder, LaunchDocument, launch_bundle, new_key,
                                   ssm_key_parameter)
from prefect_sgpu.store import store_scope
from prefect_sgpu.store.s3 import S3Store
from support.threads import run_in_thread
from support.rank_functions import TrainingDiverged, fails_on_rank_1
from support.tokens import digest_of, token_digest

pytestmark = pytest.mark.e2e


def _all_reduce(tag: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    runtime.init_process_group()
    t = torch.tensor([float(runtime.rank())])
    dist.all_reduce(t)
    print(f"{tag}: rank {runtime.rank()} of {runtime.world_size()} sum={t.item():g}")
    return {"rank": runtime.rank(), "node": runtime.node_rank(), "world": runtime.world_size(),
            "sum": t.item()}


def test_two_g5_nodes_return_values_in_rank_order(ec2: EC2Env, capfd: pytest.CaptureFixture[str]) -> None:
    assert ec2.proxy is not None
    ec2.proxy.prices.list_on_demand(ec2.aws.region, "g5.xlarge", 1.006)  # the Price List API (moto has none)
    compute = ec2.compute()
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=compute, mlflow=False,
                     timeout=300)(_all_reduce)
    job = fn.job("hello")
    result = job.run()

    assert result.plan.nodes == 2 and result.plan.instance_type.name == "g5.xlarge"
    assert [v["rank"] for v in result.values] == [0, 1]
    assert [v["node"] for v in result.values] == [0, 1]
    assert all(v["world"] == 2 and v["sum"] == 1.0 for v in result.values)
    out = capfd.readouterr().out
    assert "[rank 0 node 0] hello: rank 0 of 2 sum=1" in out
    assert "[rank 1 node 1] hello: rank 1 of 2 sum=1" in out
    assert result.logs_uri == f"s3://{ec2.bucket}/jobs/{result.run_id}/logs"

    instances = ec2.instances(result.run_id)
    assert len(instances) == 2 and {i["InstanceType"] for i in instances} == {"g5.xlarge"}
    assert all(i["State"]["Name"] == "terminated" for i in instances), "release terminated every instance"
    assert result.cost and result.cost["instance_hours"] > 0 and result.cost["usd"] > 0
    # each figure says where its price came from: the instances' from the Price List API, the driver's
    # S3 requests (counted) and transfer priced as estimates
    assert result.cost["price_source"] == "price-list"
    assert result.cost["compute"][f"on-demand {ec2.aws.region}"]["source"] == "price-list"
    assert result.cost["storage"]["source"] == result.cost["transfer"]["source"] == "estimate"
    assert result.cost["storage"]["requests"]["PUT"] > 0 and result.cost["storage"]["usd"] > 0
    assert result.cost["total_usd"] >= result.cost["usd"]
    # the nodes' own S3 requests, each node's counted on its store client up to its status and reported with it:
    # the proxy's record of this run's folder, by kind, is the driver's (counted on its client) and the nodes'
    # to the write, but for the reads a node goes on making after its status (the driver's heartbeat and the
    # rejoin document, every second, until its instance is terminated) and the release's cleanup, not counted;
    # and each node's first stage (urllib's agent), whose environment fetch its node counts too
    nodes = result.cost["storage"]["nodes"]
    assert nodes["counted"] == "measured" and nodes["reported"] == nodes["nodes"] == 2, nodes
    on_wire: dict[str, int] = {}
    for r in list(ec2.proxy.requests):
        if r.service == "rest" and r.method and (f"/{result.run_id}/" in unquote(r.path)
                                                 or r.agent.startswith("Python-urllib")):
            query = r.path.partition("?")[2]
            kind = "LIST" if r.method == "GET" and any(q in query for q in ("list-type", "prefix=")) else r.method
            on_wire[kind] = on_wire.get(kind, 0) + 1
    counted: dict[str, int] = {}
    for part in (result.cost["storage"]["requests"], nodes["requests"]):
        for kind, n in part.items():
            counted[kind] = counted.get(kind, 0) + n
    assert on_wire["PUT"] == counted["PUT"], (on_wire, counted)  # every write: the nodes' own and the driver's
    for kind in ("GET", "LIST"):  # reads: those after a node's status, and the release's cleanup, not counted
        assert 0 <= on_wire[kind] - counted[kind] <= 0.5 * counted[kind], (kind, on_wire, counted)

    # where the time went: EC2's phases per node, once each, in the order they happen
    first = {}
    for p in result.timeline:
        assert (p.phase, p.node) not in first, f"{p.phase} of node {p.node} twice: {result.timeline}"
        first[(p.phase, p.node)] = p
    ids = {i["AmiLaunchIndex"]: i["InstanceId"] for i in instances}
    assert set(ids.values()) <= set(first[("instances running", None)].detail.replace(",", " ").split())
    for node in (0, 1):
        assert ids[node] in first[("agent up", node)].detail and first[("environment ready", node)].detail == ids[node]
        # the node's own clock (the simulator's nodes share the driver's): booted after the request, before its alive
        assert first[("launch requested", None)].at <= first[("environment ready", node)].at \
            <= first[("agent up", node)].at
        steps = [("launch requested", None), ("instances running", None), ("agent up", node), ("acquired", None),
                 ("started", None), ("rendezvous", node), ("ranks done", node), ("release", None)]
        times = [first[s].at for s in steps]
        assert times == sorted(times), list(zip(steps, times))

    # the rendezvous ran on node 0's address as EC2 reports it (DescribeInstances)
    node0 = next(i for i in instances if i["AmiLaunchIndex"] == 0)
    moto_ip, address = ec2.simulator.address_of(node0["InstanceId"])
    assert moto_ip == address == node0["PrivateIpAddress"] == job.allocation.nodes[0].address
    objects = ec2.objects(result.run_id)

    # no secret in the user-data, and the job key never at rest in S3
    key = job.prepare()[2]
    secrets = [key, *{v for v in FAKE_CREDENTIALS.values()}]
    for iid, node in ec2.simulator.nodes.items():
        assert "prefect_sgpu.launch.bootstrap" in node.user_data
        assert not any(s in node.user_data for s in secrets), f"secret in the user-data of {iid}"
        assert "AWS_" not in node.user_data and "SGPU_PAYLOAD_KEY" not in node.user_data
    for name, blob in objects.items():
        assert key.encode() not in blob, f"job key in {name}"
    ssm = ec2.aws.client("ssm")
    with pytest.raises(ssm.exceptions.ParameterNotFound):
        ssm.get_parameter(Name=ssm_key_parameter(result.run_id, ec2.store().scope))
    assert f"SSM parameter {ssm_key_parameter(result.run_id, ec2.store().scope)}" in result.released
    assert {i["InstanceId"] for i in instances} <= set(result.released)
    # rank logs stay in the store; payload and results are cleaned up
    assert b"rank 1 of 2" in objects[f"jobs/{result.run_id}/logs/rank-00001.log"]
    assert not any("/results/" in k or k.endswith("payload.bin") for k in objects)


def test_dry_run_spends_nothing(ec2: EC2Env) -> None:
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(), mlflow=False)(_all_reduce)
    before = len(ec2.aws.client("ec2").describe_instances()["Reservations"])
    plan = fn.dry_run("x")
    request = plan["run_instances"]
    assert request["InstanceType"] == "g5.xlarge" and request["MinCount"] == request["MaxCount"] == 2
    assert "prefect_sgpu.launch.bootstrap" in request["UserData"]
    assert [n["index"] for n in plan["nodes"]] == [0, 1]
    assert all("SGPU_PAYLOAD_KEY" not in n["env"] for n in plan["nodes"]), "the key travels through SSM only"
    assert plan["payload_key"].startswith(f"SSM SecureString {ssm_key_parameter(plan['run_id'], ec2.store().scope)} ")
    assert plan["estimated_usd_per_hour"] == pytest.approx(2 * 1.006)
    assert len(ec2.aws.client("ec2").describe_instances()["Reservations"]) == before


def test_rank_failure_is_reraised_and_every_instance_terminated(ec2: EC2Env) -> None:
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(), mlflow=False,
                     timeout=300)(fails_on_rank_1)
    job = fn.job()
    with pytest.raises(TrainingDiverged, match="loss is nan") as info:
        job.run()
    failure = info.value.sgpu_failure  # type: ignore[attr-defined]
    assert failure.rank == 1 and failure.node == 1
    instances = ec2.instances(job.run_id)
    assert len(instances) == 2 and all(i["State"]["Name"] == "terminated" for i in instances)


def test_node_that_never_boots_is_a_launch_timeout(ec2: EC2Env) -> None:
    ec2.simulator.boot = lambda inst: inst.get("AmiLaunchIndex") != 1  # node 1 hangs in boot
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(agent_timeout_s=8.0),
                     mlflow=False)(_all_reduce)
    job = fn.job("never")
    with pytest.raises(LaunchTimeout) as info:
        job.run()
    assert info.value.phase == "agent start"
    instances = ec2.instances(job.run_id)
    assert len(instances) == 2 and all(i["State"]["Name"] == "terminated" for i in instances)


def test_an_image_that_cannot_start_the_bootstrap_fails_the_job_in_seconds_not_at_the_timeout(
        ec2: EC2Env, tmp_path: Path) -> None:
    """The image's Python lacks prefect-sgpu: the user-data powers the instance off at once, and the
    driver, seeing it go, fails the job with what it printed instead of waiting for the agent timeout."""
    from prefect_sgpu.errors import ProvisioningError

    python = tmp_path / "python-without-prefect-sgpu"
    python.write_text("#!/bin/sh\necho \"$0: No module named prefect_sgpu\" >&2\nexit 1\n")
    python.chmod(0o755)
    fn = distributed(gpus=2, gpu_type="A10", remote=True, mlflow=False, timeout=900,
                     compute=ec2.compute(python=str(python), agent_timeout_s=600.0))(_hello)
    job = fn.job(1)
    started = time.monotonic()
    with pytest.raises(ProvisioningError, match="went away while booting") as info:
        job.run()
    waited = time.monotonic() - started
    assert waited < 120, f"the job failed after {waited:.0f}s: the agent timeout is 600s"
    assert "console output" in str(info.value)
    for inst in ec2.instances(job.run_id):
        assert "No module named prefect_sgpu" in ec2.simulator.console(inst["InstanceId"])
        assert ec2.simulator.shutdowns(inst["InstanceId"]), "the user-data powered the instance off"
    assert ec2.leftovers(job.run_id) == []


def test_cancel_while_nodes_boot_terminates_them_and_ends_the_run_killed(ec2: EC2Env) -> None:

    from prefect_sgpu.errors import JobCancelled

    ec2.simulator.boot = lambda inst: inst.get("AmiLaunchIndex") != 1  # node 1 hangs in boot
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(agent_timeout_s=600.0))(_all_reduce)
    cancel = threading.Event()
    job = fn.job("cancelled", cancel_event=cancel)
    runner, outcome = run_in_thread(job)
    try:
        deadline = time.monotonic() + 120
        while not ec2.instances(job.run_id) or not any(
                i["State"]["Name"] == "running" for i in ec2.instances(job.run_id)):
            assert time.monotonic() < deadline and runner.is_alive(), "the instances never started"
            time.sleep(0.2)
    finally:
        cancel.set()
        runner.join(timeout=120)
    assert not runner.is_alive(), "cancel is honoured while the driver waits for the node agents"
    assert outcome and isinstance(outcome[0], JobCancelled), outcome
    assert job.tracked is not None and job.tracked.status == "KILLED"
    instances = ec2.instances(job.run_id)
    assert len(instances) == 2 and all(i["State"]["Name"] == "terminated" for i in instances)


_DRIVER = textwrap.dedent(
    """
    import json, sys, time
    from prefect_sgpu import distributed
    from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute
    from support.aws_fixtures import boto3_session

    def wait_forever() -> None:
        print("rank is up", flush=True)
        time.sleep(600)

    settings = json.loads(sys.argv[1])
    compute = EC2InstanceCompute.from_settings(settings, session=boto3_session())
    job = distributed(gpus=2, gpu_type="A10", remote=True, compute=compute)(wait_forever)
    job.distributed()
    """
)


def _kill_a_driver_mid_run(ec2: EC2Env, tmp_path: Path,
                           before_kill: Callable[[str], None] | None = None) -> tuple[str, list[str], float]:
    """A driver process whose 2-node job is running, SIGKILLed: no finally, no release.
    ``before_kill(run_id)`` runs while the driver still keeps its heartbeat fresh.
    Returns its run id, its instances and when it died (monotonic)."""
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    env = {**os.environ, **ec2.aws.env, "PREFECT_SGPU_HOME": str(tmp_path / "home"),
           "MLFLOW_TRACKING_URI": _mlflow_uri(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])}
    settings = {**ec2.settings, "heartbeat_ttl_s": HEARTBEAT_TTL_S}  # the nodes outlive it by this TTL
    driver = subprocess.Popen([sys.executable, str(script), json.dumps(settings)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    s3 = ec2.aws.client("s3")
    run_id = None
    try:
        deadline = time.monotonic() + 240
        while run_id is None and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(1)
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=ec2.bucket, Prefix="jobs/"):
                for obj in page.get("Contents", []):
                    if "/logs/rank-00001.log" in obj["Key"]:  # the log itself, or its appended pieces
                        found = obj["Key"].split("/")[1]
                        if b"rank is up" in (ec2.store().get(found, "logs/rank-00001.log") or b""):
                            run_id = found
        output = driver.stdout.read().decode() if driver.poll() is not None else ""
        assert run_id, f"the job never started: {output}"
        if before_kill is not None:
            before_kill(run_id)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=10)
    died = time.monotonic()
    ids = [i["InstanceId"] for i in ec2.instances(run_id)]
    assert len(ids) == 2
    assert _mlflow_status(tmp_path, run_id) == "RUNNING", "a killed driver cannot end its MLflow run"
    return run_id, ids, died


def _mlflow_uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _mlflow_run(tmp_path: Path, run_id: str) -> Any:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(_mlflow_uri(tmp_path))
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              f"tags.`sgpu.run_id` = '{run_id}'")
    assert len(runs) == 1, runs
    return runs[0]


def _mlflow_status(tmp_path: Path, run_id: str) -> str:
    return str(_mlflow_run(tmp_path, run_id).info.status)


def _hello(x: int) -> int:
    return x + runtime.rank()


def test_killed_driver_nodes_terminate_themselves_and_the_next_job_sweeps_the_rest(
        ec2: EC2Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_id, ids, died = _kill_a_driver_mid_run(ec2, tmp_path)
    deadline = time.monotonic() + HEARTBEAT_TTL_S + 90
    while time.monotonic() < deadline:
        states = {i["State"]["Name"] for i in ec2.instances(run_id)}
        if states == {"terminated"}:
            break
        time.sleep(1)
    assert {i["State"]["Name"] for i in ec2.instances(run_id)} == {"terminated"}, ec2.simulator.describe()
    assert ec2.simulator.wait_powered_off(ids, timeout=20)
    ssm = ec2.aws.client("ssm")
    with pytest.raises(ssm.exceptions.ParameterNotFound):  # node 0 deleted the key on its way out
        ssm.get_parameter(Name=ssm_key_parameter(run_id, ec2.store().scope))
    left = ec2.leftovers(run_id)
    assert any(x.startswith("security group") for x in left) and any("/heartbeat" in x for x in left), \
        f"what a node cannot remove stays until a sweep: {left}"
    # the next job of the same store sweeps it all before it launches (TTL + half the TTL after the kill)
    time.sleep(max(0.0, died + HEARTBEAT_TTL_S * 1.5 + 1 - time.monotonic()))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _mlflow_uri(tmp_path))
    job = distributed(gpus=1, gpu_type="A10", remote=True,
                      compute=ec2.compute(heartbeat_ttl_s=HEARTBEAT_TTL_S))(_hello).job(5)
    assert job.run().values == [5]
    assert ec2.leftovers(run_id) == [] and ec2.leftovers(job.run_id) == []
    swept = _mlflow_run(tmp_path, run_id)
    assert swept.info.status == "KILLED" and "heartbeat" in swept.data.tags["sgpu.swept"]
    assert _mlflow_status(tmp_path, job.run_id) == "FINISHED"


def _gc(ec2: EC2Env, tmp_path: Path, *args: str) -> "subprocess.Popen[str]":
    env = {**os.environ, **ec2.aws.env, "MLFLOW_TRACKING_URI": _mlflow_uri(tmp_path)}
    argv = [sys.executable, "-m", "prefect_sgpu.cli", "gc", "--store", f"s3://{ec2.bucket}/jobs",
            "--region", ec2.aws.region, "--endpoint-url", ec2.aws.endpoint_url, "--json", *args]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _report(proc: "subprocess.Popen[str]") -> dict[str, Any]:
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, f"gc failed ({proc.returncode}): {out}\n{err}"
    return dict(json.loads(out))


def _items(entries: list[dict[str, Any]], run_id: str) -> set[tuple[str, str]]:
    """A report's entries of one run as (kind, name), one per file for a run's store files."""
    items = set()
    for entry in entries:
        if entry["run_id"] != run_id:
            continue
        names = entry["name"].split(", ") if entry["kind"] == "store files" else [entry["name"]]
        items.update((entry["kind"], name) for name in names)
    return items


def test_gc_removes_what_a_killed_driver_left_and_ends_its_mlflow_run_killed(ec2_own_store: EC2Env,
                                                                            tmp_path: Path) -> None:
    ec2 = ec2_own_store

    def early_sweep(run_id: str) -> None:  # the driver's heartbeat is fresh: however loaded the machine
        early = ec2.compute().sweeper(_mlflow_uri(tmp_path)).sweep()
        assert run_id in early.live and not [x for x in early.found if x.run_id == run_id], \
            "a run whose heartbeat is younger than its TTL is left alone"

    run_id, ids, died = _kill_a_driver_mid_run(ec2, tmp_path, before_kill=early_sweep)
    for iid in ids:  # hung VMs: their own TTL never fires, only a sweep removes them
        ec2.simulator.freeze(iid)
    time.sleep(max(0.0, died + HEARTBEAT_TTL_S * 1.5 + 1 - time.monotonic()))
    dry = _report(_gc(ec2, tmp_path, "--dry-run"))
    found = _items(dry["found"], run_id)
    kinds = {kind for kind, _ in found}
    assert {("instance", i) for i in ids} <= found, dry
    assert {"security group", "placement group", "SSM parameter", "store files", "MLflow run"} <= kinds, dry
    assert not dry["removed"] and len(ec2.leftovers(run_id)) >= 5, "a dry run removes nothing"
    both = [_gc(ec2, tmp_path), _gc(ec2, tmp_path)]  # two sweepers at once
    reports = [_report(p) for p in both]
    # each sweeper names what it removed; between them, what the dry run found (the store files of a
    # run can be split: one sweeper lists them after the other has deleted some)
    removed = set().union(*(_items(r["removed"], run_id) for r in reports))
    assert found == removed, reports
    assert ec2.leftovers(run_id) == []
    assert {i["State"]["Name"] for i in ec2.instances(run_id)} == {"terminated"}
    assert ec2.simulator.wait_powered_off(ids, timeout=30)
    swept = _mlflow_run(tmp_path, run_id)
    assert swept.info.status == "KILLED" and "past the TTL" in swept.data.tags["sgpu.swept"]
    # the CLI's sweeps are proven above; the second sweep runs in this process (one CLI start fewer)
    again = ec2.compute().sweeper(_mlflow_uri(tmp_path)).sweep()
    assert not [x for x in again.found if x.run_id == run_id], "a second sweep finds nothing"


def _sleep_after_hello() -> int:
    print(f"rank {runtime.rank()} is up", flush=True)
    time.sleep(300)
    return runtime.rank()


def test_lost_instance_with_max_recoveries_0_fails_the_job_naming_it_and_nothing_is_left(ec2: EC2Env) -> None:
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(), mlflow=False,
                     timeout=300, max_recoveries=0)(_sleep_after_hello)
    job = fn.job()
    outcome: dict[str, BaseException] = {}

    def drive() -> None:
        try:
            job.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    deadline = time.monotonic() + 240
    node1 = None
    while node1 is None and time.monotonic() < deadline and thread.is_alive():
        time.sleep(1)
        logs = ec2.objects(job.run_id) if ec2.instances(job.run_id) else {}
        if b"rank 1 is up" in logs.get(f"jobs/{job.run_id}/logs/rank-00001.log", b""):
            node1 = next(i["InstanceId"] for i in ec2.instances(job.run_id) if i["AmiLaunchIndex"] == 1)
    assert node1, "rank 1 never started"
    ec2.aws.client("ec2").terminate_instances(InstanceIds=[node1])  # e.g. a spot reclaim
    thread.join(timeout=120)
    assert not thread.is_alive()
    error = outcome.get("error")
    assert isinstance(error, InfrastructureLost), repr(error)
    assert error.node == 1 and node1 in str(error) and "terminated" in str(error), str(error)
    assert "max_recoveries=0" in str(error) and error.recoveries == []
    instances = ec2.instances(job.run_id)
    assert len(instances) == 2 and all(i["State"]["Name"] == "terminated" for i in instances)
    assert ec2.leftovers(job.run_id) == []


def _print_for_ever() -> int:
    line = 0
    while True:
        print(f"line {line} " + "x" * 200, flush=True)  # the bootstrap ships new bytes every tick
        line += 1
        time.sleep(0.25)


def test_a_slow_upload_does_not_hold_back_a_nodes_alive_but_a_node_that_stops_beating_is_lost(
        ec2: EC2Env, aws_faults: Any) -> None:
    """Every upload of a rank's log is held by the store's link for more than twice ``node_silence_s``
    (the block's setting): the node keeps announcing itself meanwhile (its alive documents do not wait for
    uploads) and the driver does not count it lost. Then the node freezes, as a hung VM does, and is lost
    within the setting."""
    silence = 4.0
    held = aws_faults.delay(r"/logs/rank-\d+\.log", 2.25 * silence, method="PUT")
    fn = distributed(gpus=1, gpu_type="A10", remote=True, mlflow=False, timeout=300, max_recoveries=0,
                     compute=ec2.compute(node_silence_s=silence))(_print_for_ever)
    job = fn.job()
    thread, outcome = run_in_thread(job)

    def lost() -> bool:  # the driver's own verdict: a NodeLost marks the allocation at once
        allocation = job.allocation
        return allocation is not None and bool(allocation.lost or allocation.reported)

    deadline = time.monotonic() + 240
    while held.done < 2 and thread.is_alive() and not lost() and time.monotonic() < deadline:
        time.sleep(0.2)
    if lost():
        thread.join(timeout=120)  # the driver ends the job (and its instance) before the test fails
    assert not lost(), "the node was taken for lost while it uploaded"
    assert held.done >= 2, f"two uploads of a rank's log were not held to their end: {outcome or 'still running'}"
    assert thread.is_alive(), repr(outcome)
    (iid,) = [i["InstanceId"] for i in ec2.instances(job.run_id, live=True)]
    ec2.simulator.freeze(iid)
    frozen = time.monotonic()
    while not lost() and time.monotonic() - frozen < 60:
        time.sleep(0.2)
    assert lost() and time.monotonic() - frozen < silence + 15, "the frozen node was not counted lost in time"
    thread.join(timeout=120)
    assert not thread.is_alive()
    error = outcome[0] if outcome else None
    assert isinstance(error, InfrastructureLost), repr(error)
    assert f"has not reported for {silence:g}s" in str(error) and iid in str(error), str(error)
    assert ec2.leftovers(job.run_id) == []


def test_bootstrap_reads_its_identity_from_imdsv2(monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib.error
    import urllib.request

    from support.ec2_simulator import FakeIMDS
    from prefect_sgpu.compute.ec2.request import render_user_data
    from prefect_sgpu.launch.ec2_host import IMDS_ENV, fetch_identity

    imds = FakeIMDS({"instance-id": "i-0123456789abcdef0", "ami-launch-index": "3", "local-ipv4": "10.1.2.3"})
    try:
        with pytest.raises(urllib.error.HTTPError, match="401"):  # IMDSv1 (no token) is refused
            urllib.request.urlopen(imds.url + "latest/meta-data/instance-id", timeout=5)
        monkeypatch.setenv(IMDS_ENV, imds.url)
        identity = fetch_identity(attempts=2)
    finally:
        imds.close()
    assert identity.instance_id == "i-0123456789abcdef0"
    assert (identity.launch_index, identity.private_ip) == (3, "10.1.2.3")
    script = render_user_data("s3://bucket/jobs", "run-1", "eu-west-1", 900, endpoint_url=None)
    assert script.startswith("#!/bin/bash\n") and "--store=s3://bucket/jobs" in script
    assert "--endpoint-url" not in script and "AWS_" not in script


def test_block_builds_the_compute_and_checks_its_store(aws_env: MotoAWS) -> None:
    from prefect_sgpu.blocks import EC2Compute as EC2ComputeBlock
    from prefect_sgpu.errors import SGPUConfigError

    block = EC2ComputeBlock(store_uri="s3://team-bucket/sgpu", subnet_ids=["subnet-0123456789abcdef0"],
                            instance_profile="sgpu-node", ttl_minutes=5, endpoint_url=aws_env.endpoint_url)
    compute = block.get_compute()
    assert isinstance(compute, EC2InstanceCompute)
    assert compute.default_store().root_uri == "s3://team-bucket/sgpu"
    assert compute.heartbeat_ttl_s == 300
    assert "--heartbeat-ttl=300" in compute.user_data("run-1")
    with pytest.raises(SGPUConfigError, match="store_uri"):
        EC2ComputeBlock(store_uri="", subnet_ids=["subnet-0123456789abcdef0"]).get_compute()
    with pytest.raises(SGPUConfigError, match="subnet_ids"):
        EC2InstanceCompute.from_settings({"store_uri": "s3://b/p", "subnet_ids": ["not-a-subnet"]})
    with pytest.raises(SGPUConfigError, match="volume_size"):  # a misspelt setting is not ignored
        EC2InstanceCompute.from_settings({"store_uri": "s3://b/p", "volume_size": 100})


def _moto_instance(aws: MotoAWS, run_id: str) -> str:
    response = aws.client("ec2").run_instances(
        ImageId=aws.image_id(), InstanceType="g5.xlarge", MinCount=1, MaxCount=1,
        TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": RUN_ID_TAG, "Value": run_id}]}],
    )
    return response["Instances"][0]["InstanceId"]


def test_crashed_bootstrap_reports_and_powers_off(aws_env: MotoAWS, tmp_path: Path) -> None:
    from prefect_sgpu.launch.bootstrap import NodeBootstrap, NodeIdentity

    bucket = f"sgpu-crash-{uuid.uuid4().hex[:12]}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    store = S3Store(f"s3://{bucket}/jobs", endpoint_url=aws_env.endpoint_url)
    iid = _moto_instance(aws_env, "crash-run")
    key = new_key()
    node = NodeBootstrap(store, "crash-run", NodeIdentity(iid, 0, "10.0.0.5"), tmp_path, heartbeat_ttl=60,
                         region=aws_env.region, endpoint_url=aws_env.endpoint_url, key=key)
    node.crashed(RuntimeError("disk full"))
    status = JobFolder(store, "crash-run", key).status(0, instance_id=iid)
    assert status is not None and status.exit_code == 2 and "disk full" in (status.error or "")
    found = aws_env.client("ec2").describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"]
    assert found[0]["State"]["Name"] in ("shutting-down", "terminated")


def test_node_that_stops_reporting_fails_the_job(aws_env: MotoAWS, aws_network: Network) -> None:
    from prefect_sgpu.compute.base import AllocatedNode, NodeLost
    from prefect_sgpu.compute.ec2.compute import EC2Allocation
    from prefect_sgpu.compute.ec2.instances import Instance
    from prefect_sgpu.spec import JobSpec

    bucket = f"sgpu-silent-{uuid.uuid4().hex[:12]}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    compute = EC2InstanceCompute.from_settings(
        {"store_uri": f"s3://{bucket}/jobs", "endpoint_url": aws_env.endpoint_url,
         "subnet_ids": aws_network.subnet_ids, "poll_interval_s": 0.05, "node_silence_s": 0.5},
        session=aws_env.session())
    request = compute.plan(JobSpec(gpus=1, gpu_type="A10", remote=True), "silent-run")
    iid = _moto_instance(aws_env, "silent-run")
    try:
        folder = JobFolder(compute.store, "silent-run", new_key())
        allocation = EC2Allocation(
            request=request, folder=folder, nodes=[AllocatedNode(0, "10.0.0.5", iid, iid)],
            instances=[Instance(iid, "10.0.0.5", "", "", 0, "g5.xlarge", "on-demand")], launched=True)
        folder.put_alive(0, Alive(phase="running", seq=7, time=time.time()), instance_id=iid)  # then nothing more
        deadline = time.monotonic() + 30
        lost: list[NodeLost] = []
        while not lost and time.monotonic() < deadline:
            lost = [e for e in compute.poll(allocation) if isinstance(e, NodeLost)]
            time.sleep(0.05)
        assert lost and lost[0].node == 0 and "has not reported" in lost[0].reason
    finally:
        aws_env.client("ec2").terminate_instances(InstanceIds=[iid])


def _poll_calls(compute: EC2InstanceCompute, nodes: int, run_id: str, aws_env: MotoAWS) -> tuple[int, list[Any]]:
    """API calls of one full poll pass over ``nodes`` nodes whose alive documents all changed."""
    from prefect_sgpu.compute.base import AllocatedNode
    from prefect_sgpu.compute.ec2.compute import EC2Allocation
    from prefect_sgpu.compute.ec2.instances import Instance
    from prefect_sgpu.protocol.jobfolder import Notice
    from prefect_sgpu.spec import JobSpec

    request = compute.plan(JobSpec(gpus=1, gpu_type="A10", remote=True), run_id)
    ids = [_moto_instance(aws_env, run_id) for _ in range(nodes)]
    folder = JobFolder(compute.store, run_id, new_key())
    allocation = EC2Allocation(
        request=request, folder=folder, nodes=[AllocatedNode(i, "10.0.0.5", iid, iid) for i, iid in enumerate(ids)],
        instances=[Instance(iid, "10.0.0.5", "", "", 0, "g5.xlarge", "on-demand") for iid in ids], launched=True)
    calls: list[str] = []

    def count(event_name: str, **_: Any) -> None:
        calls.append(event_name)

    clients = [compute.store.client, compute._client("ec2")]
    for client in clients:
        client.meta.events.register("before-call", count)
    try:
        events: list[Any] = []
        for seq in (1, 2):
            for i, iid in enumerate(ids):
                folder.put_alive(i, Alive(phase="running", seq=seq, time=time.time()), instance_id=iid)
            if seq == 2:
                folder.put_notice(nodes - 1, Notice(text="spot/instance-action: terminate", time=time.time()),
                                  instance_id=ids[-1])
            allocation.polled = allocation.states_checked = 0.0
            calls.clear()
            events += compute.poll(allocation)
        return len(calls), events
    finally:
        for client in clients:
            client.meta.events.unregister("before-call", count)
        aws_env.client("ec2").terminate_instances(InstanceIds=ids)


def test_a_poll_pass_costs_the_same_calls_for_one_node_or_many(aws_env: MotoAWS, aws_network: Network) -> None:
    """Statuses, notices and liveness come from one listing of the node documents (their versions):
    a pass reads a document only when it appears, so its cost does not grow with the node count."""
    from prefect_sgpu.compute.base import NodeLost, NodeNotice

    bucket = f"sgpu-polls-{uuid.uuid4().hex[:12]}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    compute = EC2InstanceCompute.from_settings(
        {"store_uri": f"s3://{bucket}/jobs", "endpoint_url": aws_env.endpoint_url,
         "subnet_ids": aws_network.subnet_ids, "poll_interval_s": 0.05, "node_silence_s": 60},
        session=aws_env.session())
    one, events_one = _poll_calls(compute, 1, "polls-one", aws_env)
    many, events_many = _poll_calls(compute, 6, "polls-many", aws_env)
    # the second pass: one listing, one DescribeInstances page, one read of the notice that appeared
    assert one == many == 3, (one, many)
    assert not [e for e in events_one + events_many if isinstance(e, NodeLost)], "every alive changed"
    assert [(type(e), e.node) for e in events_many if isinstance(e, NodeNotice)] == [(NodeNotice, 5)]
    assert "spot/instance-action" in next(e for e in events_many if isinstance(e, NodeNotice)).notice


def test_bootstrap_rides_out_store_errors_until_the_ttl(aws_env: MotoAWS, aws_faults: Any,
                                                        tmp_path: Path) -> None:
    from prefect_sgpu import aws
    from prefect_sgpu.launch.bootstrap import NodeBootstrap, NodeIdentity

    bucket = f"sgpu-flaky-{uuid.uuid4().hex[:12]}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    client = aws.client("s3", endpoint_url=aws_env.endpoint_url, max_attempts=1)
    store = S3Store(f"s3://{bucket}/jobs", client=client)
    key = new_key()
    JobFolder(store, "run", key).beat()
    ttl = 6.0
    node = NodeBootstrap(store, "run", NodeIdentity("i-0123456789abcdef0", 0, "10.0.0.5"), tmp_path,
                         heartbeat_ttl=ttl, interval=0.1, key=key)
    seen = time.monotonic()
    assert node.heartbeat_stale() is False
    aws_faults.fail("", "InternalError", status=500)  # every S3 call fails from now on
    stale = node.heartbeat_stale()
    if time.monotonic() - seen < ttl:
        assert stale is False, "an unreadable heartbeat is no news, not a dead driver"
    assert node.stop_requested() is False
    node.sync_quietly()  # logs, envelopes: retried next tick, no exception
    time.sleep(max(0.0, seen + ttl + 0.3 - time.monotonic()))
    assert node.heartbeat_stale() is True, "unreachable for a whole TTL: the driver counts as gone"


# -- security and limits of the new contract -----------------------------------------------------


def _forger(store: S3Store, run_id: str, marker: Path, stop: threading.Event, node1: dict[str, str]) -> None:
    """Someone with write access to the store, but not the job key, tries to run code on node 0."""
    touch = ["/bin/sh", "-c", f"touch {marker}"]
    unsigned = json.dumps({"argv": touch, "env": {}, "instance_id": None, "node": 0}).encode()
    wrong_key = JobFolder(store, run_id, new_key())
    variants: list[Any] = [
        lambda: store.put(run_id, LAUNCH_KEY, launch_bundle({0: unsigned})),
        lambda: store.put(run_id, LAUNCH_KEY, unsigned),  # not even a bundle
        lambda: wrong_key.put_launches({0: (LaunchDocument(argv=touch), node1.get("node0", "i-0"))}),
    ]
    if node1.get("blob"):  # a real sealed document of another node, as node 0's entry
        variants.append(lambda: store.put(run_id, LAUNCH_KEY, launch_bundle({0: node1["blob"].encode("latin-1")})))
    forged_alive = json.dumps({"instance_id": "i-forged", "private_ip": "10.66.66.66", "node": 0, "seq": 99,
                               "phase": "waiting", "time": time.time()}).encode()
    n = 0
    while not stop.is_set():
        variants[n % len(variants)]()
        store.put(run_id, "nodes/node-0.alive", forged_alive)
        n += 1
        stop.wait(0.4)


def test_store_writers_cannot_run_code_on_nodes_or_move_the_rendezvous(ec2: EC2Env, tmp_path: Path) -> None:
    """Forged launch and alive documents (unsigned, wrong key, another node's, no instance) are refused."""
    marker = tmp_path / "forged-launch-ran"
    compute = ec2.compute(heartbeat_ttl_s=None, ttl_minutes=2)
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=compute, mlflow=False, timeout=300)(_all_reduce)
    job = fn.job("forged")
    _request, _body, key = job.prepare()
    store = ec2.store()
    # a real sealed launch document of node 1 (the job key), and one of node 0 bound to no instance
    folder = JobFolder(store, job.run_id, key)
    touch = LaunchDocument(argv=["/bin/sh", "-c", f"touch {marker}"])
    node1 = {"blob": folder.seal_launch(1, touch, instance_id="i-0000000000000001").decode("latin-1")}
    unbound = launch_bundle({0: folder.seal_launch(0, touch)})  # no instance id bound

    booting = threading.Event()
    ec2.simulator.boot = lambda inst: inst.get("AmiLaunchIndex") != 1 or booting.is_set()  # node 1 late
    stop = threading.Event()
    forger = threading.Thread(target=_forger, args=(store, job.run_id, marker, stop, node1), daemon=True)
    seen: dict[str, LaunchDocument] = {}
    finished = threading.Event()

    def watch_launch() -> None:
        while "doc" not in seen and not finished.is_set():
            allocation = job.allocation
            if allocation is not None and allocation.nodes:
                try:
                    doc = JobFolder(store, job.run_id, key).launch(0, instance_id=allocation.nodes[0].instance_id)
                except DocumentRefused:
                    doc = None
                if doc is not None:
                    seen["doc"] = doc
                    return
            time.sleep(0.1)

    outcome: list[Any] = []
    runner = threading.Thread(target=lambda: outcome.append(_run_catching(job)), daemon=True)
    watcher = threading.Thread(target=watch_launch, daemon=True)
    forger.start()
    runner.start()
    watcher.start()
    try:
        deadline = time.monotonic() + 120
        while not any(n.launch_index == 0 for n in ec2.simulator.nodes.values()):
            assert time.monotonic() < deadline, "node 0 never booted"
            time.sleep(0.2)
        # node 0 reads (and must refuse) every forged variant: waited for, however slow the machine
        (node0_id,) = [iid for iid, n in list(ec2.simulator.nodes.items()) if n.launch_index == 0]
        refusals = ("not a signed prefect-sgpu document", "not a launch bundle", "signature does not match",
                    "bound to")
        while not all(r in ec2.simulator.console(node0_id) for r in refusals):
            assert time.monotonic() < deadline + 120, "node 0 never read every forged variant: " + \
                ec2.simulator.console(node0_id)
            time.sleep(0.2)
        store.put(job.run_id, LAUNCH_KEY, unbound)
        time.sleep(2.5)
    finally:
        stop.set()
        forger.join(timeout=10)
        booting.set()
        ec2.simulator.skipped.clear()
    runner.join(timeout=300)
    finished.set()
    watcher.join(timeout=5)
    assert outcome and not isinstance(outcome[0], BaseException), outcome
    result = outcome[0]
    assert [v["sum"] for v in result.values] == [1.0, 1.0] and [v["rank"] for v in result.values] == [0, 1]
    assert not marker.exists(), "a forged launch document ran on a node"
    node0 = next(i for i in ec2.instances(job.run_id) if i["AmiLaunchIndex"] == 0)
    console = ec2.simulator.console(node0["InstanceId"])
    assert "not a signed prefect-sgpu document" in console and "not a launch bundle" in console, console
    assert "signature does not match" in console and "bound to" in console, console
    # the rendezvous is node 0's address from DescribeInstances, not the forged alive document's
    assert job.allocation.nodes[0].address == node0["PrivateIpAddress"]
    doc = seen.get("doc")
    assert doc is not None, "the driver's own launch document of node 0 was seen"
    assert f"--rdzv-endpoint={node0['PrivateIpAddress']}:{ec2.settings['rendezvous_port']}" in doc.argv
    assert "10.66.66.66" not in " ".join(doc.argv)
    # one TTL: the node agent's heartbeat TTL is the block's ttl_minutes * 60, as the bootstrap's
    assert "--heartbeat-ttl=120" in doc.argv
    assert "--heartbeat-ttl=120" in ec2.simulator.nodes[node0["InstanceId"]].user_data
    assert "SGPU_PAYLOAD_KEY" not in doc.env


def _run_catching(job: Any) -> Any:
    try:
        return job.run()
    except BaseException as exc:  # noqa: BLE001 - handed to the test thread
        return exc


def test_job_timeout_bounds_acquire(ec2: EC2Env) -> None:
    """A node that never boots: the job's timeout (15 s) ends acquire, not agent_timeout_s (900 s)."""
    ec2.simulator.boot = lambda inst: inst.get("AmiLaunchIndex") != 1
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(agent_timeout_s=900.0),
                     mlflow=False, timeout=15)(_all_reduce)
    job = fn.job("bounded")
    started = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        job.run()
    assert time.monotonic() - started < 450, "acquire waited for agent_timeout_s, not the job's timeout"
    assert info.value.phase in ("agent start", "provisioning") and info.value.timeout == 15
    assert ec2.leftovers(job.run_id) == []


@pytest.mark.parametrize("other", ["bucket", "local"])
def test_a_store_the_nodes_cannot_reach_is_refused_before_anything_is_spent(
        ec2: EC2Env, other: str, tmp_path: Path) -> None:
    from prefect_sgpu.store import LocalStore

    if other == "bucket":
        bucket = f"sgpu-other-{uuid.uuid4().hex[:12]}"
        ec2.aws.client("s3").create_bucket(Bucket=bucket)
        store: Any = S3Store(f"s3://{bucket}/jobs", session=ec2.aws.session(), endpoint_url=ec2.aws.endpoint_url)
    else:
        store = LocalStore(tmp_path / "jobs")
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(), store=store,
                     mlflow=False)(_all_reduce)
    with pytest.raises(SGPUConfigError, match="store"):
        fn.run("never")
    with pytest.raises(SGPUConfigError, match="store"):
        fn.job("never")
    assert ec2.sent_run_instances() == [], "no RunInstances was sent"
    assert ec2.instances("") == [] or not ec2.aws.live_instances()


def _log_to_mlflow() -> tuple[str, str]:
    import mlflow

    run = mlflow.start_run()  # the driver's run, from MLFLOW_RUN_ID
    for step in range(3):
        mlflow.log_metric(f"loss_rank{runtime.rank()}", 1.0 / (step + 1), step=step)
    mlflow.log_param(f"seen_by_rank{runtime.rank()}", "yes")
    mlflow.set_tag(f"rank{runtime.rank()}.host", runtime.node_rank())
    return run.info.run_id, mlflow.get_tracking_uri()


def test_metrics_of_ec2_ranks_reach_the_drivers_sqlite_run(ec2: EC2Env, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The tracking store is a sqlite file on the driver's disk: ranks relay through the job store."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    job = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(), timeout=300)(_log_to_mlflow).job()
    result = job.run()
    assert [v[0] for v in result.values] == [result.mlflow_run_id] * 2, "every rank logged into the job's run"
    # the simulated nodes share this disk: make sure they did not write the file directly
    assert [v[1] for v in result.values] == ["sgpu-relay:"] * 2
    client = MlflowClient(uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    for rank in (0, 1):
        history = client.get_metric_history(result.mlflow_run_id, f"loss_rank{rank}")
        assert [(m.step, m.value) for m in history] == [(0, 1.0), (1, 0.5), (2, 1 / 3)], rank
        assert run.data.params[f"seen_by_rank{rank}"] == "yes"
        assert run.data.tags[f"rank{rank}.host"] == str(rank)
    assert ec2.leftovers(job.run_id) == []


def _sum_after_a_while(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    runtime.init_process_group()
    print(f"rank {runtime.rank()} is up", flush=True)
    time.sleep(seconds)  # the store goes down and comes back meanwhile
    t = torch.tensor([float(runtime.rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def test_the_driver_rides_out_a_store_outage_shorter_than_the_nodes_ttl(ec2: EC2Env, aws_faults: Any) -> None:
    """Every S3 call answers 500 for 12 s mid-job (longer than the driver store's 2 tries, shorter than
    the nodes' 30 s TTL): driver and nodes wait it out and the job returns the right values."""
    from prefect_sgpu import aws

    # the driver's store gives up after 2 tries (botocore's own retries would absorb a short outage)
    store = S3Store(f"s3://{ec2.bucket}/jobs", client=aws.client("s3", endpoint_url=ec2.aws.endpoint_url,
                                                                 max_attempts=2))
    fn = distributed(gpus=2, gpu_type="A10", remote=True, mlflow=False, timeout=600, store=store,
                     compute=ec2.compute(heartbeat_ttl_s=30.0))(_sum_after_a_while)
    job = fn.job(30.0)
    outcome: dict[str, Any] = {}

    def drive() -> None:
        try:
            outcome["values"] = job.run().values
        except BaseException as exc:  # noqa: BLE001 - shown by the assertions below
            outcome["error"] = exc

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and thread.is_alive():
        logs = ec2.objects(job.run_id) if ec2.instances(job.run_id) else {}
        if all(f"rank {r} is up".encode() in logs.get(f"jobs/{job.run_id}/logs/rank-0000{r}.log", b"")
               for r in (0, 1)):
            break
        time.sleep(0.5)
    assert thread.is_alive(), f"the job ended before the outage: {outcome}"
    rule = aws_faults.fail("", "InternalError", status=500)  # S3 (REST) calls only; EC2 keeps answering
    time.sleep(12.0)
    assert thread.is_alive(), f"the job did not ride out the outage: {outcome}"
    with aws_faults._lock:
        aws_faults.rules.remove(rule)
    failed = [c for c in aws_faults.calls("") if c.error == "InternalError"]
    thread.join(timeout=300)
    assert not thread.is_alive()
    assert failed, "the outage reached the store's clients"
    assert outcome.get("values") == [3.0, 3.0], outcome
    assert ec2.leftovers(job.run_id) == []


@pytest.mark.parametrize(("setup", "why"), [("exit 1", "setup failed"), ("sleep 3600", "setup hung")])
def test_a_node_whose_bootstrap_never_takes_over_powers_itself_off(ec2: EC2Env, setup: str, why: str) -> None:
    """No driver watches this launch (as if it was killed right after RunInstances): the user-data's
    own backstop shuts the machine down, which terminates the instance."""
    from prefect_sgpu.spec import JobSpec

    compute = ec2.compute(setup_commands=setup, heartbeat_ttl_s=10.0, agent_timeout_s=10.0)
    run_id = f"backstop-{uuid.uuid4().hex[:8]}"
    request = compute.plan(JobSpec(gpus=1, gpu_type="A10", remote=True), run_id)
    try:
        instances = compute.provisioner.provision(run_id, request.plan, request.user_data,
                                                  attempts=request.run_instances)
        (iid,) = [i.id for i in instances]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and ec2.instances(run_id, live=True):
            time.sleep(1)
        assert not ec2.instances(run_id, live=True), f"{why}: the instance was not terminated\n" + \
            ec2.simulator.console(iid)
        assert "-h now" in ec2.simulator.shutdowns(iid), f"{why}: terminated by its own shutdown"
        assert ec2.leftovers(run_id), "its groups and key stay: the node cannot remove them"
        report = compute.sweeper().sweep()  # no job folder: the job has ended, all of it goes
        assert "security group" in {x.kind for x in report.removed if x.run_id == run_id}, report
        assert ec2.leftovers(run_id) == []
    finally:
        compute.provisioner.terminate(run_id)  # a failed assertion above must not leak the instance


def _write_a_checkpoint_file() -> int:
    from prefect_sgpu.checkpoints import Location, step_dir_name

    location = Location(runtime.checkpoint_uri())
    step = location.local / step_dir_name(1)
    step.mkdir(parents=True, exist_ok=True)
    (step / f"rank-{runtime.rank()}.bin").write_bytes(b"weights")
    location.upload(step_dir_name(1))
    print(f"rank {runtime.rank()} wrote its checkpoint file", flush=True)
    return runtime.rank()


def test_every_store_object_is_kms_encrypted_and_every_s3_call_names_the_bucket_owner(ec2: EC2Env) -> None:
    """Driver, bootstraps and ranks all write the store with SSE-KMS under the block's key and an S3
    Bucket Key, and every S3 request of the job carries ExpectedBucketOwner."""
    assert ec2.proxy is not None
    kms = ec2.aws.client("kms").create_key(Description="sgpu store")["KeyMetadata"]["KeyId"]
    owner = ec2.aws.client("sts").get_caller_identity()["Account"]
    compute = ec2.compute(kms_key_id=kms, bucket_owner=owner)
    before = len(ec2.proxy.requests)
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=compute, mlflow=False, timeout=300)
    job = fn(_write_a_checkpoint_file).job()
    assert job.run().values == [0, 1]
    rest = [r for r in ec2.proxy.requests[before:] if r.service == "rest"]  # S3: REST calls
    s3 = ec2.aws.client("s3")
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=ec2.bucket, Prefix=f"jobs/{job.run_id}/"):
        keys += [o["Key"] for o in page.get("Contents", [])]
    written_by = {"driver/nodes": [k for k in keys if "/logs/" in k],
                  "ranks": [k for k in keys if "/checkpoints/" in k]}
    assert all(written_by.values()), keys
    for key in keys:
        head = s3.head_object(Bucket=ec2.bucket, Key=key)
        assert (head.get("ServerSideEncryption"), kms in head.get("SSEKMSKeyId", "")) == ("aws:kms", True), key
    asked = ec2.proxy.s3_kms_writes()  # each SSE-KMS write of driver, bootstraps and ranks: with a Bucket Key
    assert asked and [path for path, bucket_key in asked if not bucket_key] == [], asked
    assert rest and all(r.params.get("x-amz-expected-bucket-owner") == owner for r in rest), \
        {tuple(sorted(r.params)) for r in rest if r.params.get("x-amz-expected-bucket-owner") != owner}
    with pytest.raises(SGPUConfigError, match="bucket_owner"):
        ec2.compute(bucket_owner="not-an-account")


@pytest.mark.usefixtures("prefect_server")
def test_secrets_reach_ec2_ranks_through_ssm_and_no_document_or_object_holds_them(ec2: EC2Env) -> None:
    from prefect.blocks.system import Secret

    from prefect_sgpu.protocol.jobfolder import ssm_secrets_parameter

    value = f"tok-{uuid.uuid4().hex}"
    Secret(value=value).save("sgpu-ec2-token", overwrite=True)
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(), mlflow=False, timeout=300,
                     secrets={"MY_TOKEN": "sgpu-ec2-token"})(token_digest)
    job = fn.job()
    seen: dict[str, bytes] = {}

    def watch() -> None:  # every object of the job while it runs: launch documents included
        while not done.is_set():
            seen.update(ec2.objects(job.run_id))
            time.sleep(0.5)

    done = threading.Event()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        assert job.run().values == [digest_of(value)] * 2
    finally:
        done.set()
        watcher.join(timeout=30)
    assert any(k.endswith(LAUNCH_KEY) for k in seen), "the launch documents were seen"
    assert not [k for k, body in {**seen, **ec2.objects(job.run_id)}.items() if value.encode() in body]
    ssm = ec2.aws.client("ssm")
    with pytest.raises(ssm.exceptions.ParameterNotFound):
        ssm.get_parameter(Name=ssm_secrets_parameter(job.run_id, ec2.store().scope))
    assert ec2.leftovers(job.run_id) == []


@pytest.mark.usefixtures("prefect_server")
def test_planted_secrets_appear_in_no_log_user_data_tag_artifact_mlflow_record_or_store_object(
        ec2: EC2Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """A GPU task on EC2 whose driver holds AWS keys and a Prefect API key and whose ranks get a
    user secret: none of the three is anywhere the job wrote, during the run or after it."""
    import base64
    import hashlib

    import boto3
    from mlflow.tracking import MlflowClient
    from prefect import flow
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from prefect_sgpu import GPUTaskRunner, gpu_task

    aws_id, aws_secret = "AKIA" + uuid.uuid4().hex[:16].upper(), uuid.uuid4().hex + uuid.uuid4().hex[:8]
    prefect_key = "pnu_" + uuid.uuid4().hex + "abcd"
    user_secret = f"user-{uuid.uuid4().hex}"
    planted = {"AWS access key id": aws_id, "AWS secret key": aws_secret, "Prefect API key": prefect_key,
               "user secret": user_secret}
    monkeypatch.setenv("PREFECT_API_KEY", prefect_key)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    Secret(value=user_secret).save("sgpu-planted", overwrite=True)
    session = boto3.Session(aws_access_key_id=aws_id, aws_secret_access_key=aws_secret, region_name=ec2.aws.region)
    compute = EC2InstanceCompute.from_settings(ec2.settings, session=session)

    @gpu_task(gpus=2, gpu_type="A10", remote=True, secrets={"MY_TOKEN": "sgpu-planted"}, timeout=300)
    def train() -> str:
        print(f"rank {runtime.rank()} trains", flush=True)  # EC2 nodes import no test helper: inline
        return hashlib.sha256(os.environ["MY_TOKEN"].encode()).hexdigest()

    @flow(task_runner=GPUTaskRunner(compute=compute))
    def pipeline() -> str:
        return train()

    seen: dict[str, bytes] = {}
    done = threading.Event()

    s3 = ec2.aws.client("s3")

    def scan(shipped_per_pass: int | None) -> None:
        keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=ec2.bucket)
                for o in page.get("Contents", [])]
        # the job's own objects on every pass; the shipped environment (content-addressed, hundreds
        # of files) once, a few per pass, so that no pass outlasts the job's short-lived objects
        shipped = [k for k in keys if "/.environments/" in f"/{k}"]
        for key in [k for k in keys if k not in shipped] + [k for k in shipped if k not in seen][:shipped_per_pass]:
            try:
                seen[key] = s3.get_object(Bucket=ec2.bucket, Key=key)["Body"].read()
            except s3.exceptions.NoSuchKey:  # deleted between the listing and the read
                continue

    def watch() -> None:
        while not done.is_set():
            scan(25)
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        state = pipeline(return_state=True)
    finally:
        done.set()
        watcher.join(timeout=30)
    scan(None)  # what stays: the shipped environment, every file of it
    assert state.is_completed(), state
    assert state.result() == digest_of(user_secret)
    places: dict[str, str] = {f"s3://{ec2.bucket}/{k}": b.decode("utf-8", "replace") for k, b in seen.items()}
    assert any(k.endswith(LAUNCH_KEY) for k in places) and any("/logs/" in k for k in places), sorted(places)
    ec2_client = ec2.aws.client("ec2")
    for page in ec2_client.get_paginator("describe_instances").paginate(
            Filters=[{"Name": "tag-key", "Values": [RUN_ID_TAG]}]):
        for reservation in page["Reservations"]:
            for inst in reservation["Instances"]:
                if any(t["Key"] == "sgpu:store" and ec2.bucket in t["Value"] for t in inst.get("Tags", [])):
                    data = ec2_client.describe_instance_attribute(InstanceId=inst["InstanceId"],
                                                                  Attribute="userData")["UserData"]
                    places[f"user-data {inst['InstanceId']}"] = base64.b64decode(data.get("Value", "")).decode()
                    places[f"tags {inst['InstanceId']}"] = json.dumps(inst.get("Tags", []))
    assert any(k.startswith("user-data") for k in places)
    client = MlflowClient(uri)
    for run in client.search_runs([e.experiment_id for e in client.search_experiments()]):
        places[f"mlflow run {run.info.run_id}"] = json.dumps([run.data.params, run.data.tags])
    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
        logs = prefect.read_logs()
    assert artifacts, "the GPU task published its artifact"
    places.update({f"artifact {a.key or a.id}": json.dumps(a.data, default=str) for a in artifacts})
    places["prefect logs"] = "\n".join(log.message for log in logs)
    out, err = capfd.readouterr()
    places["driver output"] = out + err
    found = [(what, where) for where, text in places.items() for what, value in planted.items() if value in text]
    assert found == [], found


def _wait_for_go(go: str) -> int:
    deadline = time.monotonic() + 240
    while not Path(go).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return 7


def _reach_into_another_job(other_run: str, other_instance: str, bucket: str, prefix: str) -> dict[str, Any]:
    """From a rank, with the node's own (instance profile) credentials: the other job's key, launch
    document and node, then this job's own folder."""
    import boto3

    where = {"endpoint_url": os.environ["SGPU_STORE_ENDPOINT_URL"], "region_name": os.environ["SGPU_STORE_REGION"]}
    result = _all_reduce("probe")
    if runtime.rank() != 0:
        return result

    def code_of(call: Any) -> str:  # support/ is not on a node's import path: the probe travels with this module
        try:
            call()
            return "allowed"
        except Exception as exc:  # noqa: BLE001 - the error code is the answer
            return getattr(exc, "response", {}).get("Error", {}).get("Code", type(exc).__name__)

    ssm, s3, ec2 = (boto3.client(s, **where) for s in ("ssm", "s3", "ec2"))
    result["key"] = code_of(lambda: ssm.get_parameter(Name=ssm_key_parameter(other_run, store_scope(f"s3://{bucket}/{prefix}")),
                                                             WithDecryption=True))
    result["launch"] = code_of(lambda: s3.put_object(Bucket=bucket, Key=f"{prefix}/{other_run}/{LAUNCH_KEY}",
                                                     Body=b"forged"))
    result["terminate"] = code_of(lambda: ec2.terminate_instances(InstanceIds=[other_instance]))
    result["own"] = code_of(lambda: s3.put_object(Bucket=bucket, Key=f"{prefix}/{runtime.run_id()}/probe.txt",
                                                  Body=b"mine"))
    return result


def test_with_job_roles_a_rank_cannot_read_forge_or_stop_another_job(ec2: EC2Env, tmp_path: Path) -> None:
    """Done-when 1 of the security issue: jobs A and B at once, each with its own role, the driver
    under the shipped driver policy and the roles under the shipped boundary, every call judged per
    resource (support.iam_gate). A rank of A gets AccessDenied on B's key, B's launch document and
    B's node; both jobs return the right values; both roles are gone afterwards."""
    from prefect_sgpu.compute.ec2 import roles

    assert ec2.proxy is not None
    iam = ec2.aws.client("iam")
    driver, gate, boundary = ec2.gated_driver()
    gate.kms_via_ssm = True  # a node's read of its key needs kms:Decrypt through SSM (no store key here)
    user = next(iter(gate.users))
    settings = {**ec2.settings, "instance_profile": None, "job_roles": True, "node_permissions_boundary": boundary}
    compute = EC2InstanceCompute.from_settings(settings, session=driver)
    go = tmp_path / "go"
    try:
        job_b = distributed(gpus=1, gpu_type="A10", remote=True, compute=compute, mlflow=False,
                            timeout=300)(_wait_for_go).job(str(go))
        outcome_b: list[Any] = []
        thread_b = threading.Thread(target=lambda: outcome_b.append(_run_catching(job_b)), name="job-b")
        thread_b.start()
        deadline = time.monotonic() + 120
        while not ec2.instances(job_b.run_id, live=True) and time.monotonic() < deadline and thread_b.is_alive():
            time.sleep(0.5)
        (b_instance,) = [i["InstanceId"] for i in ec2.instances(job_b.run_id, live=True)]
        try:
            # its own rendezvous port: simulated nodes share this host, where c10d binds every address
            compute_a = EC2InstanceCompute.from_settings({**settings, "rendezvous_port": free_port()}, session=driver)
            result_a = distributed(gpus=2, gpu_type="A10", remote=True, compute=compute_a, mlflow=False,
                                   timeout=300)(_reach_into_another_job).job(
                job_b.run_id, b_instance, ec2.bucket, "jobs").run()
        finally:
            go.write_text("go")
            thread_b.join(timeout=180)
    finally:
        ec2.proxy.iam_gate = None
    (result_b,) = outcome_b
    assert not isinstance(result_b, BaseException), result_b
    assert result_b.values == [7]
    probe = result_a.values[0]
    assert (probe["key"], probe["launch"], probe["terminate"]) == (
        "AccessDeniedException", "AccessDenied", "UnauthorizedOperation"), probe
    assert probe["own"] == "allowed", probe
    assert [v["sum"] for v in result_a.values] == [1.0, 1.0] and [v["world"] for v in result_a.values] == [2, 2]
    # the only refusals were the three reaches; the driver policy and the job roles allowed everything else
    refused = {(d.identity, d.action, d.resource.split(":")[-1]) for d in gate.denied}
    assert refused == {
        (f"role/{roles.role_name(result_a.run_id)}", "ssm:GetParameter", f"parameter{ssm_key_parameter(job_b.run_id, ec2.store().scope)}"),
        (f"role/{roles.role_name(result_a.run_id)}", "s3:PutObject", f"{ec2.bucket}/jobs/{job_b.run_id}/{LAUNCH_KEY}"),
        (f"role/{roles.role_name(result_a.run_id)}", "ec2:TerminateInstances", f"instance/{b_instance}"),
    }, gate.denied
    role_a = f"role/{roles.role_name(result_a.run_id)}"
    assert {(f"user/{user}", a) for a in ("iam:CreateRole", "iam:PassRole", "ec2:RunInstances",
                                          "ec2:TerminateInstances", "ssm:PutParameter", "s3:PutObject",
                                          "iam:DeleteRole")} <= gate.allowed, "the driver's calls were judged"
    assert {(role_a, a) for a in ("ssm:GetParameter", "kms:Decrypt", "s3:GetObject", "s3:PutObject")} <= gate.allowed
    for run_id in (result_a.run_id, job_b.run_id):
        assert f"IAM role {roles.role_name(run_id)}" in (result_a if run_id == result_a.run_id else result_b).released
        with pytest.raises(iam.exceptions.NoSuchEntityException):
            iam.get_role(RoleName=roles.role_name(run_id))
        with pytest.raises(iam.exceptions.NoSuchEntityException):
            iam.get_instance_profile(InstanceProfileName=roles.role_name(run_id))
        assert ec2.leftovers(run_id) == []


def test_the_console_output_of_an_instance_reads_as_text(aws_env: MotoAWS, aws_network: Network) -> None:
    """What a booting node printed reaches the error of a node that went away (GetConsoleOutput)."""
    bucket = f"sgpu-console-{uuid.uuid4().hex[:12]}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    compute = EC2InstanceCompute.from_settings(
        {"store_uri": f"s3://{bucket}/jobs", "endpoint_url": aws_env.endpoint_url,
         "subnet_ids": aws_network.subnet_ids}, session=aws_env.session())
    iid = _moto_instance(aws_env, "console-run")
    try:
        text = compute._console_output(iid)
        assert isinstance(text, str) and text.strip(), "moto's console output, decoded"
        assert compute._console_tail(iid).startswith(f"; the end of {iid}'s console output:\n")
    finally:
        aws_env.client("ec2").terminate_instances(InstanceIds=[iid])
