"""EC2 jobs cold vs on a warm lease (simulated cloud): seconds and the driver's AWS calls per job.

Runs offline, like the test suite: a moto server (``ThreadedMotoServer`` on 127.0.0.1) behind the
tests' fault proxy, a fresh VPC in 127.0.0.0/8 and bucket, real boto3 clients, and the tests' EC2
simulator, which boots each instance's real user-data as local processes (bash, the bootstrap,
the node agent, gloo ranks). The same trivial 2-node job (process group, one all_reduce) runs
through ``EC2InstanceCompute`` with ``keep_warm=0`` (cold: a job's own instances, terminated
after it) and with ``keep_warm`` (warm: the first job launches a lease, later ones are assigned
to it), alternating, every round; the warm side's first job is reported apart.

What a cold job costs here and not on AWS is small (moto answers in milliseconds); what it costs
on AWS and not here is the instance's boot (a GPU AMI takes minutes to run its user-data): the
warm side saves that too, so its ratio here is an upper bound of what it saves on EC2.

Calls are counted with botocore's events on the driver's own session (``bench/scale.py``'s
``CallCounter``); the nodes' calls are not.

    ./dev bench ec2_warm [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))


def _all_reduce() -> float:
    import torch
    import torch.distributed as dist

    from prefect_sgpu import runtime

    runtime.init_process_group()
    t = torch.tensor([float(runtime.rank())])
    dist.all_reduce(t)
    return float(t.item())


def _one(env: Any, counter: Any, compute: Any) -> tuple[float, int]:
    from prefect_sgpu import distributed

    before = sum(counter.calls.values())
    started = time.perf_counter()
    values = distributed(gpus=2, gpu_type="A10", remote=True, compute=compute, mlflow=False,
                         timeout=600)(_all_reduce).distributed()
    took = time.perf_counter() - started
    assert values == [1.0, 1.0], values
    return took, sum(counter.calls.values()) - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds after the warm side's first job")
    parser.add_argument("--quick", action="store_true", help="2 rounds (for bench all)")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    os.environ.setdefault("PREFECT_SGPU_DEVICE", "cpu")
    from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute
    from scale import CallCounter
    from support.aws_fixtures import create_network, offline_aws
    from support.conformance_ec2 import ec2_environment

    cold: list[tuple[float, int]] = []
    warm: list[tuple[float, int]] = []
    with offline_aws() as (aws, proxy):
        work = Path(tempfile.mkdtemp(prefix="sgpu-bench-ec2-warm-"))
        with ec2_environment(aws, create_network(aws), work / "nodes", proxy=proxy) as env:
            session = aws.session()
            counter = CallCounter(session)
            cold_compute = EC2InstanceCompute.from_settings({**env.settings, "keep_warm": 0}, session=session)
            warm_compute = EC2InstanceCompute.from_settings({**env.settings, "keep_warm": 600}, session=session)
            try:
                first = _one(env, counter, warm_compute)
                print(f"warm side, first job (launches the lease): {first[0]:.2f} s, {first[1]} calls", flush=True)
                for r in range(rounds):
                    cold.append(_one(env, counter, cold_compute))
                    warm.append(_one(env, counter, warm_compute))
                    print(f"round {r + 1}: cold {cold[-1][0]:.2f} s ({cold[-1][1]} calls), "
                          f"warm {warm[-1][0]:.2f} s ({warm[-1][1]} calls)", flush=True)
            finally:
                warm_compute.close()
            run_instances = len(env.sent_run_instances())

    load = os.getloadavg()[0]
    cold_s, warm_s = statistics.median(c[0] for c in cold), statistics.median(w[0] for w in warm)
    cold_calls, warm_calls = statistics.median(c[1] for c in cold), statistics.median(w[1] for w in warm)
    print(f"\n# {dt.date.today()}, {platform.node()} ({os.cpu_count()} cores, {platform.machine()}, "
          f"load {load:.1f}), {rounds} rounds; RunInstances sent in all: {run_instances} "
          f"({rounds} cold jobs + 1 lease)")
    print("| side | median s per job | × cold | driver AWS calls per job (median) |")
    print("| --- | --- | --- | --- |")
    print(f"| cold (`keep_warm=0`) | {cold_s:.2f} | 1.00 | {cold_calls:.0f} |")
    print(f"| warm lease | {warm_s:.2f} | {warm_s / cold_s:.2f} | {warm_calls:.0f} |")
    print(f"| warm, first job (launches the lease) | {first[0]:.2f} | {first[0] / cold_s:.2f} | {first[1]} |")


if __name__ == "__main__":
    main()
