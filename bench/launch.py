"""Launch overhead: ``.distributed()`` of a trivial 2-rank job vs raw ``torchrun``.

Both run the same work (init a gloo/nccl process group, one all_reduce, tear down).
Runs alternate (A, B, A, B, ...) so drift in machine load hits both; the result is the
median of each, their ratio, and the median of the per-pair ratios (the figure least
moved by load that changes during the run). ``.distributed()`` is timed in one
long-lived driver process, as a user's notebook or flow would call it.

    ./dev bench launch [--runs 7] [--mlflow]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefect_sgpu import distributed  # noqa: E402

WORK = """
import torch, torch.distributed as dist
dist.init_process_group("nccl" if torch.cuda.is_available() and {gpu} else "gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
"""


def trivial() -> float:
    import torch
    import torch.distributed as dist

    from prefect_sgpu import runtime

    runtime.init_process_group()
    t = torch.ones(1, device=runtime.device())
    dist.all_reduce(t)
    return float(t.item())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--mlflow", action="store_true", help="open an MLflow run per call, as by default")
    parser.add_argument("--gpus", type=int, default=2)
    args = parser.parse_args()

    gpu = os.environ.get("PREFECT_SGPU_DEVICE", "") != "cpu"
    script = Path(tempfile.mkdtemp()) / "trivial.py"
    script.write_text(WORK.format(gpu=gpu))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={args.gpus}", str(script)]
    fn = distributed(gpus=args.gpus, mlflow=args.mlflow)(trivial)

    fn.distributed()  # warm the driver (imports) once, as a long-lived caller would be
    subprocess.run(torchrun, check=True, capture_output=True)
    ours, raw = [], []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        assert fn.distributed() == [float(args.gpus)] * args.gpus
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        subprocess.run(torchrun, check=True, capture_output=True)
        raw.append(time.perf_counter() - t0)
    m_ours, m_raw = statistics.median(ours), statistics.median(raw)
    # each pair ran back to back, so its ratio is the least disturbed by load that drifts over the run
    pair = statistics.median(a / b for a, b in zip(ours, raw))
    load = os.getloadavg()[0]
    print(f"runs: {args.runs} alternating, {args.gpus} ranks, mlflow={'on' if args.mlflow else 'off'}")
    print(f".distributed() s: {[round(x, 2) for x in ours]}")
    print(f"raw torchrun   s: {[round(x, 2) for x in raw]}")
    print(f"median .distributed() {m_ours:.2f} s, raw torchrun {m_raw:.2f} s, ratio of medians "
          f"{m_ours / m_raw:.3f}, median pairwise ratio {pair:.3f}, load average {load:.1f}")
    print(f"| {dt.date.today()} | {platform.node()} ({os.cpu_count()} cores, {platform.machine()}, load {load:.1f}) | "
          f"{args.gpus} | {'on' if args.mlflow else 'off'} | {m_ours:.2f} | {m_raw:.2f} | {m_ours / m_raw:.3f} | "
          f"{pair:.3f} |")


if __name__ == "__main__":
    main()
