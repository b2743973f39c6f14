"""Many jobs at once on one machine (CPU ranks here; on a GPU machine each job leases its GPUs).

1. ``--jobs`` 2-rank jobs ``.submit()``-ed at once from one driver;
2. ``--drivers`` driver processes started together, ``--jobs-each`` jobs each;
3. ``--runs`` flow runs queued in an ``sgpu`` work pool served by ``--workers`` workers
   (``--limit`` concurrent flow runs each), on a temporary Prefect server.

Each job's ranks all-reduce a value of their own job; a wrong sum, world size or tag
(a rank in another job's rendezvous, a result handed to the wrong caller) is a failure.
Prints one Markdown row per part for BENCHMARKS.md.

    ./dev bench load [--jobs 20] [--drivers 2] [--jobs-each 10] [--runs 30] [--workers 2] [--limit 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from support import load  # noqa: E402


def machine() -> str:
    return f"{platform.node() or 'host'} ({os.cpu_count()} cores, {platform.machine()}, load {os.getloadavg()[0]:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--drivers", type=int, default=2)
    parser.add_argument("--jobs-each", type=int, default=10)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--skip", nargs="*", default=[], choices=["submit", "drivers", "pool"])
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SGPU_DEVICE", "cpu")
    work = Path(tempfile.mkdtemp(prefix="sgpu-load-"))
    today = dt.date.today().isoformat()
    rows, failures = [], []

    if "submit" not in args.skip:
        one = load.submit_jobs(args.jobs, "one")
        failures += one["problems"]
        rows.append(f"| {today} | {machine()} | {args.jobs} x `.submit()` from one driver | {args.jobs} | "
                    f"{one['wall_s']:.1f} | {one['wall_s'] / args.jobs:.2f} | {len(one['problems'])} |")
        print(json.dumps(one), flush=True)
    if "drivers" not in args.skip:
        many = load.drivers_at_once(args.drivers, args.jobs_each, work)
        failures += many["problems"]
        total = args.drivers * args.jobs_each
        rows.append(f"| {today} | {machine()} | {args.drivers} driver processes x {args.jobs_each} `.submit()` | "
                    f"{total} | {many['wall_s']:.1f} | {many['wall_s'] / total:.2f} | {len(many['problems'])} |")
        print(json.dumps({k: v for k, v in many.items() if k != "reports"}), flush=True)
    if "pool" not in args.skip:
        from prefect.testing.utilities import prefect_test_harness

        with prefect_test_harness(server_startup_timeout=180):
            pool = load.pool_runs(f"sgpu-load-{uuid.uuid4().hex[:8]}", args.runs, args.workers, args.limit)
        failures += pool["problems"]
        rows.append(f"| {today} | {machine()} | {args.runs} flow runs, sgpu pool, {args.workers} workers x "
                    f"limit {args.limit} | {args.runs} | {pool['wall_s']:.1f} | {pool['wall_s'] / args.runs:.2f} | "
                    f"{len(pool['problems'])} |")
        print(json.dumps({k: v for k, v in pool.items() if k != "flow_run_ids"}), flush=True)

    print("\n| date | machine | what | jobs | wall s | s per job | wrong or failed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    if failures:
        print("\n".join(failures[:50]), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
