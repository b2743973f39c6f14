"""Warm allocations of the local compute: reuse, isolation between jobs, and every way they end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from prefect_sgpu import LaunchTimeout, distributed, runtime
from prefect_sgpu.compute.local import LocalProcessCompute
from prefect_sgpu.compute.warm_pool import POOL
from prefect_sgpu.errors import SGPUConfigError
from support.conformance import warm_node_descendants
from support.processes import warm_node_pids

pytestmark = pytest.mark.e2e

MARK = "3000.25"  # a leftover daemon's sleep argument: no other process on the machine sleeps this long


@pytest.fixture
def compute() -> Iterator[LocalProcessCompute]:
    compute = LocalProcessCompute(keep_warm=60)
    yield compute
    compute.close()


def _wait_until(check: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return bool(check())


def _dirty_the_node(scratch: str) -> dict[str, Any]:
    """Job 1: leave every kind of state a rank can leave behind."""
    import json

    import torch
    import torch.distributed as dist

    runtime.init_process_group()
    os.environ["SGPU_LEFT_BEHIND"] = "1"
    json.left_behind = True  # type: ignore[attr-defined]  # a global of a module the warm node imported
    os.chdir(scratch)
    Path(f"/dev/shm/sgpu-left-behind-{runtime.rank()}").write_text("x")
    subprocess.Popen(["sleep", MARK], start_new_session=True)  # a daemon that outlives its rank
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"pid": os.getpid(), "sum": t.item()}


def _look_for_it(scratch: str) -> dict[str, Any]:
    """Job 2 on the same warm nodes: what of job 1 is visible?"""
    import json

    preloaded = "torch" in sys.modules  # before this job imports anything
    import torch
    import torch.distributed as dist

    seen = {
        "preloaded": preloaded,
        "process_group": dist.is_initialized(),
        "cuda": torch.cuda.is_initialized(),
        "env": os.environ.get("SGPU_LEFT_BEHIND"),
        "module_global": hasattr(json, "left_behind"),
        "cwd": os.getcwd(),
        "shm": sorted(p.name for p in Path("/dev/shm").glob("sgpu-left-behind-*")),
        "daemons": [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _is_mark(p)],
        "pid": os.getpid(),
    }
    runtime.init_process_group()
    t = torch.ones(1)
    dist.all_reduce(t)
    seen["sum"] = t.item()
    return seen


def _is_mark(proc: Path) -> bool:
    try:
        return MARK in (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def test_a_warm_job_reuses_the_nodes_and_sees_nothing_of_the_job_before(compute: LocalProcessCompute,
                                                                          tmp_path: Path) -> None:
    options = {"gpus": 2, "nodes": 2, "mlflow": False, "compute": compute}
    first = distributed(**options)(_dirty_the_node).job(str(tmp_path)).run()
    assert [v["sum"] for v in first.values] == [2.0, 2.0]
    (warm,) = [w for w in POOL.idle() if w.owner == id(compute)]
    assert warm.jobs == 1
    nodes = [n.pid for n in warm.nodes]

    second = distributed(**options)(_look_for_it).job(str(tmp_path)).run()
    assert [w for w in POOL.idle() if w.owner == id(compute)] == [warm] and warm.jobs == 2
    assert [n.pid for n in warm.nodes] == nodes, "the same warm node processes ran both jobs"
    for seen in second.values:
        assert seen["preloaded"], "a warm rank starts with torch imported"
        assert seen["sum"] == 2.0
        assert not seen["process_group"] and not seen["cuda"]
        assert seen["env"] is None and not seen["module_global"]
        assert seen["cwd"] == os.getcwd() != str(tmp_path)
        assert seen["shm"] == [] and seen["daemons"] == []
    assert {v["pid"] for v in second.values}.isdisjoint(v["pid"] for v in first.values)
    assert warm_node_descendants() == []


def test_the_default_local_compute_is_warm_between_calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PREFECT_SGPU_KEEP_WARM")
    assert LocalProcessCompute().keep_warm == 120
    fn = distributed(gpus=2, mlflow=False)(_look_for_it)
    try:
        fn.distributed(str(tmp_path))
        again = fn.distributed(str(tmp_path))
        assert all(seen["preloaded"] for seen in again)
    finally:
        POOL.close()
    assert _wait_until(lambda: warm_node_pids() == [])


def test_keep_warm_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SGPUConfigError, match="keep_warm"):
        LocalProcessCompute(keep_warm=-1)
    monkeypatch.setenv("PREFECT_SGPU_KEEP_WARM", "soon")
    with pytest.raises(SGPUConfigError, match="PREFECT_SGPU_KEEP_WARM"):
        LocalProcessCompute()


class Diverged(Exception):
    pass


def _fails_on_rank_1() -> int:
    if runtime.rank() == 1:
        raise Diverged("rank 1 diverged")
    return runtime.rank()


def _forever() -> None:
    time.sleep(600)


def _rank() -> int:
    return runtime.rank()


def test_failed_and_timed_out_jobs_leave_the_nodes_ready_for_the_next(compute: LocalProcessCompute) -> None:
    options = {"gpus": 2, "mlflow": False, "compute": compute}
    with pytest.raises(Diverged, match="rank 1 diverged"):
        distributed(**options)(_fails_on_rank_1).distributed()
    (warm,) = [w for w in POOL.idle() if w.owner == id(compute)]
    with pytest.raises(LaunchTimeout):
        distributed(**{**options, "timeout": 8})(_forever).distributed()
    assert [w for w in POOL.idle() if w.owner == id(compute)] == [warm] and warm.jobs == 2
    assert warm_node_descendants() == []
    assert distributed(**options)(_rank).distributed() == [0, 1]
    assert warm.jobs == 3


def test_idle_timeout_and_close_end_the_warm_nodes(tmp_path: Path) -> None:
    short = LocalProcessCompute(keep_warm=1.5)
    assert distributed(gpus=2, mlflow=False, compute=short)(_rank).distributed() == [0, 1]
    assert _wait_until(lambda: not [w for w in POOL.idle() if w.owner == id(short)], timeout=20)
    assert _wait_until(lambda: warm_node_pids() == [])

    held = LocalProcessCompute(keep_warm=600)
    distributed(gpus=2, mlflow=False, compute=held)(_rank).distributed()
    assert warm_node_pids()
    held.close()
    assert warm_node_pids() == []


def test_a_killed_driver_leaves_no_warm_node(tmp_path: Path) -> None:
    """SIGKILL: no exit handler runs; each warm node sees its stdin end and takes everything with it."""
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from prefect_sgpu import distributed, runtime
        from prefect_sgpu.compute.local import LocalProcessCompute

        def rank():
            return runtime.rank()

        print(distributed(gpus=2, nodes=2, mlflow=False, compute=LocalProcessCompute(keep_warm=600))(rank)
              .distributed(), flush=True)
        time.sleep(600)
    """))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert driver.stdout is not None
        assert driver.stdout.readline().strip() == "[0, 1]"
        assert len(warm_node_pids()) == 2
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
        assert _wait_until(lambda: warm_node_pids() == [], timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
