"""Where a test run's CPU went, from its per-worker timeline (``SGPU_TEST_TIMELINE``, tests/support/timeline.py).

Each second's CPU ticks of each of the suite's processes are put under one owner:

- a **session server** by its command line (Prefect servers, Ray cluster daemons, PostgreSQL, MLflow
  servers, moto run as a process), whichever test started it;
- the **test** running on the xdist worker whose process tree the process was born in, while that
  test runs (the worker process itself: the test running on it; in-process moto, the fault proxy
  and Prefect flows are threads of the worker and count here);
- **after its test**: a process a test started, still using CPU after that test ended;
- **between tests**: a worker's own CPU, or a process born on a worker, while no test runs there
  (collection, session set-up and teardown);
- **the controller** and anything else of the suite outside the workers.

The rest of the cores' seconds (wall x cores) is idle or another program's. Per worker, the share of
the wall it spent inside a test, and the tests with the most wall time per CPU second (waiting).

    ./dev bench suite_timeline timeline.jsonl [--top 15] [--per-test cpu.json]
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict
from typing import Any

#: (session server, any of these in its command line), first match wins
SERVERS = [
    ("local agent templates (the drivers' fork servers)", ("prefect_sgpu.launch.agent_template",)),
    ("Prefect server", ("uvicorn", "prefect server start", "prefect.server")),
    ("Ray cluster daemons", ("gcs_server", "raylet", "dashboard/agent.py", "dashboard/dashboard.py",
                             "runtime_env/agent", "log_monitor.py", "monitor.py", "ray_client_server")),
    ("PostgreSQL", ("postgres:", "/bin/postgres")),
    ("MLflow server", ("mlflow server", "mlflow.server", "gunicorn")),
    ("moto server", ("moto_server", "moto.server")),
]


def server_of(cmd: str) -> str | None:
    for name, marks in SERVERS:
        if any(mark in cmd for mark in marks):
            return name
    return None


def load(path: str) -> dict[str, Any]:
    workers: dict[int, str] = {}
    controller = None
    hz, cores = 100, 1
    procs: dict[tuple[int, int], dict[str, Any]] = {}
    samples: list[tuple[float, int, int, int]] = []
    tests: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    open_tests: dict[str, tuple[float, str]] = {}
    first = last = None
    machine: list[tuple[float, int, int]] = []
    with open(path) as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a killed process
            t = rec.get("t")
            if t is not None:
                first = t if first is None else min(first, t)
                last = t if last is None else max(last, t)
            ev = rec["ev"]
            if ev == "worker":
                workers[rec["pid"]] = rec["worker"]
                if rec.get("controller"):
                    controller, hz, cores = rec["pid"], rec["hz"], rec["cores"]
            elif ev == "start":
                open_tests[rec["worker"]] = (t, rec["test"])
            elif ev == "end" and rec["worker"] in open_tests:
                begun, test = open_tests.pop(rec["worker"])
                tests[rec["worker"]].append((begun, t, test))
            elif ev == "proc":
                procs[(rec["pid"], rec["start"])] = {"ppid": rec["ppid"], "cmd": rec["cmd"], "born": t}
            elif ev == "cpu":
                samples.extend((t, pid, start, ticks) for pid, start, ticks in rec["p"])
                if "machine" in rec:
                    machine.append((t, *rec["machine"]))
    for worker, (begun, test) in open_tests.items():
        tests[worker].append((begun, last, test))
    return {"workers": workers, "controller": controller, "hz": hz, "cores": cores, "procs": procs,
            "samples": samples, "machine": machine, "tests": tests, "first": first, "last": last}


def worker_of(key: tuple[int, int], run: dict[str, Any], by_pid: dict[int, tuple[int, int]]) -> str | None:
    """The xdist worker below which this process was born (its parents as first seen)."""
    pid, seen = key[0], set()
    while pid not in seen:
        seen.add(pid)
        if pid in run["workers"] and pid != run["controller"]:
            return run["workers"][pid]
        parent = run["procs"].get(by_pid.get(pid, (0, 0)), {}).get("ppid")
        if parent is None:
            return None
        pid = parent
    return None


def test_at(intervals: list[tuple[float, float, str]], starts: list[float], t: float) -> tuple[str, float] | None:
    i = bisect.bisect_right(starts, t) - 1
    if i >= 0 and intervals[i][0] <= t <= intervals[i][1]:
        return intervals[i][2], intervals[i][1]
    return None


def summarize(run: dict[str, Any], top: int, per_test: dict[str, float] | None = None) -> str:
    """The tables; ``per_test``, when given, gets each test's CPU seconds (to set beside ``SGPU_TEST_CPU_FILE``)."""
    hz = run["hz"]
    for intervals in run["tests"].values():
        intervals.sort()
    starts = {w: [i[0] for i in iv] for w, iv in run["tests"].items()}
    owners: dict[tuple[int, int], tuple[str | None, str | None, str | None]] = {}
    by_pid = {key[0]: key for key in sorted(run["procs"], key=lambda k: run["procs"][k]["born"])}
    for key, proc in run["procs"].items():
        worker = worker_of(key, run, by_pid)
        born = test_at(run["tests"].get(worker, []), starts.get(worker, []), proc["born"]) if worker else None
        owners[key] = (server_of(proc["cmd"]), worker, born[0] if born else None)
    last_ticks: dict[tuple[int, int], int] = {}
    by_owner: dict[str, float] = defaultdict(float)
    by_test: dict[str, float] = defaultdict(float)
    after: dict[str, float] = defaultdict(float)
    server_cpu: dict[str, float] = defaultdict(float)
    last_seen: dict[tuple[int, int], float] = {}
    first_ticks: dict[tuple[int, int], int] = {}  # at the first machine reading: the suite's CPU since
    t0 = run["machine"][0][0] if run["machine"] else None
    for t, pid, start, ticks in sorted(run["samples"]):
        key = (pid, start)
        last_seen[key] = t
        if t0 is not None and t <= t0:
            first_ticks[key] = ticks
        elif t0 is not None and key not in first_ticks:
            first_ticks[key] = 0  # born after the first reading: all its ticks are inside the window
        seconds = (ticks - last_ticks.get(key, 0)) / hz
        last_ticks[key] = ticks
        server, worker, born_in = owners.get(key, (None, None, None))
        if server:
            by_owner[f"session server: {server}"] += seconds
            server_cpu[server] += seconds
            continue
        if pid == run["controller"]:
            by_owner["the controller"] += seconds
            continue
        if worker is None:
            by_owner["the suite's other processes (no worker found)"] += seconds
            continue
        now = test_at(run["tests"].get(worker, []), starts.get(worker, []), t)
        if pid in run["workers"]:
            if now:
                by_owner["tests (the worker process)"] += seconds
                by_test[now[0]] += seconds
            else:
                by_owner["between tests (the worker process)"] += seconds
        elif born_in and now and now[0] == born_in:
            by_owner["tests (processes they started)"] += seconds
            by_test[born_in] += seconds
        elif born_in:
            by_owner["after its test (processes outliving the test that started them)"] += seconds
            after[run["procs"][key]["cmd"][:90]] += seconds
        else:
            by_owner["between tests (processes started outside a test)"] += seconds
    if per_test is not None:
        per_test.update(by_test)
    wall = (run["last"] or 0) - (run["first"] or 0)
    capacity = wall * run["cores"]
    measured = sum(by_owner.values())
    out = [f"wall {wall / 60:.1f} min on {run['cores']} cores: {capacity:.0f} core-seconds; "
           f"{measured:.0f} CPU s seen in {len(run['procs'])} processes of the suite "
           f"({measured / capacity:.0%} of the cores)", "",
           "| owner | CPU s | share of the suite's CPU |", "| --- | --- | --- |"]
    out += [f"| {owner} | {seconds:.1f} | {seconds / measured:.0%} |"
            for owner, seconds in sorted(by_owner.items(), key=lambda kv: -kv[1])]
    if len(run["machine"]) > 1:
        (t0, busy0, idle0), (t1, busy1, idle1) = run["machine"][0], run["machine"][-1]
        suite = sum((ticks - first_ticks.get((pid, start), ticks)) / hz
                    for t, pid, start, ticks in run["samples"] if t0 < t <= t1 and (pid, start) in first_ticks)
        busy, idle = (busy1 - busy0) / hz, (idle1 - idle0) / hz
        out += ["", f"the machine's cores over {t1 - t0:.0f} s (/proc/stat): {busy + idle:.0f} core-seconds, "
                f"the suite {suite:.0f} ({suite / (busy + idle):.0%}), other programs {busy - suite:.0f} "
                f"({(busy - suite) / (busy + idle):.0%}), idle {idle:.0f} ({idle / (busy + idle):.0%})"]
    out += ["", "| session server | CPU s | process-seconds alive | cores per process |", "| --- | --- | --- | --- |"]
    alive: dict[str, float] = defaultdict(float)
    for key, proc in run["procs"].items():
        name = owners[key][0]
        if name and key in last_seen:
            alive[name] += last_seen[key] - proc["born"]
    for name, seconds in sorted(server_cpu.items(), key=lambda kv: -kv[1]):
        span = alive.get(name, 0.0)
        out.append(f"| {name} | {seconds:.0f} | {span:.0f} | {seconds / span if span else 0:.3f} |")
    out += ["", "| worker | tests | inside a test | CPU s of its tests |", "| --- | --- | --- | --- |"]
    for worker, intervals in sorted(run["tests"].items()):
        inside = sum(end - begin for begin, end, _ in intervals)
        cpu = sum(by_test[test] for _, _, test in intervals)
        out.append(f"| {worker} | {len(intervals)} | {inside / wall if wall else 0:.0%} | {cpu:.0f} |")
    if after:
        out += ["", "| outliving its test (command) | CPU s |", "| --- | --- |"]
        out += [f"| `{cmd}` | {seconds:.1f} |" for cmd, seconds in sorted(after.items(), key=lambda kv: -kv[1])[:top]]
    waits = []
    for intervals in run["tests"].values():
        for begin, end, test in intervals:
            if end - begin > 5:
                waits.append((end - begin, by_test[test], test))
    out += ["", f"| test (over 5 s) | wall s | CPU s | CPU per wall s |", "| --- | --- | --- | --- |"]
    for span, cpu, test in sorted(waits, key=lambda w: w[1] / w[0])[:top]:
        out.append(f"| {test} | {span:.0f} | {cpu:.0f} | {cpu / span:.2f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("timeline", help="the file SGPU_TEST_TIMELINE named")
    parser.add_argument("--top", type=int, default=15, help="rows of the per-command and per-test tables")
    parser.add_argument("--per-test", help="also write each test's CPU seconds to this JSON file")
    args = parser.parse_args()
    per_test: dict[str, float] = {}
    print(summarize(load(args.timeline), args.top, per_test))
    if args.per_test:
        with open(args.per_test, "w") as fh:
            json.dump({test: round(seconds, 2) for test, seconds in sorted(per_test.items())}, fh, indent=1)


if __name__ == "__main__":
    main()
