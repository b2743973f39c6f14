"""Warm EC2 leases end to end, offline: consecutive jobs on the same instances, nothing of one
job left for the next, assignments only the driver can write, and every way a lease ends.

The instances are moto's, booted by :mod:`ec2_simulator` (each one's real user-data as local
processes), as in ``test_ec2_e2e.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from support.conformance_ec2 import HEARTBEAT_TTL_S, EC2Env
from support.ec2_simulator import REPO_ROOT
from support.rank_functions import TrainingDiverged, fails_on_rank_1
from support.processes import HOPPER, still_growing
from prefect_sgpu import distributed, runtime
from prefect_sgpu.compute.remote.lease import lease_id
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.protocol.jobfolder import (ASSIGN_KEY, Assign, JobFolder, new_key, ssm_key_parameter,
                                    ssm_secrets_parameter)

pytestmark = pytest.mark.e2e


def _where(tag: str, marker: str) -> dict[str, Any]:
    """Each rank's instance, job folder and pid; on ``leave``, a process left running in the node
    agent's session (a rank's forgotten child) and a file in the job's local folder."""
    import subprocess
    import sys
    import tempfile

    import psutil
    import torch
    import torch.distributed as dist

    runtime.init_process_group()
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    job_dir = os.environ["SGPU_JOB_DIR"]
    # what a job may leave for the next on the same machine: a temp file, a cache entry (a compiled
    # kernel, a downloaded model), a shared-memory file
    left = [Path(tempfile.gettempdir(), f"{marker}-tmp-{runtime.rank()}"),
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "torch", f"{marker}-{runtime.rank()}"),
            Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache", f"{marker}-{runtime.rank()}")]
    if tag == "leave":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
        # one that never keeps a pid: it forks and its parent exits, over and over (a walk of the
        # node's processes is a snapshot it may outrun; its cgroup is not), writing as it goes
        subprocess.Popen([sys.executable, "-c", HOPPER, f"/var/tmp/{marker}-hops-{runtime.rank()}"],
                         start_new_session=True)
        Path(job_dir, f"left-by-rank-{runtime.rank()}").write_text("x")
        for path in left:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("x")
    if tag in ("leave", "shm"):
        Path("/dev/shm", f"{marker}-{runtime.rank()}").write_text("x")
    found = [p.pid for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]
    return {"rank": runtime.rank(), "instance": os.environ["SGPU_INSTANCE_ID"], "job_dir": job_dir,
            "pid": os.getpid(), "world": int(t.item()), "leftover_pids": found,
            "left": [str(path) for path in left], "temp": tempfile.gettempdir(),
            "found": sorted(str(path) for path in left if path.exists())
            + sorted(str(path) for path in Path("/dev/shm").glob(f"{marker}-*")),
            # a rank forked (through its agent) from the node's warm process still has that process's argv
            "forked": "prefect_sgpu.launch.warm_node" in psutil.Process().cmdline(),
            "cgroup": next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines()
                           if line.startswith("0::"))}


def _assert_own_cgroups(values: list[dict[str, Any]], run_id: str) -> None:
    """Each rank ran in its job's cgroup on its node, and that cgroup is gone now."""
    from prefect_sgpu.launch.job_cgroup import cgroup2_root

    root = cgroup2_root()
    assert root is not None
    for value in values:
        assert Path(value["cgroup"]).name == f"sgpu-{value['instance']}-{run_id}-g0", value["cgroup"]
        assert not (root / value["cgroup"].lstrip("/")).exists(), f"{value['cgroup']} was removed with its job"
    assert len({v["cgroup"] for v in values}) == len(values), "one cgroup per node"


def _warm_nodes(ec2: EC2Env, instances: list[str]) -> list[Any]:
    """The warm node processes of the simulated instances (each instance has a home of its own)."""
    import psutil

    # HOME as the simulator sets it, or as the user-data sets it from root's passwd entry under cloud-init
    homes = {str(ec2.simulator.workdir / iid / h) for iid in instances for h in ("home", "root")}
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "prefect_sgpu.launch.warm_node" in (proc.info["cmdline"] or []) and proc.environ().get("HOME") in homes:
                found.append(proc)
        except psutil.Error:
            continue
    assert len(found) == len(instances), f"one warm node per instance: {found}"
    return found


def _live(ec2: EC2Env, run_id: str) -> list[str]:
    return sorted(i["InstanceId"] for i in ec2.instances(run_id, live=True))


def _wait(what: str, predicate: Any, timeout: float, ec2: EC2Env) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout:g}s; {ec2.simulator.describe()}"
        time.sleep(0.5)


def test_consecutive_jobs_share_a_lease_see_nothing_of_each_other_and_refuse_foreign_assignments(
        ec2: EC2Env) -> None:
    compute = ec2.compute(keep_warm=300)
    marker = f"sgpu-left-{uuid.uuid4().hex[:8]}"
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=compute, mlflow=False, timeout=300)(_where)
    try:
        first = fn.job("leave", marker)
        one = first.run()
        lease = lease_id(first.run_id)
        instances = _live(ec2, lease)
        assert len(instances) == 2 and sorted(v["instance"] for v in one.values) == instances
        assert all(v["world"] == 2 for v in one.values) and all(v["leftover_pids"] for v in one.values)
        assert ec2.instances(first.run_id) == [], "a warm job's instances are the lease's, tagged with its id"
        assert ec2.leftovers(first.run_id) == [], "the job's key and control files go with the job"
        scope = ec2.store().scope
        assert one.released == [f"SSM parameter {ssm_key_parameter(first.run_id, scope)}",  # the job's secrets: its
                                f"SSM parameter {ssm_secrets_parameter(first.run_id, scope)}"]  # checkpoint key, say
        served = ec2.store().get(lease, ASSIGN_KEY)  # the assignment of the first job, already served
        assert served is not None

        second = fn.job("look", marker)
        two = second.run()
        assert [v["rank"] for v in two.values] == [0, 1] and all(v["world"] == 2 for v in two.values)
        assert sorted(v["instance"] for v in two.values) == instances, "the second job ran on the same instances"
        assert len(ec2.sent_run_instances()) == 1, "one RunInstances for both jobs"
        assert all(v["forked"] for v in one.values + two.values), "ranks forked from the nodes' warm processes"
        _assert_own_cgroups(one.values, first.run_id)
        _assert_own_cgroups(two.values, second.run_id)
        for rank in (0, 1):
            hops = Path(f"/var/tmp/{marker}-hops-{rank}")
            assert hops.stat().st_size > 0 and not still_growing(hops), "the hopping process died with its job"
            hops.unlink()
        for before, after in zip(one.values, two.values):
            assert after["leftover_pids"] == [], "the first job's left-behind process was killed"
            assert not Path(before["job_dir"]).exists(), "the first job's local folder was deleted"
            assert after["pid"] != before["pid"]
            assert len(before["found"]) == 4, f"the first job wrote its temp, cache and shm files: {before}"
            assert after["found"] == [], "no temp file, cache entry or /dev/shm file of the first job is left"
            assert not any(Path(p).exists() for p in before["left"]), "its temp and cache folder was deleted"
            assert after["temp"] != before["temp"] != tempfile.gettempdir(), "each job has its own temp folder"
        assert ec2.leftovers(second.run_id) == []

        # whoever can write the store cannot assign a job: neither a forged assignment nor a served one again
        store, iids = ec2.store(), instances
        store.put(lease, ASSIGN_KEY, served)
        _wait("the replayed assignment refused", lambda: all(
            "(replayed): refused" in ec2.simulator.console(i) for i in iids), 60, ec2)
        forged = JobFolder(store, lease, new_key())
        forged.put_assignments({i: (Assign(run_id=first.run_id, seq=99), iid) for i, iid in enumerate(iids)})
        _wait("the forged assignment refused", lambda: all(
            "signature does not match" in ec2.simulator.console(i) for i in iids), 60, ec2)
        assert not [k for k in ec2.objects(first.run_id) if "/nodes/" in k], "no node served the first job again"

        # with its warm nodes gone, a job's agents start cold: the ranks still get a /dev/shm of their own
        for warm in _warm_nodes(ec2, instances):
            warm.kill()
        shm = f"sgpu-shm-{uuid.uuid4().hex[:8]}"
        third_job = fn.job("shm", shm)
        third = third_job.run().values
        _assert_own_cgroups(third, third_job.run_id)
        assert [v["rank"] for v in third] == [0, 1], "the lease still serves its driver"
        assert len(ec2.sent_run_instances()) == 1
        assert not any(v["forked"] for v in third), "the agents started cold"
        assert all(v["found"] == [f"/dev/shm/{shm}-{v['rank']}"] for v in third), third
        assert not list(Path("/dev/shm").glob(f"{shm}-*")), "the cold job's /dev/shm files were its own"
    finally:
        compute.close()
    _wait("the lease's instances terminated when the compute closed", lambda: _live(ec2, lease) == [], 60, ec2)
    assert ec2.leftovers(lease) == [], "the lease's key, groups and control files are gone"


def _rank() -> int:
    return runtime.rank()


def _code(call: Any) -> str:
    """"allowed", or the AWS error code of ``call()`` (defined here: this module travels to the nodes
    by value, ``support`` is not on their import path)."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the error code is the answer
        return (getattr(exc, "response", None) or {}).get("Error", {}).get("Code") or type(exc).__name__
    return "allowed"


def _reach(earlier_run: str, other_run: str, bucket: str, prefix: str) -> dict[str, str]:
    """From rank 0, with the node's own (instance profile) credentials: this job's own folder and key, a
    file the job before it on the lease wrote in its folder, another run's key of the same store."""
    import boto3

    from prefect_sgpu.protocol.jobfolder import ssm_key_parameter
    from prefect_sgpu.store import store_scope

    if runtime.rank() != 0:
        return {}
    where = {"endpoint_url": os.environ["SGPU_STORE_ENDPOINT_URL"], "region_name": os.environ["SGPU_STORE_REGION"]}
    ssm, s3 = (boto3.client(s, **where) for s in ("ssm", "s3"))
    scope = store_scope(f"s3://{bucket}/{prefix}")

    found = {"own": _code(lambda: s3.put_object(Bucket=bucket, Key=f"{prefix}/{runtime.run_id()}/probe.txt",
                                                  Body=b"mine")),
             "own key": _code(lambda: ssm.get_parameter(Name=ssm_key_parameter(runtime.run_id(), scope),
                                                          WithDecryption=True))}
    if earlier_run:
        found["earlier"] = _code(lambda: s3.get_object(Bucket=bucket, Key=f"{prefix}/{earlier_run}/probe.txt"))
        found["other key"] = _code(lambda: ssm.get_parameter(Name=ssm_key_parameter(other_run, scope),
                                                               WithDecryption=True))
    return found


def test_with_job_roles_a_lease_has_a_role_that_reaches_each_job_only_while_it_runs(ec2: EC2Env) -> None:
    """keep_warm with job_roles: the lease's instances have a role of the lease; each job on it reaches
    its own folder and key, and neither the folder of the job before it on the same instances nor
    another run's key; the driver does all of it under the shipped driver policy (support.iam_gate)."""
    from prefect_sgpu.compute.ec2 import roles
    from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute

    assert ec2.proxy is not None
    iam = ec2.aws.client("iam")
    driver, gate, boundary = ec2.gated_driver()
    settings = {**ec2.settings, "instance_profile": None, "job_roles": True, "node_permissions_boundary": boundary,
                "keep_warm": 300}
    try:
        compute = EC2InstanceCompute.from_settings(settings, session=driver)
        fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=compute, mlflow=False, timeout=300)(_reach)
        other = f"other-{uuid.uuid4().hex[:8]}"
        try:
            first = fn.job("", other, ec2.bucket, "jobs")
            one = first.run().values[0]
            assert one == {"own": "allowed", "own key": "allowed"}, one
            lease = lease_id(first.run_id)
            role = roles.role_name(lease)
            assert ec2.instances(lease)[0]["IamInstanceProfile"]["Arn"].endswith(f"/{role}")
            assert roles.role_policies(iam, lease) == [roles.ROLE_POLICY_NAME], \
                "the first job's access was taken back when it gave the lease back"

            second = fn.job(first.run_id, other, ec2.bucket, "jobs")
            two = second.run().values[0]
            assert len(ec2.sent_run_instances()) == 1, "both jobs ran on the lease's instances"
            assert two == {"own": "allowed", "own key": "allowed", "earlier": "AccessDenied",
                           "other key": "AccessDeniedException"}, two
        finally:
            compute.close()
    finally:
        ec2.proxy.iam_gate = None
    refused = {(d.identity, d.action, d.resource.split(":")[-1]) for d in gate.denied}
    assert {(f"role/{role}", "s3:GetObject", f"{ec2.bucket}/jobs/{first.run_id}/probe.txt"),
            (f"role/{role}", "ssm:GetParameter", f"parameter{ssm_key_parameter(other, ec2.store().scope)}")} <= refused
    assert not [d for d in gate.denied if d.identity.startswith("user/")], "the driver policy allowed the driver"
    assert {(f"user/{next(iter(gate.users))}", a) for a in ("iam:CreateRole", "iam:PutRolePolicy",
                                                            "iam:DeleteRolePolicy", "iam:DeleteRole")} <= gate.allowed
    _wait("the lease's instances terminated when the compute closed", lambda: _live(ec2, lease) == [], 60, ec2)
    assert ec2.leftovers(lease) == []
    with pytest.raises(iam.exceptions.NoSuchEntityException):
        iam.get_role(RoleName=role)
    with pytest.raises(iam.exceptions.NoSuchEntityException):
        iam.get_instance_profile(InstanceProfileName=role)


def test_a_failed_job_keeps_the_lease_a_lost_node_ends_it_and_the_idle_timeout_ends_the_next(ec2: EC2Env) -> None:
    compute = ec2.compute(keep_warm=300)
    brief_compute = ec2.compute(keep_warm=8)
    try:
        failing = distributed(gpus=2, gpu_type="A10", remote=True, compute=compute, mlflow=False,
                              timeout=300)(fails_on_rank_1)
        job = failing.job()
        with pytest.raises(TrainingDiverged, match="loss is nan on rank 1"):
            job.run()
        old = lease_id(job.run_id)
        assert len(_live(ec2, old)) == 2, "both nodes reported their end (rank 0's was stopped): the lease is kept"
        fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=compute, mlflow=False, timeout=300)(_rank)
        assert fn.distributed() == [0, 1]
        assert len(ec2.sent_run_instances()) == 1

        lost = _live(ec2, old)[1]
        ec2.aws.client("ec2").terminate_instances(InstanceIds=[lost])  # reclaimed while the lease waits
        _wait("the lost instance powered off", lambda: ec2.simulator.wait_powered_off([lost], timeout=1), 60, ec2)
        # the next job on a compute that keeps leases 8 s (leases are shared by shape, whichever compute)
        brief = distributed(gpus=2, gpu_type="A10", remote=True, compute=brief_compute, mlflow=False,
                            timeout=300)(_rank)
        again = brief.job()
        assert again.run().values == [0, 1]
        assert len(ec2.sent_run_instances()) == 2, "a new lease for the job after the loss"
        assert _live(ec2, old) == [] and ec2.leftovers(old) == [], "the unfit lease was ended, its other instance too"
        new = lease_id(again.run_id)
        # launched for the new lease (live or not: its 8 s idle timeout may already have run out here)
        assert len(ec2.instances(new)) == 2
        # no further job: after keep_warm idle seconds the reaper ends the new lease
        _wait("the idle lease ended, its key, groups and control files removed",
              lambda: ec2.leftovers(new) == [], 90, ec2)
    finally:  # only what a failed assertion left
        compute.close()
        brief_compute.close()


def test_a_flows_gpu_tasks_share_one_lease_that_ends_with_the_flow(ec2: EC2Env, prefect_server: None) -> None:
    from prefect import flow

    from prefect_sgpu import GPUTaskRunner, gpu_task

    @gpu_task(gpus=2, gpu_type="A10", remote=True, mlflow=False, return_all=True)
    def step(n: int) -> tuple[int, str]:
        return n + runtime.rank(), os.environ["SGPU_INSTANCE_ID"]

    @flow(task_runner=GPUTaskRunner(compute=ec2.compute(keep_warm=600)))
    def pipeline() -> list[list[tuple[int, str]]]:
        return [step(0), step(10)]

    first, second = pipeline()
    assert [v for v, _ in first] == [0, 1] and [v for v, _ in second] == [10, 11]
    assert [i for _, i in first] == [i for _, i in second], "both tasks ran on the same instances"
    assert len(ec2.sent_run_instances()) == 1
    leases = {t["Value"] for i in ec2.aws.client("ec2").describe_instances(InstanceIds=[first[0][1]])[
        "Reservations"][0]["Instances"] for t in i["Tags"] if t["Key"] == "sgpu:run-id"}
    (lease,) = leases
    assert _live(ec2, lease) == [] and ec2.leftovers(lease) == [], "the flow's end ended the lease (keep_warm 600)"


_DRIVER = textwrap.dedent(
    """
    import json, sys, time
    from prefect_sgpu import distributed, runtime
    from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute
    from support.aws_fixtures import boto3_session

    def rank() -> int:
        return runtime.rank()

    compute = EC2InstanceCompute.from_settings(json.loads(sys.argv[1]), session=boto3_session())
    job = distributed(gpus=2, gpu_type="A10", remote=True, compute=compute, mlflow=False)(rank).job()
    print(json.dumps({"run_id": job.run_id, "values": job.run().values}), flush=True)
    time.sleep(600)  # the lease waits for a next job that never comes: SIGKILLed here
    """
)


def test_a_killed_driver_s_idle_lease_terminates_itself(ec2: EC2Env, tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    env = {**os.environ, **ec2.aws.env, "PREFECT_SGPU_HOME": str(tmp_path / "home"),
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])}
    settings = {**ec2.settings, "keep_warm": 600, "heartbeat_ttl_s": HEARTBEAT_TTL_S}
    driver = subprocess.Popen([sys.executable, str(script), json.dumps(settings)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert driver.stdout is not None
        seen = []  # the driver's log lines (stderr goes to the same pipe) come before its result line
        line = driver.stdout.readline()
        while line and not line.startswith("{") and len(seen) < 200:
            seen.append(line)
            line = driver.stdout.readline()
        assert line.startswith("{"), "".join(seen) + line + (driver.stdout.read() if driver.poll() is not None else "")
        done = json.loads(line)
        assert done["values"] == [0, 1]
        lease = lease_id(done["run_id"])
        ids = _live(ec2, lease)
        assert len(ids) == 2, "the lease waits for the next job"
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=10)
    _wait("the idle nodes terminated themselves", lambda: _live(ec2, lease) == [], HEARTBEAT_TTL_S + 90, ec2)
    assert ec2.simulator.wait_powered_off(ids, timeout=20)
    ssm = ec2.aws.client("ssm")
    with pytest.raises(ssm.exceptions.ParameterNotFound):  # node 0 deleted the lease's key on its way out
        ssm.get_parameter(Name=ssm_key_parameter(lease, ec2.store().scope))


def test_keep_warm_is_checked_before_anything_is_spent(ec2: EC2Env) -> None:
    with pytest.raises(SGPUConfigError, match="keep_warm"):
        ec2.compute(keep_warm=-1)
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(keep_warm=60), mlflow=False)(_rank)
    shown = fn.dry_run()
    assert f"--run-id={lease_id(shown['run_id'])}" in shown["run_instances"]["UserData"]
    assert "--lease" in shown["run_instances"]["UserData"] and "keep_warm" in shown
    assert ec2.sent_run_instances() == []
