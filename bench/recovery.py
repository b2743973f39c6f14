"""What replacing only a lost node saves: node replacement against a whole new gang, side by side.

Runs offline, like the test suite: a moto server, a VPC in 127.0.0.0/8 and the EC2 simulator
that boots each instance's real user-data as local processes (an image that has everything:
the environment's own cost is ``./dev bench env``'s). For each node count and each simulated
boot time (the seconds from an instance's launch until its user-data runs; a GPU instance
takes minutes on AWS), the 60-step training job of the recovery tests runs twice: node 1's
instance is terminated right after the step-20 checkpoint, and the job recovers with
``replace_lost="nodes"`` (one new instance, the others kept), then with ``replace_lost="gang"``
(every instance new). Reported per run: seconds from the termination to rank 0's first step
after the resume (read from rank 0's log in the store, shipped every second: about 1 s of
resolution), the instances the job launched in all, and the step the new gang resumed from.

    ./dev bench recovery [--nodes 2 8] [--boot-s 0 90] [--step-s 0.25]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from prefect_sgpu import distributed  # noqa: E402
from prefect_sgpu.protocol.jobfolder import log_key  # noqa: E402
from support.aws_fixtures import create_network, offline_aws  # noqa: E402
from support.conformance_ec2 import ec2_environment  # noqa: E402
from support.training import train_with_checkpoints  # noqa: E402

RESUMED = re.compile(rb"starting at step [1-9][0-9]*.*?\nstep \d+", re.S)  # the lost gang started at 0


def _has_checkpoint(env, run_id: str, step: int) -> bool:  # type: ignore[no-untyped-def]
    key = f"jobs/{run_id}/checkpoints/step-{step:08d}/COMPLETE"
    return env.aws.client("s3").list_objects_v2(Bucket=env.bucket, Prefix=key).get("KeyCount", 0) > 0


def one_run(env, nodes: int, mode: str, step_s: float) -> dict:  # type: ignore[no-untyped-def]
    """One job, node 1 terminated after the step-20 checkpoint; what the recovery took."""
    compute = env.compute(replace_lost=mode, agent_timeout_s=900.0)
    job = distributed(gpus=nodes, nodes=nodes, gpu_type="A10", remote=True, mlflow=False, timeout=3600, compute=compute)(
        train_with_checkpoints).job(step_s=step_s)
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = job.run()
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while not _has_checkpoint(env, job.run_id, 20):
        if not thread.is_alive():
            raise SystemExit(f"the job ended before its step-20 checkpoint: {outcome}")
        time.sleep(0.2)
    node1 = next(i["InstanceId"] for i in env.instances(job.run_id, live=True) if i["AmiLaunchIndex"] == 1)
    env.aws.client("ec2").terminate_instances(InstanceIds=[node1])
    lost_at = time.monotonic()
    resumed_s = None
    while thread.is_alive() and resumed_s is None:
        log = compute.store.get(job.run_id, log_key(0)) or b""
        if RESUMED.search(log):
            resumed_s = time.monotonic() - lost_at
        time.sleep(0.2)
    thread.join()
    if "error" in outcome:
        raise SystemExit(f"{mode} on {nodes} nodes failed: {outcome['error']!r}")
    (recovery,) = outcome["result"].recoveries
    assert recovery.replaced == mode, recovery
    return {"nodes": nodes, "mode": mode, "resumed_s": resumed_s, "launched": len(env.instances(job.run_id)),
            "from_step": recovery.resumed_from_step}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--boot-s", type=float, nargs="+", default=[0.0, 90.0])
    parser.add_argument("--step-s", type=float, default=0.25)
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SGPU_DEVICE", "cpu")
    rows = []
    with offline_aws() as (aws, proxy):
        work = Path(tempfile.mkdtemp(prefix="sgpu-bench-recovery-"))
        with ec2_environment(aws, create_network(aws), work / "nodes", proxy=proxy, bare=False) as env:
            for boot in args.boot_s:
                env.simulator.boot_delay_s = boot
                for nodes in args.nodes:
                    for mode in ("nodes", "gang"):
                        row = {**one_run(env, nodes, mode, args.step_s), "boot_s": boot}
                        print(row, flush=True)
                        rows.append(row)
    load = os.getloadavg()[0]
    machine = f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()}, load {load:.1f})"
    print(f"\n{dt.date.today()}, {machine}, step {args.step_s:g} s, node 1 terminated after the step-20 checkpoint\n")
    print("| nodes | boot s | replaced | loss to first step after resume s | instances launched | resumed from step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        resumed = "?" if r["resumed_s"] is None else f"{r['resumed_s']:.1f}"
        print(f"| {r['nodes']} | {r['boot_s']:g} | {'lost node only' if r['mode'] == 'nodes' else 'whole gang'} "
              f"| {resumed} | {r['launched']} | {r['from_step']} |")


if __name__ == "__main__":
    main()
