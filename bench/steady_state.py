"""Steady-state DDP training throughput: ``.distributed()`` vs raw ``torchrun``.

The same small MLP (built from a config; synthetic data generated inside each rank from a
fixed seed, nothing downloaded) trains with DDP on ``--ranks`` CPU ranks (gloo), run
alternately (A, B, A, B, ...) through

- A: ``distributed(gpus=RANKS, mlflow=False)(fn).distributed(cfg)`` (``runtime.init_process_group()``
  in the rank; one long-lived driver process, as a notebook or flow would call it), and
- B: ``torchrun --standalone --nproc-per-node=RANKS`` running this same file as a plain
  script (``dist.init_process_group("gloo")``, no prefect_sgpu imported in the ranks).

Throughput is measured inside the ranks over steady-state steps only: ``--warmup`` untimed
steps, a barrier, ``--steps`` timed steps, a barrier; rank 0 reports the job's samples/s
(every rank's samples over rank 0's time between the barriers). Launch, imports and
teardown are outside the timed window, so what is compared is training while the
launcher does its work beside it: tailing, tagging and echoing every rank's log (each rank
prints a line every ``--log-every`` steps, on both sides), heartbeats and the watchdogs.
``.distributed()`` returns rank 0's figure as the function's value; the torchrun script
prints it as a JSON line that is parsed here. Both sides get the same OMP_NUM_THREADS
(the local compute's default for its ranks, cores // ranks, or the caller's
OMP_NUM_THREADS if set). The result is the median of each side, their ratio (launcher /
torchrun; target >= 0.98) and the median of the per-pair ratios (each pair ran back to
back, so it is the figure least moved by load that drifts during the run).

With 2 ranks on 2 cores any other load on the machine shows up directly in samples/s, so
rank 0 also reports its CPU time per timed step and its share of a core over the window,
and the driver's own CPU time per call is printed: a launcher that cost something would
show as driver CPU or as a smaller share of a core for the ranks, not only as a lower ratio.
``.distributed()`` uses the local compute's warm nodes (ranks forked from a node process
with torch imported; ``PREFECT_SGPU_KEEP_WARM=0`` for fresh processes every call).

    ./dev bench steady_state [--runs 5] [--steps 300] [--warmup 30] [--log-every 5] [--quick]

``--quick`` (3 pairs of 60 steps, about a minute here) is what ``bench all`` runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULT_TAG = "STEADY_STATE_RESULT "


def train_steps(cfg: dict[str, Any]) -> dict[str, Any]:
    """DDP-train the MLP for ``warmup`` + ``steps`` steps in a joined process group; time the last ``steps``.

    Only torch: the same code runs under both launchers (the raw torchrun side runs this
    file, and ``.distributed()`` pickles this function by value).
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg["seed"])
    layers: list[torch.nn.Module] = []
    width = cfg["in_dim"]
    for _ in range(cfg["layers"]):
        layers += [torch.nn.Linear(width, cfg["hidden"]), torch.nn.ReLU()]
        width = cfg["hidden"]
    layers.append(torch.nn.Linear(width, cfg["classes"]))
    model = DDP(torch.nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    # synthetic data from a fixed seed, this rank's own part; labels from a fixed random teacher
    teacher = torch.randn(cfg["in_dim"], cfg["classes"], generator=torch.Generator().manual_seed(cfg["seed"]))
    xs = torch.randn(cfg["batches"], cfg["batch_size"], cfg["in_dim"],
                     generator=torch.Generator().manual_seed(cfg["seed"] + 1 + rank))
    ys = (xs @ teacher).argmax(-1)

    def step(i: int) -> torch.Tensor:
        x, y = xs[i % cfg["batches"]], ys[i % cfg["batches"]]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    def log(phase: str, i: int, total: int, loss: torch.Tensor) -> None:
        if (i + 1) % cfg["log_every"] == 0:
            # one write per line: torchrun's ranks share one unbuffered stdout, and print()'s separate
            # newline write lets two ranks' lines run into each other
            print(f"rank {rank} {phase} step {i + 1}/{total} loss {loss.item():.4f}\n", end="", flush=True)

    for i in range(cfg["warmup"]):
        log("warmup", i, cfg["warmup"], step(i))
    dist.barrier()
    started, cpu_started = time.perf_counter(), time.process_time()
    for i in range(cfg["steps"]):
        loss = step(cfg["warmup"] + i)
        log("timed", i, cfg["steps"], loss)
    dist.barrier()
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu_started  # this rank's CPU (all its threads) in the timed window
    return {"samples_per_s": cfg["steps"] * cfg["batch_size"] * world / elapsed, "seconds": elapsed,
            "cpu_ms_per_step": 1000 * cpu / cfg["steps"], "cpu_share": cpu / elapsed,
            "threads": torch.get_num_threads(), "world": world, "loss": float(loss.item())}


def launcher_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """What ``.distributed()`` runs on every rank."""
    from prefect_sgpu import runtime

    runtime.init_process_group()
    return train_steps(cfg)


def torchrun_rank(cfg: dict[str, Any]) -> None:
    """What raw torchrun runs on every rank (this file as a script): rank 0 prints a JSON line."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = train_steps(cfg)
    if dist.get_rank() == 0:
        print(RESULT_TAG + json.dumps(out) + "\n", end="", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="pairs of runs (one of each side per pair)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300, help="timed steady-state steps per run")
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps before the timed ones")
    parser.add_argument("--log-every", type=int, default=5, help="each rank prints a line every N steps")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="3 pairs of 60 steps (for `bench all`)")
    parser.add_argument("--torchrun-rank", metavar="CFG", help=argparse.SUPPRESS)  # this file as torchrun's script
    args = parser.parse_args()
    if args.torchrun_rank:
        torchrun_rank(json.loads(args.torchrun_rank))
        return
    if args.quick:
        args.runs, args.steps, args.warmup = 3, 60, 10

    # CPU ranks with gloo on both sides, on any machine (the model lives on the CPU)
    os.environ["PREFECT_SGPU_DEVICE"] = "cpu"
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // args.ranks))
    cfg = {"seed": 0, "in_dim": 256, "hidden": args.hidden, "layers": args.layers, "classes": 10,
           "batch_size": args.batch_size, "batches": 16, "warmup": args.warmup, "steps": args.steps,
           "log_every": args.log_every}

    # imported here, not at the top: torchrun's ranks run this file and stay free of prefect_sgpu
    from prefect_sgpu import distributed
    from prefect_sgpu.compute.local import default_keep_warm

    fn = distributed(gpus=args.ranks, mlflow=False, env={"OMP_NUM_THREADS": threads})(launcher_rank)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
                str(Path(__file__).resolve()), "--torchrun-rank", json.dumps(cfg)]
    raw_env = {**os.environ, "OMP_NUM_THREADS": threads, "CUDA_VISIBLE_DEVICES": ""}

    expected_lines = args.ranks * (args.warmup // args.log_every + args.steps // args.log_every)
    load_start = os.getloadavg()[0]
    ours: list[float] = []
    raw: list[float] = []
    ours_wall: list[float] = []
    ours_cpu: list[float] = []  # the driver's own CPU time (all its threads) per call
    raw_wall: list[float] = []
    ours_lines: list[int] = []
    raw_lines: list[int] = []
    seen_threads: set[int] = set()
    ours_rank0: list[dict[str, Any]] = []  # rank 0's whole report, for its CPU figures
    raw_rank0: list[dict[str, Any]] = []
    for _ in range(args.runs):
        # A: the launcher. Its echo of the rank lines (print to sys.stdout in the driver) goes
        # into a buffer, so the lines can be counted and do not flood this report.
        echoed = io.StringIO()
        t0, cpu0 = time.perf_counter(), time.process_time()
        with contextlib.redirect_stdout(echoed):
            values = fn.distributed(cfg)
        ours_wall.append(time.perf_counter() - t0)
        ours_cpu.append(time.process_time() - cpu0)
        ours.append(values[0]["samples_per_s"])
        ours_rank0.append(values[0])
        seen_threads.update(v["threads"] for v in values)
        ours_lines.append(sum(1 for line in echoed.getvalue().splitlines() if " step " in line))

        # B: raw torchrun, output piped to this process
        t0 = time.perf_counter()
        proc = subprocess.run(torchrun, env=raw_env, capture_output=True, text=True)
        raw_wall.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"torchrun failed with exit code {proc.returncode}")
        found = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
        if len(found) != 1:
            raise SystemExit(f"torchrun printed {len(found)} result lines, expected 1:\n{proc.stdout[-2000:]}")
        out = json.loads(found[0][len(RESULT_TAG):])
        raw.append(out["samples_per_s"])
        raw_rank0.append(out)
        seen_threads.add(out["threads"])
        raw_lines.append(sum(1 for line in proc.stdout.splitlines() if " step " in line))

    m_ours, m_raw = statistics.median(ours), statistics.median(raw)
    pair = statistics.median(a / b for a, b in zip(ours, raw))
    load = os.getloadavg()[0]

    import torch

    import prefect
    import prefect_sgpu

    model = f"MLP 256-{args.hidden}x{args.layers}-10"
    print(f"# steady-state DDP throughput, {dt.date.today()} on {platform.node()} ({os.cpu_count()} cores, "
          f"{platform.machine()}), Python {platform.python_version()}, torch {torch.__version__}, "
          f"prefect {prefect.__version__}, prefect_sgpu {prefect_sgpu.__version__}")
    print(f"runs: {args.runs} pairs alternating, {args.ranks} CPU ranks (gloo), OMP_NUM_THREADS={threads} "
          f"(torch threads seen in ranks: {sorted(seen_threads)}), {model}, batch {args.batch_size}/rank, "
          f"{args.warmup} warm-up + {args.steps} timed steps, a line every {args.log_every} steps, "
          f"launcher keep_warm {default_keep_warm():g} s (PREFECT_SGPU_KEEP_WARM=0: fresh node processes per call)")
    print(f"rank lines per run (expected {expected_lines}): launcher echoed {ours_lines}, torchrun printed {raw_lines}")
    print(f".distributed() samples/s: {[round(x, 1) for x in ours]}")
    print(f"raw torchrun   samples/s: {[round(x, 1) for x in raw]}")
    print(f"rank 0 CPU ms per timed step: .distributed() {[round(r['cpu_ms_per_step'], 1) for r in ours_rank0]}, "
          f"torchrun {[round(r['cpu_ms_per_step'], 1) for r in raw_rank0]}; its share of a core over the timed "
          f"window: .distributed() {[round(r['cpu_share'], 2) for r in ours_rank0]}, torchrun "
          f"{[round(r['cpu_share'], 2) for r in raw_rank0]} (below 1: the rank waited for a core or its peer)")
    print(f"wall s per call (launch included, for context): .distributed() median "
          f"{statistics.median(ours_wall):.1f}, torchrun median {statistics.median(raw_wall):.1f}; the driver's "
          f"own CPU s per call (launch, log tailing, heartbeats; median) {statistics.median(ours_cpu):.2f}")
    print(f"median .distributed() {m_ours:.1f} samples/s, raw torchrun {m_raw:.1f} samples/s, ratio of medians "
          f"{m_ours / m_raw:.3f}, median pairwise ratio {pair:.3f} (target >= 0.98), "
          f"load average {load_start:.1f} at start, {load:.1f} at end")
    print("| date | machine | ranks | threads/rank | model | batch/rank | timed steps | `.distributed()` samples/s "
          "| torchrun samples/s | ratio | pairwise ratio |")
    print(f"| {dt.date.today()} | {platform.node()} ({os.cpu_count()} cores, {platform.machine()}, load {load:.1f}) | "
          f"{args.ranks} | {threads} | {model} | {args.batch_size} | {args.steps} | {m_ours:.1f} | {m_raw:.1f} | "
          f"{m_ours / m_raw:.3f} | {pair:.3f} |")


if __name__ == "__main__":
    main()
