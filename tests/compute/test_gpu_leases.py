"""GPU leases of the local compute: whole GPUs per job, across driver processes, never leaked.

Fake GPU ids (``CUDA_VISIBLE_DEVICES=0,1,2``) and a private lease folder per test; the
drivers are real Python processes, the node agents real child processes.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from prefect_sgpu.compute import leases
from prefect_sgpu.compute.local import LocalAllocation, LocalProcessCompute
from prefect_sgpu.errors import JobCancelled, LaunchTimeout, ProvisioningError, SGPUConfigError
from prefect_sgpu.protocol.jobfolder import JobFolder
from prefect_sgpu.spec import JobSpec

REPO = Path(__file__).resolve().parents[2]
#: how long a test waits for a child to say something before it fails (generous: CI is loaded)
PATIENCE_S = 60.0

#: one driver: leases ``gpus`` GPUs through LocalProcessCompute.acquire, says so, holds them
#: until a line on stdin ("release", or "agents": start sleeping node agents first), releases
DRIVER = r"""
import json, logging, sys, threading, time
from pathlib import Path
from prefect_sgpu.compute.base import JobLaunch, NodeCommand
from prefect_sgpu.compute.local import LocalProcessCompute
from prefect_sgpu.protocol.jobfolder import JobFolder
from prefect_sgpu.spec import JobSpec

def say(event, **info):
    print(json.dumps({"event": event, "at": time.time(), **info}), flush=True)

logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="log %(message)s")
run_id, gpus, nodes, root = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
compute = LocalProcessCompute(isolation="none")
request = compute.plan(JobSpec(gpus=gpus, nodes=nodes, mlflow=False), run_id)
folder = JobFolder.local(Path(root) / run_id, key="k")
say("planned", device=request.plan.device)
allocation = compute.acquire(request, folder, time.monotonic() + 300, threading.Event())
say("held", gpus=allocation.gpus)
for line in sys.stdin:
    if line.strip() == "agents":
        launch = JobLaunch(env={}, rendezvous="", commands=[
            NodeCommand(node=n.index, argv=["sleep", "300"]) for n in allocation.nodes])
        compute.start(allocation, launch)
        say("agents", pids=[p.pid for p in allocation.processes.values()])
    if line.strip() == "release":
        break
say("releasing")
compute.release(allocation)
say("released")
"""


class Driver:
    """One driver process, its stdout read line by line in the background."""

    def __init__(self, run_id: str, gpus: int, env: dict[str, str], root: Path, nodes: int = 1) -> None:
        self.run_id = run_id
        self.lines: "queue.Queue[str]" = queue.Queue()
        self.seen: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER, run_id, str(gpus), str(nodes), str(root)], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def expect(self, wanted: Callable[[str], bool], what: str, patience: float = PATIENCE_S) -> str:
        """The first new line that is ``wanted``; fails after ``patience`` seconds."""
        limit = time.monotonic() + patience
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, limit - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{self.run_id} never said {what}; it said:\n" + "\n".join(self.seen)) from None
            self.seen.append(line)
            if wanted(line):
                return line

    def event(self, name: str, patience: float = PATIENCE_S) -> dict[str, Any]:
        line = self.expect(lambda s: s.startswith("{") and json.loads(s)["event"] == name, name, patience)
        return json.loads(line)

    def said_nothing_of(self, name: str, during: float) -> bool:
        try:
            self.event(name, patience=during)
        except AssertionError:
            return True
        return False

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def lease_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Three fake GPUs and a private lease folder, here and for every driver started."""
    fake = {"CUDA_VISIBLE_DEVICES": "0,1,2", "PREFECT_SGPU_DEVICE": "cuda",
            "PREFECT_SGPU_LEASE_DIR": str(tmp_path / "leases")}
    for key, value in fake.items():
        monkeypatch.setenv(key, value)
    return {**os.environ, **fake, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture
def drivers(lease_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., Driver]]:
    started: list[Driver] = []

    def start(run_id: str, gpus: int = 2, nodes: int = 1) -> Driver:
        driver = Driver(run_id, gpus, lease_env, tmp_path / "jobs", nodes)
        started.append(driver)
        return driver

    yield start
    for driver in started:
        driver.stop()


def _free_gpus(count: int = 3) -> list[str]:
    """The fake GPUs nobody leases now (each leased and given back at once)."""
    free = []
    for gpu in [str(i) for i in range(count)]:
        probe, _ = leases.try_lease([gpu], 1, "probe")
        if probe is not None:
            free.append(gpu)
            probe.close()
    return free


def _waits_for_gpus(line: str) -> bool:
    return line.startswith("log ") and "waits for 2 GPU(s)" in line


# --- across driver processes -------------------------------------------------------------------


def test_a_second_driver_waits_until_the_first_releases_and_their_gpus_never_overlap(drivers: Any) -> None:
    first = drivers("run-first")
    held_first = first.event("held")
    assert held_first["gpus"] == ["0", "1"], "leased in a stable order"

    second = drivers("run-second")
    waiting = second.expect(_waits_for_gpus, "that it waits for GPUs")
    assert f"pid {first.proc.pid} (run run-first)" in waiting, "the wait names who holds the GPUs"
    assert second.said_nothing_of("held", during=1.5), "only one GPU is free: the second job must wait"

    first.send("release")
    releasing = first.event("releasing")
    held_second = second.event("held")
    assert len(held_second["gpus"]) == 2
    assert held_second["at"] > releasing["at"], "the second held GPUs before the first let go"
    assert first.event("released")
    second.send("release")
    second.event("released")
    assert _free_gpus() == ["0", "1", "2"], "nothing stays leased"


def test_two_drivers_that_both_fit_hold_disjoint_gpus_at_once(drivers: Any) -> None:
    first, second = drivers("run-a", gpus=1), drivers("run-b", gpus=1)
    a, b = first.event("held"), second.event("held")
    assert not set(a["gpus"]) & set(b["gpus"])
    first.send("release")
    second.send("release")
    first.event("released")
    second.event("released")


def test_a_driver_killed_while_holding_gpus_loses_its_lease(drivers: Any) -> None:
    first = drivers("run-killed")
    first.event("held")
    second = drivers("run-next")
    second.expect(_waits_for_gpus, "that it waits for GPUs")

    os.kill(first.proc.pid, signal.SIGKILL)
    assert second.event("held")["gpus"] == ["0", "1"], "the kernel dropped the killed driver's locks"


def test_node_agents_of_a_killed_driver_keep_its_gpus_until_they_exit(drivers: Any) -> None:
    first = drivers("run-orphans", gpus=2, nodes=2)
    first.event("held")
    first.send("agents")
    agents = first.event("agents")["pids"]
    try:
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=30)

        second = drivers("run-after", gpus=3)
        second.expect(lambda s: s.startswith("log ") and "waits for 3 GPU(s)" in s, "that it waits for GPUs")
        assert second.said_nothing_of("held", during=1.5), "orphaned node agents still use the GPUs"
        os.kill(agents[0], signal.SIGKILL)
        assert second.said_nothing_of("held", during=1.0), "node 1's agent still holds the lease on its GPU"
    finally:
        for pid in agents:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert second.event("held")["gpus"] == ["0", "1", "2"], "the lease ended with the last agent"


# --- in one process ----------------------------------------------------------------------------


def _acquire(compute: LocalProcessCompute, tmp_path: Path, run_id: str, gpus: int, nodes: int = 1,
             deadline_s: float = 60.0, cancel: threading.Event | None = None, timeout: float = 3600) -> LocalAllocation:
    request = compute.plan(JobSpec(gpus=gpus, nodes=nodes, timeout=timeout, mlflow=False), run_id)
    folder = JobFolder.local(tmp_path / "jobs" / run_id, key="k")
    return compute.acquire(request, folder, time.monotonic() + deadline_s, cancel or threading.Event())


def test_each_node_gets_its_own_slice_of_the_lease(lease_env: dict[str, str], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    compute = LocalProcessCompute(isolation="none")
    one = _acquire(compute, tmp_path, "run-one", gpus=2, nodes=2)
    two = _acquire(compute, tmp_path, "run-two", gpus=2, nodes=2)  # same process, same compute: still exclusive
    try:
        envs = [compute.node_env(a, n.index)["CUDA_VISIBLE_DEVICES"] for a in (one, two) for n in a.nodes]
        assert sorted(envs) == ["0", "1", "2", "3"], "every node of both jobs on its own GPU"
        assert [compute.node_env(one, n)["CUDA_VISIBLE_DEVICES"] for n in (0, 1)] == one.gpus
    finally:
        gone = compute.release(one)
        compute.release(two)
    assert "lease on GPU(s) 0,1" in gone.gone
    compute.release(one)  # twice: nothing happens
    assert one.lease is not None and one.lease.fds == []


def test_lease_folder_and_lock_files_are_open_to_every_user(lease_env: dict[str, str], tmp_path: Path) -> None:
    compute = LocalProcessCompute(isolation="none")
    allocation = _acquire(compute, tmp_path, "run-modes", gpus=1)
    try:
        folder = Path(lease_env["PREFECT_SGPU_LEASE_DIR"])
        assert folder.stat().st_mode & 0o7777 == 0o1777
        lock = leases.lock_path(folder, allocation.gpus[0])
        assert lock.stat().st_mode & 0o777 == 0o666
        assert json.loads(lock.read_text())["run_id"] == "run-modes"
    finally:
        compute.release(allocation)
    leases._ensured.clear()
    assert leases.lease_dir() == folder, "a folder that exists already is used as it is"


def test_deadline_while_waiting_raises_launch_timeout_and_holds_nothing(lease_env: dict[str, str],
                                                                         tmp_path: Path) -> None:
    blocker, _ = leases.try_lease(["1"], 1, "blocker")
    assert blocker is not None
    try:
        with pytest.raises(LaunchTimeout) as info:
            _acquire(LocalProcessCompute(isolation="none"), tmp_path, "run-late", gpus=3, deadline_s=1.0, timeout=77)
        assert info.value.phase == "waiting for GPUs" and info.value.timeout == 77
        assert _free_gpus() == ["0", "2"], "the waiting job held none of the free GPUs"
    finally:
        blocker.close()


def test_cancel_while_waiting_raises_job_cancelled_and_holds_nothing(lease_env: dict[str, str],
                                                                    tmp_path: Path) -> None:
    blocker, _ = leases.try_lease(["0", "1", "2"], 3, "blocker")
    assert blocker is not None
    cancel = threading.Event()
    timer = threading.Timer(0.5, cancel.set)
    timer.start()
    try:
        with pytest.raises(JobCancelled):
            _acquire(LocalProcessCompute(isolation="none"), tmp_path, "run-cancelled", gpus=1, cancel=cancel)
    finally:
        timer.cancel()
        blocker.close()
    assert _free_gpus() == ["0", "1", "2"]


def test_a_cancel_seen_after_leasing_gives_the_lease_back(lease_env: dict[str, str], tmp_path: Path) -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(JobCancelled):
        _acquire(LocalProcessCompute(isolation="none"), tmp_path, "run-cancel-first", gpus=2, cancel=cancel)
    assert _free_gpus() == ["0", "1", "2"]


def test_more_gpus_than_the_machine_has_fail_at_plan_time(lease_env: dict[str, str]) -> None:
    with pytest.raises(SGPUConfigError, match="at most 3"):
        LocalProcessCompute(isolation="none").plan(JobSpec(gpus=4, mlflow=False), "run-big")


def test_cpu_jobs_lease_nothing(lease_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_SGPU_DEVICE", "cpu")
    compute = LocalProcessCompute(isolation="none")
    allocation = _acquire(compute, tmp_path, "run-cpu", gpus=2)
    assert allocation.gpus == [] and allocation.lease is None
    assert compute.node_env(allocation, 0)["CUDA_VISIBLE_DEVICES"] == ""
    compute.release(allocation)
    folder = Path(lease_env["PREFECT_SGPU_LEASE_DIR"])
    assert not folder.exists() or not list(folder.glob("gpu-*"))


def test_an_unusable_lease_folder_fails_the_job_naming_the_setting(lease_env: dict[str, str], tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("PREFECT_SGPU_LEASE_DIR", str(blocked / "leases"))
    with pytest.raises(ProvisioningError, match="PREFECT_SGPU_LEASE_DIR"):
        _acquire(LocalProcessCompute(isolation="none"), tmp_path, "run-nowhere", gpus=1)
