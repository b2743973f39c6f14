"""Local processes: the embedded default compute.

Each simulated node is one torch elastic agent process. Where the kernel allows
(root, util-linux ``unshare``), a node gets its own PID and mount namespace with a
private ``/dev/shm``, so nodes on one host behave like separate hosts (Mosaic
Streaming's shared memory does not collide) and, when the agent exits, the kernel
kills whatever its ranks left behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import signal
import subprocess
import sys
import time
from functools import lru_cache
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from prefect_sgpu.compute.base import (
    AllocatedNode,
    Allocation,
    Compute,
    Event,
    JobLaunch,
    NodeCommand,
    NodeExited,
    NodeLost,
    NodeUp,
    Released,
    Request,
    node_base_environment,
)
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.launch.processes import kill_and_reap
from prefect_sgpu.spec import JobSpec, Plan, plan_local

if TYPE_CHECKING:
    from prefect_sgpu.jobfolder import JobFolder
    from prefect_sgpu.store import Store

logger = logging.getLogger("prefect_sgpu.compute.local")

Isolation = Literal["auto", "namespaces", "none"]
HEARTBEAT_TTL_ENV = "PREFECT_SGPU_HEARTBEAT_TTL"


def heartbeat_ttl() -> float:
    """Seconds without a driver heartbeat after which local nodes stop themselves."""
    return float(os.environ.get(HEARTBEAT_TTL_ENV, 60.0))


def visible_gpus() -> list[str]:
    """GPU ids this process may use, without importing torch when it is not loaded."""
    if os.environ.get("PREFECT_SGPU_DEVICE", "").lower() == "cpu":
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d for d in listed.split(",") if d.strip() not in ("", "-1")]
    if "torch" in sys.modules:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


@lru_cache(maxsize=1)
def namespaces_available() -> bool:
    """Can this process give a child its own PID and mount namespace with a tmpfs /dev/shm?"""
    unshare = shutil.which("unshare")
    if not unshare or os.geteuid() != 0:
        return False
    probe = [unshare, "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc", "--",
             "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/dev/shm"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


_cpu_notice_given = False


def _cpu_notice(plan: Plan) -> None:
    global _cpu_notice_given
    if not _cpu_notice_given:
        _cpu_notice_given = True
        logger.warning(
            "no GPU on this machine: running %d CPU rank(s) with gloo (%d node(s) x %d)",
            plan.world_size, plan.nodes, plan.procs_per_node,
        )


@dataclass(frozen=True)
class LocalRequest(Request):
    namespaces: bool = False
    shm_size: str = "2g"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "namespaces": self.namespaces}


@dataclass
class LocalAllocation(Allocation):
    processes: dict[int, "subprocess.Popen[bytes]"] = field(default_factory=dict)
    reported: set[int] = field(default_factory=set)
    announced: set[int] = field(default_factory=set)


class LocalProcessCompute(Compute):
    """Run every node of a job as local processes on this machine."""

    name = "local"
    remote = False

    def __init__(self, isolation: Isolation = "auto", shm_size: str = "2g") -> None:
        if isolation not in ("auto", "namespaces", "none"):
            raise SGPUConfigError("isolation", isolation, "one of 'auto', 'namespaces', 'none'")
        self.isolation = isolation
        self.shm_size = shm_size
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"LocalProcessCompute(isolation={self.isolation!r})"

    def uses_namespaces(self) -> bool:
        if self.isolation == "none":
            return False
        available = namespaces_available()
        if self.isolation == "namespaces" and not available:
            raise SGPUConfigError(
                "isolation", "namespaces", "'auto' or 'none' here: this process cannot create PID "
                "and mount namespaces (needs root and util-linux unshare)",
            )
        return available

    def check_store(self, store: "Store") -> None:
        if store.local_dir_root() is None:
            raise SGPUConfigError("store", repr(store), "a local folder (local nodes write their job folder "
                                  "directly): leave store unset or use SGPUStore(uri='/some/folder')")

    def local_gpus(self) -> int:
        return len(visible_gpus())

    def plan(self, spec: JobSpec, run_id: str) -> LocalRequest:
        plan = plan_local(spec, self.local_gpus())
        if plan.device == "cpu":
            _cpu_notice(plan)
        return LocalRequest(run_id=run_id, compute=self.name, plan=plan, spec=spec,
                            heartbeat_ttl_s=heartbeat_ttl(), namespaces=self.uses_namespaces(),
                            shm_size=self.shm_size)

    def command_line(self, request: Request, command: NodeCommand) -> list[str]:
        """The full command line of one node, namespaces included."""
        argv = list(command.argv)
        if isinstance(request, LocalRequest) and request.namespaces:
            # --mount-proc: a /proc of the namespace, so psutil.Process() in a rank (DeepSpeed
            # calls it on import) finds its own pid
            argv = [shutil.which("unshare") or "unshare", "--mount", "--propagation", "private",
                    "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM", "--", *argv,
                    f"--shm-size={request.shm_size}"]
        return argv

    def node_env(self, plan: Plan, node: int) -> dict[str, str]:
        # every simulated node shares this host's cores: each rank gets its share of them
        # (torch otherwise starts one thread per core in every rank, and they fight)
        threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // plan.world_size))}
        if plan.device != "cuda":
            return {"SGPU_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", **threads}
        gpus = visible_gpus()
        mine = gpus[node * plan.procs_per_node : (node + 1) * plan.procs_per_node]
        return {"SGPU_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": ",".join(mine), **threads}

    def acquire(self, request: Request, folder: "JobFolder", deadline: float,
                cancel: threading.Event) -> LocalAllocation:
        # one loopback address per simulated node (all of 127.0.0.0/8 is local): torch
        # elastic tells nodes apart by address and pid, and in PID namespaces every agent is pid 1
        nodes = [AllocatedNode(index=i, address=f"127.0.0.{i + 1}", host=socket.gethostname())
                 for i in range(request.plan.nodes)]
        return LocalAllocation(request=request, folder=folder, nodes=nodes)

    def start(self, allocation: Allocation, launch: JobLaunch) -> None:
        assert isinstance(allocation, LocalAllocation)
        for command in launch.commands:
            ours = self.node_env(allocation.plan, command.node)
            if "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in launch.env:
                ours.pop("OMP_NUM_THREADS")  # the user's choice wins
            env = {**node_base_environment(dict(os.environ)), **launch.env, **ours,
                   "SGPU_PAYLOAD_KEY": allocation.folder.key}
            # the caller's import path, so modules importable here are importable in the ranks
            paths = [p or os.getcwd() for p in sys.path] + env.get("PYTHONPATH", "").split(os.pathsep)
            env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
            out = allocation.folder.path(f"agent/node-{command.node}.out")
            out.parent.mkdir(parents=True, exist_ok=True)
            with self._lock, open(out, "ab") as fh:
                if allocation.released:
                    return
                allocation.processes[command.node] = subprocess.Popen(
                    self.command_line(allocation.request, command), env=env, stdin=subprocess.DEVNULL,
                    stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                )

    def poll(self, allocation: Allocation) -> list[Event]:
        assert isinstance(allocation, LocalAllocation)
        events: list[Event] = []
        for index, proc in sorted(allocation.processes.items()):
            if index not in allocation.announced:
                allocation.announced.add(index)
                events.append(NodeUp(index, f"{allocation.nodes[index].address} (pid {proc.pid})"))
            if index in allocation.reported:
                continue
            code = proc.poll()
            if code is not None:
                allocation.reported.add(index)
                status = allocation.folder.status(index)
                if status is None and code < 0:  # killed outright (OOM killer, kill -9): the node is gone
                    events.append(NodeLost(index, f"node {index}'s agent (pid {proc.pid}) was killed by "
                                                  f"{signal.Signals(-code).name} before it reported"))
                else:
                    events.append(NodeExited(index, code, status))
        return events

    def stop(self, allocation: Allocation, grace: float = 10.0) -> None:
        import psutil

        assert isinstance(allocation, LocalAllocation)
        procs = list(allocation.processes.values())
        tree: list[psutil.Process] = []
        for proc in procs:
            if proc.poll() is None:
                try:
                    root = psutil.Process(proc.pid)
                    tree += [root, *root.children(recursive=True)]
                except psutil.NoSuchProcess:
                    pass
                _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        _, alive = psutil.wait_procs(tree, timeout=max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGKILL)
        kill_and_reap(alive)
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.error("node process %s did not exit after SIGKILL", proc.pid)

    def release(self, allocation: Allocation) -> Released:
        assert isinstance(allocation, LocalAllocation)
        with self._lock:
            allocation.released = True
        self.stop(allocation, grace=0.0)
        return Released(gone=[f"node {i} process tree (pid {p.pid})" for i, p in sorted(allocation.processes.items())])


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
