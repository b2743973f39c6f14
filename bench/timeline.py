"""Time to first step, cold and warm, and where a warm call's time goes: read from each job's timeline.

Every call runs the same small job on the local compute, one rank per simulated node: a gloo process
group, one all_reduce, then steps reported with ``runtime.progress`` for ``--tail`` seconds (the
driver's straggler watch, which reads the ranks' progress files every second, must see a step).
Sides, for each node count of ``--nodes``:

- ``cold``: ``LocalProcessCompute(keep_warm=0)``: new node agents every call (forked from the
  driver's agent template; its start is left out with each side's first call);
- ``warm``: ``LocalProcessCompute(keep_warm=...)``: a warm set whose nodes fork each job's agent (the
  first call, which starts the set, is left out).

Time to first step is the job's ``first step`` phase of its last node (every node stepped: a
collective holds the gang together), in seconds since the job began. Sides alternate within each
round, so machine load hits them alike. The last table is the median, over the warm calls of the
smallest node count, of each phase's seconds since the job began, per node.

    ./dev bench timeline [--runs 5] [--nodes 2,8] [--tail 1.5]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefect_sgpu import distributed  # noqa: E402
from prefect_sgpu.compute.local import LocalProcessCompute  # noqa: E402


def stepping(tail: float) -> int:
    """A process group, one all_reduce, then a step every 0.2 s for ``tail`` seconds."""
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


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linear between the nearest ranks."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def first_step_s(result: Any, nodes: int) -> float | None:
    """Seconds from the job's start to the last node's first step; None where a node's was not seen."""
    seen = {p.node: p.seconds for p in result.timeline if p.phase == "first step"}
    return max(seen.values()) if len(seen) == nodes else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="timed calls per side (after each side's first)")
    parser.add_argument("--nodes", default="2,8", help="node counts, comma separated (one rank each)")
    parser.add_argument("--tail", type=float, default=1.5, help="seconds each rank steps after its first step")
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SGPU_DEVICE", "cpu")
    counts = [int(n) for n in args.nodes.split(",")]
    sides: dict[tuple[int, str], Any] = {}
    computes = []
    for nodes in counts:
        for mode, keep in (("cold", 0.0), ("warm", 3600.0)):
            compute = LocalProcessCompute(keep_warm=keep)
            computes.append(compute)
            sides[(nodes, mode)] = distributed(gpus=nodes, nodes=nodes, mlflow=False, compute=compute,
                                               timeout=600)(stepping)
    firsts: dict[tuple[int, str], list[float]] = {k: [] for k in sides}
    totals: dict[tuple[int, str], list[float]] = {k: [] for k in sides}
    missed: dict[tuple[int, str], int] = {k: 0 for k in sides}
    warm_phases: list[list[Any]] = []
    started = time.time()
    try:
        for round_ in range(args.runs + 1):
            for (nodes, mode), fn in sides.items():
                began = time.monotonic()
                result = fn.run(args.tail)
                took = time.monotonic() - began
                assert result.values == list(range(nodes)), result.values
                if round_ == 0:
                    continue  # the template's or the warm set's start
                totals[(nodes, mode)].append(took)
                first = first_step_s(result, nodes)
                if first is None:
                    missed[(nodes, mode)] += 1
                else:
                    firsts[(nodes, mode)].append(first)
                if mode == "warm" and nodes == counts[0]:
                    warm_phases.append(result.timeline)
            print(f"round {round_} done at {time.time() - started:.0f}s", flush=True)
    finally:
        for compute in computes:
            compute.close()
    load = os.getloadavg()[0]
    print(f"\n{args.runs} timed call(s) per side, {platform.node()} ({os.cpu_count()} cores, "
          f"{platform.machine()}), load {load:.1f} at the end, {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print("| nodes | lease | first step p50 s | first step p95 s | call p50 s | first steps s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (nodes, mode), values in firsts.items():
        p50 = f"{percentile(values, 0.5):.2f}" if values else "-"
        p95 = f"{percentile(values, 0.95):.2f}" if values else "-"
        note = f" ({missed[(nodes, mode)]} not seen)" if missed[(nodes, mode)] else ""
        print(f"| {nodes} | {mode} | {p50} | {p95} | {statistics.median(totals[(nodes, mode)]):.2f} | "
              f"{', '.join(f'{v:.2f}' for v in values)}{note} |")
    by_phase: dict[tuple[str, Any], list[float]] = {}
    order: list[tuple[str, Any]] = []
    for line in warm_phases:
        for p in line:
            key = (p.phase, "all" if p.node is None else p.node)
            if key not in by_phase:
                by_phase[key] = []
                order.append(key)
            by_phase[key].append(p.seconds)
    order.sort(key=lambda k: statistics.median(by_phase[k]))
    print(f"\nwarm local call, {counts[0]} node(s): each phase's seconds since the job began (median of "
          f"{len(warm_phases)})")
    print("| phase | node | s (median) | s (min-max) |")
    print("| --- | --- | --- | --- |")
    for phase, node in order:
        values = by_phase[(phase, node)]
        print(f"| {phase} | {node} | {statistics.median(values):.3f} | {min(values):.3f}-{max(values):.3f} |")


if __name__ == "__main__":
    main()
