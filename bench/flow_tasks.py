"""A flow of ten small GPU tasks: cold launches vs warm nodes vs the same work as ten raw torchruns.

Each task is the trivial 2-rank job (init the process group, one all_reduce). Sides, one
after the other in every round:

- ``flow-cold``: a Prefect flow with ``GPUTaskRunner(compute=LocalProcessCompute(keep_warm=0))``:
  every task starts its node agent and rank interpreters;
- ``flow-warm``: the same flow with the runner's default local compute held warm: the first
  task starts the warm node, the other nine fork from it; the runner closes it when the
  flow ends (inside the timed flow);
- ``torchrun-x10``: ten ``torchrun --standalone --nproc-per-node=2`` calls of the same work,
  no Prefect.

A temporary Prefect server (``prefect_test_harness``) serves every flow run; its start is
left out. Figures: the median wall time of each side over the rounds, and its ratio to ten
raw torchruns.

    ./dev bench flow_tasks [--runs 3] [--tasks 10] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORK = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="one round (for ./dev bench all)")
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    os.environ.setdefault("PREFECT_SGPU_DEVICE", "cpu")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"

    from prefect import flow
    from prefect.testing.utilities import prefect_test_harness

    from prefect_sgpu import GPUTaskRunner, gpu_task, runtime
    from prefect_sgpu.compute.local import LocalProcessCompute

    @gpu_task(gpus=2, mlflow=False)
    def step(i: int) -> float:
        import torch
        import torch.distributed as dist

        runtime.init_process_group()
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t.item()) + i

    def make_flow(compute: object | None, tasks: int):  # noqa: ANN202 - a Prefect flow
        @flow(task_runner=GPUTaskRunner(compute=compute), log_prints=False)
        def ten_tasks() -> list[float]:
            return [step(i) for i in range(tasks)]

        return ten_tasks

    script = Path(tempfile.mkdtemp()) / "trivial.py"
    script.write_text(WORK)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    expected = [2.0 + i for i in range(args.tasks)]
    times: dict[str, list[float]] = {"flow-cold": [], "flow-warm": [], "torchrun-x10": []}
    with prefect_test_harness(server_startup_timeout=120):
        cold_flow = make_flow(LocalProcessCompute(keep_warm=0), args.tasks)
        os.environ["PREFECT_SGPU_KEEP_WARM"] = "600"  # the runner's own local compute: warm for the flow
        warm_flow = make_flow(None, args.tasks)
        assert warm_flow() == expected  # the engine's and the driver's imports, once, left out
        for _ in range(runs):
            t0 = time.perf_counter()
            assert cold_flow() == expected
            times["flow-cold"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert warm_flow() == expected
            times["flow-warm"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(args.tasks):
                subprocess.run(torchrun, check=True, capture_output=True)
            times["torchrun-x10"].append(time.perf_counter() - t0)
    load = os.getloadavg()[0]
    medians = {k: statistics.median(v) for k, v in times.items()}
    base = medians["torchrun-x10"]
    from importlib.metadata import version

    print(f"{runs} round(s), {args.tasks} tasks of 2 ranks; Python {platform.python_version()}, "
          f"torch {version('torch')}, prefect {version('prefect')}")
    print("| side | median s | runs s | s per task | × raw torchrun |")
    print("| --- | --- | --- | --- | --- |")
    for name, values in times.items():
        print(f"| {name} | {medians[name]:.1f} | {', '.join(f'{v:.1f}' for v in values)} | "
              f"{medians[name] / args.tasks:.2f} | {medians[name] / base:.2f} |")
    print(f"| {dt.date.today()} | {platform.node()} ({os.cpu_count()} cores, {platform.machine()}, load {load:.1f}) | "
          f"{args.tasks} | {runs} | {medians['flow-cold']:.1f} | {medians['flow-warm']:.1f} | {base:.1f} | "
          f"{medians['flow-warm'] / medians['flow-cold']:.2f} |")


if __name__ == "__main__":
    main()
