"""Every benchmark of issue-sized comparisons, each in its quick size, one after the other.

Each runs as its own process (``./dev bench NAME`` runs the same script at full size); the
output of every one, its wall time and the total go to the terminal and to
``bench/results/all-<date>-<time>.md``. A benchmark that fails is reported and the rest
still run; the exit code is 1 if any failed.

    ./dev bench all [--only launch,mds]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (name, arguments) in the order they run; each takes well under three minutes here
QUICK = [
    ("launch", ["--quick"]),
    ("steady_state", ["--quick"]),
    ("flow_tasks", ["--quick"]),
    ("mds", ["--quick"]),
    ("scale", ["--quick"]),
    ("ec2_warm", ["--quick"]),
    ("log_shipping", []),
    ("capture", ["--quick"]),
    ("checkpoint_stall", ["--quick"]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated names (default: all)")
    args = parser.parse_args()
    only = {n.strip() for n in args.only.split(",") if n.strip()}
    unknown = only - {n for n, _ in QUICK}
    if unknown:
        parser.error(f"unknown benchmark(s) {sorted(unknown)}; known: {', '.join(n for n, _ in QUICK)}")
    started = time.perf_counter()
    report = [f"# ./dev bench all, {dt.datetime.now():%Y-%m-%d %H:%M}, {platform.node()} "
              f"({os.cpu_count()} cores, {platform.machine()}), Python {platform.python_version()}", ""]
    failed = []
    for name, extra in QUICK:
        if only and name not in only:
            continue
        print(f"== {name} {' '.join(extra)}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), *extra], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        took = time.perf_counter() - t0
        # the figures, not the libraries' chatter: table rows and the benchmark's summary lines
        words = ("median", "round", "runs", "×", "shipped", "rank log", "ratio")
        lines = [line for line in proc.stdout.splitlines()
                 if line.startswith(("|", "# ")) or line[:1].isalnum() and any(w in line for w in words)]
        print("\n".join(lines), flush=True)
        print(f"-- {name}: {'ok' if proc.returncode == 0 else f'FAILED (exit {proc.returncode})'} in {took:.0f} s",
              flush=True)
        if proc.returncode != 0:
            failed.append(name)
            print(proc.stdout[-3000:], flush=True)
        report += [f"## {name} {' '.join(extra)} ({took:.0f} s, exit {proc.returncode})", "", *lines, ""]
    total = time.perf_counter() - started
    report.append(f"total {total:.0f} s; failed: {', '.join(failed) or 'none'}")
    out = ROOT / "bench" / "results" / f"all-{dt.datetime.now():%Y%m%d-%H%M}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(report) + "\n")
    print(f"== total {total:.0f} s; failed: {', '.join(failed) or 'none'}; report: {out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
