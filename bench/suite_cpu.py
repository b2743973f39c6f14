"""Where the test suite's CPU goes, by kind of process (Linux only).

The suite on two cores is CPU-bound: its wall time is about its CPU seconds over two. This runs a
command (default: ``./dev test -q``) as a child subreaper, so every process it starts stays below
it even when its parent exits, and reads ``/proc`` every ``--every`` seconds: each process's CPU
seconds (user + system, its own, not its children's) under the kind its command line names
(node agents and the ranks they fork, EC2 node processes, Ray, Prefect servers, xdist workers,
...). A process that lives less than one interval is missed and a process's last interval is
lost, so the totals are a lower bound; the ``measured`` line says how much of the command's own
children-CPU total the table accounts for.

Memory is read at the same time: the machine's used memory (``MemTotal - MemAvailable``) and the
resident memory of the command's processes by kind. The second table is the moment the machine's
used memory peaked. Resident sizes count pages shared between processes (forked ranks, one
interpreter's libraries) once per process, so they add up to more than the machine holds.

    ./dev bench suite_cpu [--every 0.5] [-- COMMAND ...]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PR_SET_CHILD_SUBREAPER = 36

#: (kind, any of these in the command line), first match wins; forked ranks keep their agent's line
KINDS = [
    ("local node agents and their forked ranks", ("prefect_sgpu.launch.node_agent", "prefect_sgpu.launch.warm_node")),
    ("spawned ranks", ("prefect_sgpu.launch.rank_main",)),
    ("EC2 and remote node processes", ("prefect_sgpu.launch.", "driver.py {")),
    ("Ray (raylets, GCS, workers, agents)", ("raylet", "gcs_server", "default_worker", "ray/_private", "ray::",
                                             "ray.scripts", "dashboard")),
    ("Prefect servers", ("uvicorn", "prefect server", "prefect.server")),
    ("Prefect workers and flow-run processes", ("prefect worker", "prefect.runner", "prefect --no-prompt",
                                                "prefect.engine", "prefect_sgpu.cli worker")),
    ("moto servers", ("moto",)),
    ("MLflow", ("mlflow",)),
    ("xdist workers (the tests' own processes)", ("exec(eval(sys.stdin.readline()))",)),
    ("pytest controller", ("pytest",)),
    ("compilers and builds", ("cc1plus", "ninja", " c++ ", "ld ")),
]


def kind_of(cmdline: str) -> str:
    for kind, marks in KINDS:
        if any(mark in cmdline for mark in marks):
            return kind
    return "other: " + (cmdline.split(" ", 1)[0].rsplit("/", 1)[-1] or "?")


def descendants(root: int) -> dict[int, tuple[str, str]]:
    """pid -> (start time, stat line) of every live process below ``root``."""
    parents: dict[int, int] = {}
    stats: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        parents[int(entry)], stats[int(entry)] = int(fields[1]), stat
    below: dict[int, tuple[str, str]] = {}
    for pid, stat in stats.items():
        seen, up = set(), parents.get(pid)
        while up is not None and up not in seen and up > 1:
            if up == root:
                fields = stat[stat.rfind(")") + 2:].split()
                below[pid] = (fields[19], stat)
                break
            seen.add(up)
            up = parents.get(up)
    return below


def _meminfo() -> dict[str, int]:
    lines = Path("/proc/meminfo").read_text().splitlines()
    return {line.split(":")[0]: int(line.split()[1]) for line in lines}


def used_memory_gib() -> float:
    info = _meminfo()
    return (info["MemTotal"] - info["MemAvailable"]) / 2**20


def total_memory_gib() -> float:
    return _meminfo()["MemTotal"] / 2**20


def print_table(columns: list[str], by_kind: dict[str, float], least: float, cells: Any) -> None:
    """A markdown table of ``by_kind``, largest first, rows under ``least`` left out."""
    print("| kind of process | " + " | ".join(columns) + " |\n|" + " --- |" * (len(columns) + 1))
    for kind, value in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        if value >= least:
            print(f"| {kind} | " + " | ".join(cells(value)) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=float, default=0.5, help="seconds between two readings of /proc")
    parser.add_argument("command", nargs="*", default=["./dev", "test", "-q"])
    args = parser.parse_args()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit("this needs Linux's child subreaper (prctl PR_SET_CHILD_SUBREAPER)")
    hz = os.sysconf("SC_CLK_TCK")
    cpu: dict[tuple[int, str], list] = {}  # (pid, start) -> [kind, seconds]
    started = time.monotonic()
    child = subprocess.Popen(args.command, cwd=ROOT)
    me = os.getpid()
    page = os.sysconf("SC_PAGE_SIZE")
    peak_used, peak_rss, peak_at = 0.0, {}, 0.0
    code = None
    while code is None:
        rss: dict[str, float] = {}
        for pid, (start, stat) in descendants(me).items():
            fields = stat[stat.rfind(")") + 2:].split()
            seconds = (int(fields[11]) + int(fields[12])) / hz
            key = (pid, start)
            if key not in cpu:
                try:
                    line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                cpu[key] = [kind_of(line), seconds]
            cpu[key][1] = max(cpu[key][1], seconds)
            rss[cpu[key][0]] = rss.get(cpu[key][0], 0.0) + int(fields[21]) * page / 2**30
        used = used_memory_gib()
        if used > peak_used:
            peak_used, peak_rss, peak_at = used, rss, time.monotonic() - started
        # the command and the orphans re-parented to this subreaper are all reaped here
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == child.pid:
                code = os.waitstatus_to_exitcode(status)
                break
        time.sleep(args.every)
    wall = time.monotonic() - started
    total: dict[str, float] = {}
    for kind, seconds in cpu.values():
        total[kind] = total.get(kind, 0.0) + seconds
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    measured = sum(total.values())
    print(f"\n{' '.join(args.command)}: exit {code}, {wall / 60:.1f} min wall, {platform.node()}, "
          f"{os.cpu_count()} cores, {date.today()}")
    print(f"measured {measured:.0f} CPU s in {len(cpu)} processes; the kernel counts "
          f"{children.ru_utime + children.ru_stime:.0f} CPU s for all reaped descendants")
    print_table(["CPU s", "share"], total, 1.0, lambda seconds: [f"{seconds:.0f}", f"{seconds / measured:.0%}"])
    print(f"\nthe machine's used memory peaked at {peak_used:.1f} GiB of {total_memory_gib():.1f}, "
          f"{peak_at / 60:.1f} min in; resident memory of the command's processes then:")
    print_table(["GiB"], peak_rss, 0.05, lambda gib: [f"{gib:.1f}"])
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
