"""Work is never lost: checkpoints on the store, relaunch after infrastructure loss, the hang watchdog.

EC2 runs on moto with the instance simulator (2 nodes x 1 rank): a spot interruption
notice served by a node's IMDS, or its instance terminated, mid-training; the job
relaunches on new instances and resumes from the newest complete checkpoint on S3.
The local compute loses a node to ``kill -9``. A rank that sleeps forever trips the
hang watchdog. A small 60-step job checkpointing every 10 steps stands for training.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from support.conformance_ec2 import EC2Env
from support.recovery import has_checkpoint, node_instance, recovered_exactly_once, when
from support.threads import drive
from support.training import STEPS, all_reduce_for_a_minute, train_with_checkpoints as _train
from prefect_sgpu import distributed
from prefect_sgpu.errors import JobHung
from prefect_sgpu.protocol.jobfolder import LOGS

pytestmark = pytest.mark.e2e

def test_spot_notice_checkpoints_at_once_and_the_job_resumes_on_new_instances(ec2: EC2Env) -> None:
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(), mlflow=False, timeout=600)(_train)
    job = fn.job(step_s=0.5)  # 40 steps left after the notice: longer than the 8 s to termination
    thread, outcome = drive(job)
    when(lambda: has_checkpoint(ec2, job.run_id, 20), 300, "the step-20 checkpoint", thread, outcome)
    node0, node1 = node_instance(ec2, job.run_id, 0), node_instance(ec2, job.run_id, 1)
    ec2.simulator.reclaim(node1, after=8.0)  # two minutes on AWS
    thread.join(timeout=400)
    assert not thread.is_alive(), "the job did not finish"
    recovered_exactly_once(ec2, job, outcome, node1, node0)
    logs = ec2.objects(job.run_id)
    gang1 = b"".join(v for k, v in logs.items() if f"/{LOGS}/gang-1/" in k)
    assert b"reclaim notice: saving a checkpoint at step" in gang1, "the notice made every rank save at once"


def test_a_terminated_instance_is_replaced_and_the_job_resumes(ec2: EC2Env) -> None:
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(), mlflow=False, timeout=600)(_train)
    job = fn.job()
    thread, outcome = drive(job)
    when(lambda: has_checkpoint(ec2, job.run_id, 20), 300, "the step-20 checkpoint", thread, outcome)
    node0, node1 = node_instance(ec2, job.run_id, 0), node_instance(ec2, job.run_id, 1)
    ec2.aws.client("ec2").terminate_instances(InstanceIds=[node1])
    thread.join(timeout=400)
    assert not thread.is_alive(), "the job did not finish"
    recovered_exactly_once(ec2, job, outcome, node1, node0)


def test_a_rebooted_instance_powers_off_and_is_replaced_and_the_job_resumes(ec2: EC2Env) -> None:
    """Bare nodes boot under cloud-init's environment (no HOME, LANG or USER, cwd /: the simulator's default
    where it has namespaces), each scheduling its absolute lifetime (the job's 600 s timeout plus 600 s of
    margin: 20 minutes). Node 1 is rebooted mid-training: its processes die, cloud-init runs the per-boot
    script (not the user-data), which powers it off; the driver replaces it as any lost node."""
    if not ec2.simulator.cloud_init:
        pytest.skip("cloud-init's environment needs PID and mount namespaces (root)")
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(agent_timeout_s=600.0), mlflow=False,
                     timeout=600)(_train)
    job = fn.job()
    thread, outcome = drive(job)
    when(lambda: has_checkpoint(ec2, job.run_id, 20), 300, "the step-20 checkpoint", thread, outcome)
    node0, node1 = node_instance(ec2, job.run_id, 0), node_instance(ec2, job.run_id, 1)
    for iid in (node0, node1):
        assert ec2.simulator.scheduled_shutdown(iid) == "+20", ec2.simulator.scheduled_shutdowns(iid)
    ec2.simulator.reboot(node1)
    thread.join(timeout=400)
    assert not thread.is_alive(), "the job did not finish"
    recovered_exactly_once(ec2, job, outcome, node1, node0)
    assert "shutdown -h now" in ec2.simulator.shutdowns(node1), "the per-boot script powered it off"
    assert "reboot" in ec2.simulator.console(node1)


def test_an_fsdp2_checkpoint_on_s3_is_restored_by_a_gang_on_other_nodes(ec2: EC2Env) -> None:
    """One job writes sharded FSDP2 checkpoints to S3 and ends at step 20; a second job, on new
    instances, downloads the newest and continues from the very same weights."""
    location = f"s3://{ec2.bucket}/shared/fsdp-run"
    options = {"gpus": 2, "gpu_type": "A10", "remote": True, "compute": ec2.compute(), "mlflow": False, "timeout": 600,
               "env": {"SGPU_CHECKPOINT_URI": location, "SGPU_STRATEGY": "fsdp"}}
    first = distributed(**options)(_train).distributed(step_s=0.0, strategy="fsdp", stop_at=20)
    second = distributed(**options)(_train).distributed(step_s=0.0, strategy="fsdp", stop_at=30)
    assert first[0]["start"] == 0 and second[0]["start"] == 20
    assert None not in {r["instance"] for r in first + second}
    assert {r["instance"] for r in first}.isdisjoint({r["instance"] for r in second}), "the 2nd gang ran elsewhere"
    assert second[0]["optimizer_steps"] == 30
    assert second[0]["restored"] == first[0]["final"], "the new gang restored exactly the weights of step 20"
    keys = [o["Key"] for o in ec2.aws.client("s3").list_objects_v2(Bucket=ec2.bucket,
                                                                   Prefix="shared/fsdp-run/").get("Contents", [])]
    assert "shared/fsdp-run/step-00000020/dcp/__1_0.distcp" in keys and \
        "shared/fsdp-run/step-00000020/dcp/.metadata" in keys, keys


def _gang_of_this_rank() -> int:
    gang = int(os.environ.get("SGPU_GANG") or 0)
    print(f"gang {gang} is up", flush=True)
    if gang == 0:
        time.sleep(300)  # its machine is lost meanwhile
    return gang


def test_a_lost_gangs_stop_written_back_does_not_stop_the_relaunched_gang(fake_case: Any) -> None:
    """The fake cloud (real bootstraps over a local store): gang 0's machine is lost, the driver stops
    gang 0 with a sealed stop and relaunches. A store writer keeps that stop and writes it back for as long
    as gang 1 runs: gang 1's node refuses it (another gang's) and the job returns gang 1's value."""
    from prefect_sgpu.protocol.jobfolder import STOP, log_key

    provider, store = fake_case.provider, fake_case.compute.store
    fn = distributed(**fake_case.options(gpus=1, timeout=300, max_recoveries=1))(_gang_of_this_rank)
    job = fn.job()
    thread, outcome = drive(job)
    machines = lambda: [m for m in provider.machines.values() if m.launch_id == job.run_id]  # noqa: E731
    when(lambda: b"gang 0 is up" in (store.get(job.run_id, log_key(0)) or b""), 120, "gang 0's rank", thread, outcome)
    (first,) = machines()
    os.killpg(first.proc.pid, signal.SIGKILL)  # the machine is lost
    kept: list[bytes] = []
    when(lambda: bool(kept.append(store.get(job.run_id, STOP) or b"") or kept[-1]), 60, "gang 0's stop", thread, outcome)
    stop = kept[-1]
    replays = 0
    while thread.is_alive():  # the store writer: gang 0's stop in gang 1's folder, again whenever it goes
        if len(machines()) > 1 and store.get(job.run_id, STOP) != stop:
            store.put(job.run_id, STOP, stop)
            replays += 1
        time.sleep(0.05)
    thread.join(timeout=60)
    assert "error" not in outcome, repr(outcome.get("error"))
    assert outcome["result"].values == [1] and len(outcome["result"].recoveries) == 1
    assert replays >= 1, "gang 0's stop was never written back"
    second = machines()[-1]
    console = (second.home / "console.log").read_text(errors="replace")
    assert "expected kind=stop" in console and "gang=1" in console, console[-3000:]


def _gang_and_machine() -> dict[str, Any]:
    from prefect_sgpu import runtime

    gang = int(os.environ.get("SGPU_GANG") or 0)
    print(f"gang {gang} is up", flush=True)
    if gang == 0:
        time.sleep(300)  # node 1's machine is lost meanwhile
    return {"gang": gang, "machine": runtime.instance_id()}


def test_a_lost_node_alone_is_replaced_and_the_kept_node_refuses_the_lost_gangs_launch(fake_case: Any) -> None:
    """The fake cloud (real bootstraps over a local store), 2 nodes: node 1's machine is lost. Node 0's
    machine is kept and serves gang 1, node 1 gets one new machine. A store writer puts gang 0's launch
    documents back while node 0 waits for gang 1's: node 0 refuses them (another gang's)."""
    from prefect_sgpu.protocol.jobfolder import LAUNCH_KEY, REJOIN_KEY, log_key

    provider, store = fake_case.provider, fake_case.compute.store
    fn = distributed(**fake_case.options(gpus=2, timeout=300, max_recoveries=1))(_gang_and_machine)
    job = fn.job()
    thread, outcome = drive(job)
    machines = lambda: [m for m in provider.machines.values() if m.launch_id == job.run_id]  # noqa: E731
    up = lambda: all(b"gang 0 is up" in (store.get(job.run_id, log_key(r)) or b"") for r in (0, 1))  # noqa: E731
    when(up, 120, "gang 0's ranks", thread, outcome)
    gang0_launch = store.get(job.run_id, LAUNCH_KEY)
    first0, first1 = sorted(machines(), key=lambda m: m.index)
    os.killpg(first1.proc.pid, signal.SIGKILL)  # node 1's machine is lost
    refused = "launch document of gang 0 of job"
    replays = 0
    while thread.is_alive() and refused not in (first0.home / "console.log").read_text(errors="replace"):
        if store.get(job.run_id, REJOIN_KEY) is not None and store.get(job.run_id, LAUNCH_KEY) is None:
            store.put(job.run_id, LAUNCH_KEY, gang0_launch)  # before the driver writes gang 1's
            replays += 1
        time.sleep(0.05)
    thread.join(timeout=120)
    assert "error" not in outcome, repr(outcome.get("error"))
    result = outcome["result"]
    (second1,) = [m for m in machines() if m.id not in (first0.id, first1.id)]
    assert result.values == [{"gang": 1, "machine": first0.id}, {"gang": 1, "machine": second1.id}]
    (recovery,) = result.recoveries
    assert recovery.replaced == "nodes" and recovery.nodes == {1: first1.id} and recovery.kept == {0: first0.id}
    assert provider.sent == [(job.run_id, 2), (job.run_id, 1)], "one machine launched in place of the lost one"
    assert replays >= 1
    console = (first0.home / "console.log").read_text(errors="replace")
    assert f"kept for gang 1 of job {job.run_id}" in console and "this node serves gang 1: refused" in console
    assert fake_case.leftovers(job.run_id) == []


def _machine() -> str | None:
    from prefect_sgpu import runtime

    return runtime.instance_id()


def test_a_warm_leases_lost_node_alone_is_replaced_and_the_lease_serves_the_next_job(fake_warm_case: Any) -> None:
    """A job on a warm lease of 2 fake machines loses node 1's: one machine joins the lease in its place,
    node 0's serves the next gang, and the lease, whole again, serves the next job with no new machine."""
    from prefect_sgpu.compute.remote.lease import lease_id
    from prefect_sgpu.protocol.jobfolder import log_key

    provider, store = fake_warm_case.provider, fake_warm_case.compute.store
    options = fake_warm_case.options(gpus=2, timeout=300, max_recoveries=1)
    job = distributed(**options)(_gang_and_machine).job()
    thread, outcome = drive(job)
    lease = lease_id(job.run_id)
    up = lambda: all(b"gang 0 is up" in (store.get(job.run_id, log_key(r)) or b"") for r in (0, 1))  # noqa: E731
    when(up, 120, "gang 0's ranks", thread, outcome)
    first0, first1 = sorted((m for m in provider.machines.values() if m.launch_id == lease), key=lambda m: m.index)
    os.killpg(first1.proc.pid, signal.SIGKILL)  # node 1's machine is lost mid-job
    thread.join(timeout=120)
    assert "error" not in outcome, repr(outcome.get("error"))
    result = outcome["result"]
    (second1,) = [m for m in provider.machines.values() if m.id not in (first0.id, first1.id)]
    assert second1.launch_id == lease, "the new machine belongs to the lease"
    assert result.values == [{"gang": 1, "machine": first0.id}, {"gang": 1, "machine": second1.id}]
    (recovery,) = result.recoveries
    assert recovery.replaced == "nodes" and recovery.kept == {0: first0.id}, recovery
    assert provider.sent == [(lease, 2), (lease, 1)]
    # the next job of the same shape: the lease, with its new machine, takes it
    assert distributed(**options)(_machine).distributed() == [first0.id, second1.id]
    assert provider.sent == [(lease, 2), (lease, 1)], "no machine launched for the next job"


def test_local_node_killed_outright_is_relaunched_and_resumes(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    fn = distributed(gpus=2, nodes=2, timeout=600)(_train)
    job = fn.job()
    thread, outcome = drive(job)
    checkpoint = lambda: (job.store.local_dir_root() / job.run_id / "checkpoints" / "step-00000020" / "COMPLETE").exists()  # noqa: E731
    when(checkpoint, 300, "the step-20 checkpoint", thread, outcome)
    agent = job.allocation.processes[1]
    os.killpg(agent.pid, signal.SIGKILL)  # the node is gone: no status, no cleanup of its own
    thread.join(timeout=300)
    assert not thread.is_alive()
    assert "error" not in outcome, repr(outcome.get("error"))
    result = outcome["result"]
    rank0 = result.values[0]
    assert rank0["optimizer_steps"] == STEPS and rank0["start"] >= 20, rank0
    (recovery,) = result.recoveries
    assert "killed by SIGKILL" in recovery.reason and recovery.resumed_from_step == rank0["start"]
    # the timeline: the checkpoint the next gang resumed from, the loss, then the next gang's own phases
    phases = [(p.phase, p.node, p.gang) for p in result.timeline]
    (saved,) = [p for p in result.timeline if p.phase == "checkpoint"]
    assert saved.detail.startswith(f"step {recovery.resumed_from_step},") and saved.gang == 0, saved
    assert phases.index(("checkpoint", None, 0)) < phases.index(("recovery", 1, 0)) \
        < phases.index(("launch requested", None, 1)) < phases.index(("rendezvous", 1, 1)), phases
    run = MlflowClient(uri).get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.tags["sgpu.recoveries"] == "1"
    assert '"resumed_from_step": %d' % rank0["start"] in run.data.tags["sgpu.recovery.1"]


def test_a_user_exception_is_never_recovered(tmp_path: Path) -> None:
    calls = tmp_path / "calls"

    def fails() -> None:
        from prefect_sgpu import runtime

        with open(calls, "a") as fh:
            fh.write(f"{runtime.rank()}\n")
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        distributed(gpus=2, mlflow=False, max_recoveries=3)(fails).distributed()
    ranks = calls.read_text().split()
    assert ranks and len(ranks) == len(set(ranks)), f"one gang ran: a user error is not infrastructure loss {ranks}"


def _sleeps_forever_on_rank_1() -> int:
    from prefect_sgpu import runtime

    if runtime.rank() == 1:
        time.sleep(3600)
    return runtime.rank()


def test_a_silent_rank_fails_the_job_as_hung_naming_it_with_its_stack(tmp_path: Path) -> None:
    from support.processes import job_processes

    job = distributed(gpus=2, mlflow=False, hang_timeout=5, timeout=600)(_sleeps_forever_on_rank_1).job()
    with pytest.raises(JobHung) as info:
        job.run()
    error = info.value
    assert set(error.ranks) == {1}, "rank 0 finished; only rank 1 was silent"
    assert "in _sleeps_forever_on_rank_1" in error.ranks[1]["stack"], error.ranks[1]
    assert "rank(s) 1 made no progress for 5s" in str(error)
    assert not job_processes(job.run_id), "every rank was stopped"


def test_nodes_that_stop_for_a_stalled_driver_heartbeat_fail_the_job_saying_so_not_relaunch_it(
        ec2: EC2Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver runs but its heartbeat stops advancing: each node stops its ranks and its instance at its
    TTL. That is no loss of capacity to recover from: the job fails with HeartbeatExpired naming it, not
    with the collective error a peer raised afterwards, and nothing is left behind."""
    from prefect_sgpu.driver import heartbeat
    from prefect_sgpu.errors import HeartbeatExpired

    monkeypatch.setattr(heartbeat, "HEARTBEAT_INTERVAL_S", 3600.0)  # the first beat, then none
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(heartbeat_ttl_s=6.0), mlflow=False,
                     timeout=300, max_recoveries=1)(all_reduce_for_a_minute)
    job = fn.job()
    with pytest.raises(HeartbeatExpired) as info:
        job.run()
    assert "no new driver heartbeat for" in str(info.value) and "still ran" in str(info.value), str(info.value)
    assert len(ec2.instances(job.run_id)) == 2, "no relaunch"
    assert all(i["State"]["Name"] == "terminated" for i in ec2.instances(job.run_id))
    assert ec2.leftovers(job.run_id) == []


def test_a_rebalance_recommendation_without_a_reclaim_is_a_warning_and_the_job_ends_on_its_own_instances(
        ec2: EC2Env, virtual_clock: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A rebalance recommendation mid-job and no interruption after it (AWS docs, "EC2 instance
    rebalance recommendations": it may never be followed by one): the driver shows it as a warning,
    the ranks are not told to preempt, no node is replaced and the job is not relaunched; it ends
    with the right values on the instances it started on. Meanwhile EC2 keeps the run's groups in use
    for a while after the instances ended: release waits that out (on the retry clock) and leaves nothing.
    And the nodes are busy: their IMDS answers the instance profile's credentials 1.5 s late, past
    botocore's default 1 s (``support.ec2_simulator.FakeIMDS``); the ranks' checkpoint uploads still
    find them."""
    assert ec2.proxy is not None
    ec2.proxy.hold_groups(security_group_s=120.0, placement_group_s=20.0)
    ec2.simulator.credentials_answer_s = 1.5
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(), mlflow=False, timeout=600)(_train)
    job = fn.job(step_s=0.5)  # 40 steps after the recommendation: the node's and the driver's polls see it
    with caplog.at_level(logging.WARNING, logger="prefect_sgpu"):
        thread, outcome = drive(job)
        when(lambda: has_checkpoint(ec2, job.run_id, 20), 300, "the step-20 checkpoint", thread, outcome)
        node0, node1 = node_instance(ec2, job.run_id, 0), node_instance(ec2, job.run_id, 1)
        ec2.simulator.rebalance(node1)  # and no instance-action after it
        thread.join(timeout=400)
    assert not thread.is_alive(), "the job did not finish"
    assert "error" not in outcome, repr(outcome.get("error"))
    result = outcome["result"]
    assert result.recoveries == [], "the job was relaunched for a rebalance recommendation"
    assert [v["instance"] for v in result.values] == [node0, node1], "the job ended on the instances it started on"
    assert result.values[0]["start"] == 0 and result.values[0]["optimizer_steps"] == STEPS
    assert len(ec2.instances(job.run_id)) == 2, "a replacement instance was launched"
    assert len({c.params["ClientToken"] for c in ec2.proxy.calls("RunInstances")}) == 1
    warnings = [r.getMessage() for r in caplog.records if "rebalance recommendation" in r.getMessage()]
    assert any("node 1" in w and node1 in w and "not a reclaim" in w for w in warnings), warnings
    assert not any("will be reclaimed" in r.getMessage() for r in caplog.records)
    logs = b"".join(ec2.objects(job.run_id).values())
    assert b"reclaim notice: saving a checkpoint" not in logs, "the ranks were told to preempt"
    assert any(c.error == "DependencyViolation" for c in ec2.proxy.calls("DeleteSecurityGroup"))
    assert ec2.leftovers(job.run_id) == []
