"""Many small jobs at once: from one driver, from several driver processes, through a work pool.

Every job is 2 ranks that all-reduce a value of their own job (``100 * job + rank``): a
rank that joined another job's rendezvous, or a result delivered to the wrong caller,
shows up as a wrong sum, a wrong world size or a wrong tag. Used by
``tests/adapters/test_load.py`` (small) and ``bench/load.py`` (full size).

    python -m support.load driver --jobs N --tag T --out results.json   # one driver process
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
POOL_FLOW = TESTS / "support" / "load_flow.py"


def rank_work(job: int, tag: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from prefect_sgpu import runtime

    runtime.init_process_group()
    value = torch.tensor([100.0 * job + runtime.rank()])
    dist.all_reduce(value)
    return {"tag": tag, "job": job, "rank": runtime.rank(), "world": dist.get_world_size(),
            "sum": int(value.item())}


def expected_sum(job: int, ranks: int = 2) -> int:
    return sum(100 * job + r for r in range(ranks))


def check(values: list[dict[str, Any]], job: int, tag: str) -> list[str]:
    """What is wrong with one job's rank results (empty: right values, no cross-talk)."""
    problems = []
    if [v.get("rank") for v in values] != [0, 1]:
        problems.append(f"job {tag}/{job}: ranks {[v.get('rank') for v in values]}")
    for v in values:
        if (v["tag"], v["job"], v["world"], v["sum"]) != (tag, job, 2, expected_sum(job)):
            problems.append(f"job {tag}/{job}: rank {v['rank']} got {v}")
    return problems


def submit_jobs(jobs: int, tag: str) -> dict[str, Any]:
    """``jobs`` 2-rank jobs submitted at once from this process; their values, checks and times."""
    from prefect_sgpu import distributed

    fn = distributed(gpus=2, mlflow=False, timeout=900)(rank_work)
    started = time.monotonic()
    futures = [fn.submit(i, tag) for i in range(jobs)]
    results, problems, ends = [], [], []
    for i, future in enumerate(futures):
        values = future.result(timeout=1800)
        ends.append(time.monotonic() - started)
        results.append(values)
        problems += check(values, i, tag)
    return {"tag": tag, "jobs": jobs, "wall_s": time.monotonic() - started, "last_result_s": max(ends),
            "problems": problems}


def start_driver(jobs: int, tag: str, out: Path, env: dict[str, str] | None = None) -> "subprocess.Popen[bytes]":
    """A driver process of its own that submits ``jobs`` jobs and writes its report to ``out``."""
    paths = [str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]
    return subprocess.Popen(
        [sys.executable, "-m", "support.load", "driver", "--jobs", str(jobs), "--tag", tag, "--out", str(out)],
        env={**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(p for p in paths if p)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def drivers_at_once(drivers: int, jobs: int, workdir: Path) -> dict[str, Any]:
    """``drivers`` driver processes started together, ``jobs`` jobs each."""
    started = time.monotonic()
    procs = {f"d{i}": start_driver(jobs, f"d{i}", workdir / f"d{i}.json") for i in range(drivers)}
    reports, problems = {}, []
    for tag, proc in procs.items():
        out, _ = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            problems.append(f"driver {tag} exited {proc.returncode}: {out.decode(errors='replace')[-3000:]}")
            continue
        reports[tag] = json.loads((workdir / f"{tag}.json").read_text())
        problems += reports[tag]["problems"]
    return {"drivers": drivers, "jobs_each": jobs, "wall_s": time.monotonic() - started, "reports": reports,
            "problems": problems}


# -- a work pool with several workers ------------------------------------------------


def prefect_env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "5",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")) if p)}


def pool_runs(pool: str, runs: int, workers: int, limit: int, timeout_s: float = 3600) -> dict[str, Any]:
    """``runs`` flow runs of ``load_flow`` queued in an ``sgpu`` pool, served by ``workers`` worker
    processes of ``limit`` concurrent runs each; every run's state and checked values."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    env = prefect_env()
    made = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "work-pool", "create", pool, "--type",
                           "sgpu", "--overwrite"], env=env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout + made.stderr
    deployment_id = flow.from_source(source=str(POOL_FLOW.parent), entrypoint=f"{POOL_FLOW.name}:load_flow").deploy(
        name=f"{pool}-load", work_pool_name=pool, print_next_steps=False)
    with get_client(sync_client=True) as client:
        ids = [client.create_flow_run_from_deployment(deployment_id, parameters={"job": i, "tag": pool}).id
               for i in range(runs)]
    started = time.monotonic()
    logs = [tempfile.NamedTemporaryFile(prefix=f"{pool}-worker-{w}-", suffix=".log", delete=False)
            for w in range(workers)]
    procs = [subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "sgpu",
                               "--limit", str(limit), "--name", f"{pool}-worker-{w}"], env=env,
                              stdout=logs[w], stderr=subprocess.STDOUT, start_new_session=True)
             for w in range(workers)]
    try:
        states: dict[str, Any] = {}
        wanted = FlowRunFilter(id=FlowRunFilterId(any_=ids))
        with get_client(sync_client=True) as client:  # one client: each new one costs a TLS context's CPU
            while time.monotonic() - started < timeout_s:
                states = {str(r.id): r for r in client.read_flow_runs(flow_run_filter=wanted, limit=len(ids))}
                if len(states) == len(ids) and all(r.state and r.state.is_final() for r in states.values()):
                    break
                time.sleep(2)
        wall = time.monotonic() - started
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    problems = [f"flow run {r.name} (job {r.parameters.get('job')}): {r.state.name if r.state else None}"
                f" ({r.state.message if r.state else ''})"
                for r in states.values() if not (r.state and r.state.is_completed())]
    for log in logs:  # what the workers and their flow-run processes printed, where a run went wrong
        log.close()
        if problems:
            problems.append(f"{Path(log.name).name}, its end:\n{Path(log.name).read_text(errors='replace')[-4000:]}")
        os.unlink(log.name)
    durations = sorted((r.end_time - r.start_time).total_seconds() for r in states.values()
                       if r.start_time and r.end_time)
    return {"runs": runs, "workers": workers, "limit": limit, "wall_s": wall, "problems": problems,
            "run_s_median": durations[len(durations) // 2] if durations else None,
            "flow_run_ids": list(states)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["driver"])
    parser.add_argument("--jobs", type=int, required=True)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    report = submit_jobs(args.jobs, args.tag)
    Path(args.out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
