"""Time to first step on simulated EC2 nodes: cold, cached environment, and warm lease.

Runs offline, like the test suite and ``bench/ec2_warm.py``: a moto server behind the tests' fault
proxy, a fresh VPC and bucket, real boto3 clients, and the tests' EC2 simulator booting each
instance's real user-data on a *bare image* (Python and pip only: the user-data's environment stage
builds the job's environment). One rank per node: a gloo process group, one all_reduce, then steps
reported with ``runtime.progress`` (``bench/timeline.py``'s job). Sides, for each node count:

- ``cold``: ``keep_warm=0`` and an empty environment folder on every node (a fresh simulator per
  call): each boot builds the job's environment (uv, offline from the machine's uv cache);
- ``cached``: ``keep_warm=0``, the nodes' environment folder already holding the built environment
  (the folder a previous boot, or an environment pack unpacked from the store, leaves): the stage
  checks it and installs nothing;
- ``warm``: ``keep_warm=600``: a lease's nodes (the first call, which launches the lease, left out).

Time to first step is read from each call's own ``result.timeline``: the ``first step`` phase of its
last node, in seconds since the job began. The simulator boots instances in milliseconds where EC2
takes minutes to run a GPU AMI's user-data: the boot itself is not in these numbers.

    ./dev bench ec2_timeline [--runs 3] [--nodes 2,8] [--sides cold,cached,warm]
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

from timeline import first_step_s, percentile  # noqa: E402

SIDES = ("cold", "cached", "warm")


def stepping(tail: float) -> int:
    """``bench/timeline.py``'s job, defined here so that it travels by value (the nodes do not have
    ``bench/`` on their path)."""
    import torch
    import torch.distributed as dist

    from prefect_sgpu import runtime

    runtime.init_process_group()
    t = torch.ones(1)
    dist.all_reduce(t)
    steps = max(1, int(tail / 0.2))
    for step in range(1, steps + 1):
        runtime.progress(step, total=steps, force=step == 1)
        time.sleep(0.2)
    return runtime.rank()


def job_args(nodes: int) -> dict[str, Any]:
    """One A10 rank on each of ``nodes`` machines (g5.xlarge). ``nodes`` is said: without it the planner
    takes the fewest machines (8 A10 GPUs: one g5.48xlarge running 8 ranks, one node in the timeline)."""
    return {"gpus": nodes, "nodes": nodes, "gpu_type": "A10", "remote": True, "mlflow": False, "timeout": 1800}


def _call(compute: Any, nodes: int, tail: float) -> tuple[float | None, float]:
    from prefect_sgpu import distributed

    began = time.monotonic()
    result = distributed(compute=compute, **job_args(nodes))(stepping).run(tail)
    took = time.monotonic() - began
    assert result.values == list(range(nodes)), result.values
    assert result.plan.nodes == nodes, f"{result.plan.nodes} node(s) of {result.plan.instance_type.name} ran"
    return first_step_s(result, nodes), took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="timed calls per side and node count")
    parser.add_argument("--nodes", default="2,8", help="node counts, comma separated (one rank each)")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"sides to run, of {', '.join(SIDES)}")
    parser.add_argument("--tail", type=float, default=6.0, help="seconds each rank steps after its first step (the driver reads the ranks' steps "
                             "while they run; a node ships ranks other than 0 every 3 s)")
    args = parser.parse_args()
    sides = [s for s in args.sides.split(",") if s]
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        parser.error(f"--sides: {unknown} not known; allowed: {', '.join(SIDES)}")
    counts = [int(n) for n in args.nodes.split(",")]
    os.environ.setdefault("PREFECT_SGPU_DEVICE", "cpu")
    os.environ.setdefault("PREFECT_SGPU_LIVE", "0")
    from support.aws_fixtures import create_network, offline_aws
    from support.conformance_ec2 import ec2_environment

    firsts: dict[tuple[int, str], list[float]] = {(n, s): [] for n in counts for s in sides}
    calls: dict[tuple[int, str], list[float]] = {(n, s): [] for n in counts for s in sides}
    loads: list[float] = [os.getloadavg()[0]]
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="sgpu-bench-ec2-timeline-"))
    def record(nodes: int, side: str, run: int, first: float | None, took: float) -> None:
        calls[(nodes, side)].append(took)
        if first is not None:
            firsts[(nodes, side)].append(first)
        loads.append(os.getloadavg()[0])
        print(f"run {run + 1}, {nodes} nodes, {side}: first step {first} s, call {took:.1f} s "
              f"(load {loads[-1]:.1f})", flush=True)

    with offline_aws() as (aws, proxy):
        network = create_network(aws)
        # cold calls first, each with a simulator of its own (an empty environment folder): an environment
        # checks at its end that no instance of the region is left, which a warm lease's would be
        if "cold" in sides:
            for run in range(args.runs):
                for nodes in counts:
                    folder = work / f"cold-{nodes}-{run}"
                    with ec2_environment(aws, network, folder, proxy=proxy, env_root=folder / "envs") as cold:
                        record(nodes, "cold", run, *_call(cold.compute(keep_warm=0), nodes, args.tail))
        if "cached" in sides or "warm" in sides:
            with ec2_environment(aws, network, work / "kept", proxy=proxy, env_root=work / "kept-envs") as env:
                cached, warm = env.compute(keep_warm=0), env.compute(keep_warm=600)
                try:
                    _call(cached, counts[0], args.tail)  # untimed: builds the environment in the nodes' folder
                    if "warm" in sides:
                        for nodes in counts:
                            _call(warm, nodes, args.tail)  # untimed: launches the lease
                    print(f"setup done at {time.time() - started:.0f}s", flush=True)
                    for run in range(args.runs):
                        for nodes in counts:
                            for side in ("cached", "warm"):
                                if side in sides:
                                    record(nodes, side, run,
                                           *_call(cached if side == "cached" else warm, nodes, args.tail))
                finally:
                    warm.close()
    print(f"\n{args.runs} timed call(s) per side, {platform.node()} ({os.cpu_count()} cores, {platform.machine()}), "
          f"{dt.datetime.fromtimestamp(started, dt.timezone.utc):%Y-%m-%d %H:%M}-"
          f"{dt.datetime.now(dt.timezone.utc):%H:%M} UTC, load average {min(loads):.1f}-{max(loads):.1f} "
          f"(median {statistics.median(loads):.1f})")
    print("| nodes | side | first step p50 s | first step p95 s | call p50 s | first steps s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (nodes, side), values in firsts.items():
        p50 = f"{percentile(values, 0.5):.2f}" if values else "-"
        p95 = f"{percentile(values, 0.95):.2f}" if values else "-"
        missed = len(calls[(nodes, side)]) - len(values)
        note = f" ({missed} not seen)" if missed else ""
        print(f"| {nodes} | {side} | {p50} | {p95} | {statistics.median(calls[(nodes, side)]):.2f} | "
              f"{', '.join(f'{v:.2f}' for v in values)}{note} |")


if __name__ == "__main__":
    main()
