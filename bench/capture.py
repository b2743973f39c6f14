"""What capturing the driver's environment costs a remote job (``./dev bench capture``).

Every job on a remote compute (EC2, Ray) captures the driver's environment before anything is
spent: its distributions, and the files of its editable and local packages, hashed. The first
capture in a process reads every installed distribution's metadata; the next ones read it again
only when ``sys.path`` or a folder on it changed, and hash the travelling files each time.

    ./dev bench capture [--repeat 10] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import resource
import time


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 repeats")
    args = parser.parse_args()
    repeat = 3 if args.quick else args.repeat

    from prefect_sgpu.environment import capture

    rows = []
    for i in range(repeat + 1):
        cpu, wall = _cpu(), time.perf_counter()
        env = capture()
        rows.append((_cpu() - cpu, time.perf_counter() - wall))
        if i == 0:
            files = sum(len(t.files) for t in env.local_packages)
            print(f"{len(env.distributions)} distributions, {files} travelling files, digest {env.digest[:12]}")
    first, rest = rows[0], rows[1:]
    median = sorted(rest)[len(rest) // 2]
    print(f"{dt.date.today()} {platform.node()} ({platform.machine()}, Python {platform.python_version()})")
    print("| capture | CPU s | wall s |\n| --- | --- | --- |")
    print(f"| first in the process | {first[0]:.3f} | {first[1]:.2f} |")
    print(f"| next (median of {len(rest)}) | {median[0]:.3f} | {median[1]:.2f} |")


if __name__ == "__main__":
    main()
