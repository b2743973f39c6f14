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
import shlex
import shutil
import signal
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from prefect_sgpu.compute import Allocation, Compute, Node, NodeLaunch, node_base_environment
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.launch.processes import kill_and_reap
from prefect_sgpu.spec import Plan, Resources, plan_local

logger = logging.getLogger("prefect_sgpu.compute.local")

Isolation = Literal["auto", "namespaces", "none"]
MASKED_ENV = ("SGPU_PAYLOAD_KEY",)


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


class LocalCompute(Compute):
    """Run every node of a job as local processes on this machine."""

    def __init__(self, isolation: Isolation = "auto", shm_size: str = "2g") -> None:
        if isolation not in ("auto", "namespaces", "none"):
            raise SGPUConfigError("isolation", isolation, "one of 'auto', 'namespaces', 'none'")
        self.isolation = isolation
        self.shm_size = shm_size

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

    def plan(self, resources: Resources) -> Plan:
        plan = plan_local(resources, len(visible_gpus()))
        if plan.device == "cpu":
            _cpu_notice(plan)
        return plan

    def wrap(self, launch: NodeLaunch) -> list[str]:
        """The full command line of one node, namespaces included."""
        argv = list(launch.argv)
        if self.uses_namespaces():
            # --mount-proc: a /proc of the namespace, so psutil.Process() in a rank (DeepSpeed
            # calls it on import) finds its own pid
            argv = [shutil.which("unshare") or "unshare", "--mount", "--propagation", "private",
                    "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM", "--", *argv,
                    f"--shm-size={self.shm_size}"]
        return argv

    def node_env(self, plan: Plan, node: Node) -> dict[str, str]:
        # every simulated node shares this host's cores: each rank gets its share of them
        # (torch otherwise starts one thread per core in every rank, and they fight)
        threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // plan.world_size))}
        if plan.device != "cuda":
            return {"SGPU_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", **threads}
        gpus = visible_gpus()
        mine = gpus[node.index * plan.procs_per_node : (node.index + 1) * plan.procs_per_node]
        return {"SGPU_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": ",".join(mine), **threads}

    def dry_run(self, run_id: str, plan: Plan, launches: list[NodeLaunch]) -> dict[str, Any]:
        return {
            "compute": "local",
            "run_id": run_id,
            "namespaces": self.uses_namespaces(),
            "nodes": [
                {
                    "index": launch.node.index,
                    "command": shlex.join(self.wrap(launch)),
                    "env": {k: ("***" if k in MASKED_ENV else v) for k, v in launch.env.items()},
                }
                for launch in launches
            ],
        }

    def acquire(self, run_id: str, plan: Plan, cancel: Any = None) -> Allocation:
        # one loopback address per simulated node (all of 127.0.0.0/8 is local): torch
        # elastic tells nodes apart by address and pid, and in PID namespaces every agent is pid 1
        nodes = [Node(index=i, address=f"127.0.0.{i + 1}") for i in range(plan.nodes)]
        return Allocation(run_id=run_id, plan=plan, nodes=nodes)

    def start(self, allocation: Allocation, launch: NodeLaunch) -> None:
        node = launch.node
        ours = self.node_env(allocation.plan, node)
        if "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in launch.env:
            ours.pop("OMP_NUM_THREADS")  # the user's choice wins
        env = {**node_base_environment(dict(os.environ)), **launch.env, **ours}
        # the caller's import path, so modules importable here are importable in the ranks
        paths = [p or os.getcwd() for p in sys.path] + env.get("PYTHONPATH", "").split(os.pathsep)
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
        out_dir = Path(launch.env["SGPU_JOB_DIR"]) / "agent"
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / f"node-{node.index}.out", "ab") as out:
            node.handle = subprocess.Popen(
                self.wrap(launch), env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        node.info["pid"] = node.handle.pid

    def poll(self, allocation: Allocation, node: Node) -> int | None:
        proc: subprocess.Popen[bytes] | None = node.handle
        return None if proc is None else proc.poll()

    def stop(self, allocation: Allocation, grace: float = 10.0) -> None:
        import psutil

        procs = [n.handle for n in allocation.nodes if n.handle is not None]
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

    def release(self, allocation: Allocation) -> None:
        self.stop(allocation, grace=0.0)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
