"""What faults cost: a spot reclaim on EC2 (simulated) and a hung rank, full size.

Runs offline, like the test suite: a moto server, a VPC in 127.0.0.0/8 and the EC2
simulator that boots each instance's real user-data as local processes (see
``tests/support``). Three runs of the 60-step, 2-node training job of the recovery tests:

1. undisturbed, on EC2 (the baseline wall time);
2. a spot interruption notice on node 1 right after the step-20 checkpoint, the instance
   terminated ``--notice-s`` seconds later (AWS gives 120 s): wall time, the seconds spent
   re-provisioning, the work redone, the step the new gang resumed from;
3. locally, a rank that sleeps forever with ``hang_timeout=--hang-timeout`` (60 s): the
   seconds until ``JobHung``.

    ./dev bench faults [--notice-s 8] [--hang-timeout 60] [--step-s 0.5]

The EC2 numbers leave out what the simulator cannot show: a real GPU instance's boot
(minutes) comes on top of the re-provisioning time measured here.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from prefect_sgpu import distributed  # noqa: E402
from prefect_sgpu.errors import JobHung  # noqa: E402
from support.aws_fixtures import create_network, offline_aws  # noqa: E402
from support.conformance_ec2 import ec2_environment  # noqa: E402
from support.training import train_with_checkpoints  # noqa: E402


def _sleeps_forever_on_rank_1() -> int:
    from prefect_sgpu import runtime

    if runtime.rank() == 1:
        time.sleep(3600)
    return runtime.rank()


def _has_checkpoint(env, run_id: str, step: int) -> bool:  # type: ignore[no-untyped-def]
    key = f"jobs/{run_id}/checkpoints/step-{step:08d}/COMPLETE"
    return env.aws.client("s3").list_objects_v2(Bucket=env.bucket, Prefix=key).get("KeyCount", 0) > 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--notice-s", type=float, default=8.0)
    parser.add_argument("--hang-timeout", type=float, default=60.0)
    parser.add_argument("--step-s", type=float, default=0.5)
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SGPU_DEVICE", "cpu")
    with offline_aws() as (aws, proxy):
        work = Path(tempfile.mkdtemp(prefix="sgpu-bench-faults-"))
        with ec2_environment(aws, create_network(aws), work / "nodes", proxy=proxy) as env:
            options = {"gpus": 2, "gpu_type": "A10", "remote": True, "mlflow": False, "timeout": 1200}
            started = time.monotonic()
            distributed(compute=env.compute(), **options)(train_with_checkpoints).distributed(step_s=args.step_s)
            baseline = time.monotonic() - started
            print(f"undisturbed: {baseline:.1f} s", flush=True)

            job = distributed(compute=env.compute(), **options)(train_with_checkpoints).job(step_s=args.step_s)
            outcome: dict = {}
            thread = threading.Thread(target=lambda: outcome.update(result=job.run()), daemon=True)
            started = time.monotonic()
            thread.start()
            while not _has_checkpoint(env, job.run_id, 20):
                time.sleep(0.2)
            node1 = next(i["InstanceId"] for i in env.instances(job.run_id, live=True) if i["AmiLaunchIndex"] == 1)
            env.simulator.reclaim(node1, after=args.notice_s)
            thread.join()
            reclaimed = time.monotonic() - started
            (recovery,) = outcome["result"].recoveries
            print(f"reclaimed: {reclaimed:.1f} s; {recovery.as_dict()}", flush=True)

        job = distributed(gpus=2, mlflow=False, hang_timeout=args.hang_timeout, timeout=1200)(
            _sleeps_forever_on_rank_1).job()
        started = time.monotonic()
        try:
            job.run()
            raise SystemExit("the hung rank was not detected")
        except JobHung:
            hung = time.monotonic() - started
        print(f"hang detected after {hung:.1f} s (hang_timeout {args.hang_timeout:g} s)", flush=True)

    load = os.getloadavg()[0]
    machine = f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()}, load {load:.1f})"
    print("\n| date | machine | step s | notice s | undisturbed s | with reclaim s | reclaim cost s "
          "| re-provisioning s | work redone s | resumed from step | hang_timeout s | JobHung after s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {dt.date.today()} | {machine} | {args.step_s:g} | {args.notice_s:g} | {baseline:.1f} | {reclaimed:.1f} "
          f"| {reclaimed - baseline:.1f} | {recovery.reprovision_s:.1f} | "
          f"{'?' if recovery.lost_work_s is None else f'{recovery.lost_work_s:.1f}'} | "
          f"{recovery.resumed_from_step} | {args.hang_timeout:g} | {hung:.1f} |")


if __name__ == "__main__":
    main()
