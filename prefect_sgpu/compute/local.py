"""Local processes: the embedded default compute.

Each simulated node is one torch elastic agent process. Where the kernel allows
(root, util-linux ``unshare``), a node gets its own PID and mount namespace with a
private ``/dev/shm``, so nodes on one host behave like separate hosts (Mosaic
Streaming's shared memory does not collide) and, when the agent exits, the kernel
kills whatever its ranks left behind. Every node also gets a temp folder of its own
(``TMPDIR``), deleted when the job ends: Streaming's lock files there do not collide either.

A CUDA job leases whole GPUs of this machine from ``acquire`` to ``release``
(:mod:`prefect_sgpu.compute.leases`): ranks of two jobs never share a GPU, whether the
jobs run in one driver process or in several. Each node agent inherits the lease on its
own GPUs, so GPUs left busy by the agents of a killed driver stay leased until those
agents exit.
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
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from prefect_sgpu.protocol.liveness import HEARTBEAT_TTL_ENV, local_heartbeat_ttl as heartbeat_ttl  # noqa: F401
from prefect_sgpu.compute.base import (AllocatedNode, Allocation, Compute, Event, JobLaunch, NodeCommand, NodeExited,
                                       NodeLost, NodeUp, Released, Request, node_base_environment)
from prefect_sgpu.compute import leases
from prefect_sgpu.compute import agent_template
from prefect_sgpu.compute.warm_pool import POOL, WarmSet, check_keep_warm, start_set
from prefect_sgpu.procs.warm_channel import AGENT_MODULE, warm_node_argv
from prefect_sgpu.errors import JobCancelled, LaunchTimeout, ProvisioningError, SGPUConfigError
from prefect_sgpu.procs.processes import kill_and_reap
from prefect_sgpu.spec import JobSpec, Plan, plan_local

if TYPE_CHECKING:
    from prefect_sgpu.protocol.jobfolder import JobFolder
    from prefect_sgpu.store import Store

logger = logging.getLogger("prefect_sgpu.compute.local")

Isolation = Literal["auto", "namespaces", "none"]
#: seconds an idle warm allocation is kept for the next job (0: every job starts and ends cold)
KEEP_WARM_ENV = "PREFECT_SGPU_KEEP_WARM"
DEFAULT_KEEP_WARM_S = 120.0
#: seconds between two tries for GPUs while acquire waits for other jobs to release them
LEASE_POLL_S = 0.5


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


def default_keep_warm() -> float:
    """``PREFECT_SGPU_KEEP_WARM`` seconds, else 120."""
    raw = os.environ.get(KEEP_WARM_ENV, "").strip()
    return check_keep_warm(KEEP_WARM_ENV, raw, "warm nodes off") if raw else DEFAULT_KEEP_WARM_S


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


_cpu_notice_given: set[str | None] = set()


def _run_key() -> str | None:
    """The Prefect task or flow run this job belongs to (None outside Prefect)."""
    if "prefect" not in sys.modules:
        return None
    try:
        from prefect.context import FlowRunContext, TaskRunContext

        task, flow = TaskRunContext.get(), FlowRunContext.get()
        run = (task.task_run if task else None) or (flow.flow_run if flow else None)
        return str(run.id) if run is not None else None
    except Exception:  # noqa: BLE001 - a notice, not worth failing over
        return None


def _cpu_notice(plan: Plan) -> None:
    """Say once why ranks run on the CPU: once per process, and once in every Prefect run (whose
    logs would otherwise not show it when an earlier job of the process already said it)."""
    key = _run_key()
    if key not in _cpu_notice_given:
        _cpu_notice_given.add(key)
        logger.warning(
            "no GPU on this machine: running %d CPU rank(s) with gloo (%d node(s) x %d)",
            plan.world_size, plan.nodes, plan.procs_per_node,
        )


@dataclass(frozen=True)
class LocalRequest(Request):
    namespaces: bool = False
    shm_size: str = "2g"

    #: seconds the job's nodes stay warm for the next job (0: cold)
    keep_warm: float = 0.0

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "namespaces": self.namespaces, "keep_warm": self.keep_warm}


@dataclass
class LocalAllocation(Allocation):
    processes: dict[int, "subprocess.Popen[bytes] | agent_template.ForkedAgent"] = field(default_factory=dict)
    reported: set[int] = field(default_factory=set)
    announced: set[int] = field(default_factory=set)
    #: the GPU ids leased for the job, in rank order (node N runs on its N-th slice); empty for CPU jobs
    gpus: list[str] = field(default_factory=list)
    #: the driver's hold on ``gpus`` (its node agents hold it too), until ``release``
    lease: leases.GpuLease | None = None
    #: the warm nodes this job runs on (None: cold, one new agent process per node)
    warm: "WarmSet | None" = None
    #: the node agent arguments each warm node was handed, by node
    warm_sent: dict[int, list[str]] = field(default_factory=dict)
    #: each node's own temp folder (its TMPDIR), deleted at release
    scratch: list[Path] = field(default_factory=list)


class LocalProcessCompute(Compute):
    """Run every node of a job as local processes on this machine."""

    name = "local"
    remote = False

    def __init__(self, isolation: Isolation = "auto", shm_size: str = "2g", keep_warm: float | None = None,
                 agent_start: str | None = None) -> None:
        """``keep_warm``: seconds a finished job's node processes (torch imported) wait for the next
        job of the same shape, which then starts without importing anything; None: the
        ``PREFECT_SGPU_KEEP_WARM`` environment variable, else 120; 0: every job starts cold.

        ``agent_start``: how a cold job's node agents start. ``fork``: forked from this process's
        agent template, which imported torch once (:mod:`~prefect_sgpu.compute.agent_template`);
        ``exec``: each a new interpreter; None: the ``PREFECT_SGPU_AGENT_START`` environment
        variable, else ``fork``."""
        if isolation not in ("auto", "namespaces", "none"):
            raise SGPUConfigError("isolation", isolation, "one of 'auto', 'namespaces', 'none'")
        if agent_start is not None and agent_start not in agent_template.AGENT_STARTS:
            raise SGPUConfigError("agent_start", agent_start, f"one of {', '.join(agent_template.AGENT_STARTS)}")
        self.agent_start = agent_start or agent_template.agent_start()
        self.isolation = isolation
        self.shm_size = shm_size
        self.keep_warm = default_keep_warm() if keep_warm is None else check_keep_warm("keep_warm", keep_warm,
                                                                                      "warm nodes off")
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"LocalProcessCompute(isolation={self.isolation!r}, keep_warm={self.keep_warm:g})"

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
                            shm_size=self.shm_size, keep_warm=self.keep_warm)

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

    def node_env(self, allocation: LocalAllocation, node: int) -> dict[str, str]:
        """Node ``node``'s device environment: its own slice of the allocation's leased GPUs."""
        plan = allocation.plan
        # every simulated node shares this host's cores: each rank gets its share of them
        # (torch otherwise starts one thread per core in every rank, and they fight)
        threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // plan.world_size))}
        if plan.device != "cuda":
            return {"SGPU_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", **threads}
        mine = allocation.gpus[node * plan.procs_per_node : (node + 1) * plan.procs_per_node]
        if len(mine) != plan.procs_per_node:
            raise RuntimeError(f"node {node} of job {allocation.run_id} has {len(mine)} leased GPU(s), "
                               f"needs {plan.procs_per_node}")
        return {"SGPU_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": ",".join(mine), **threads}

    def acquire(self, request: Request, folder: "JobFolder", deadline: float,
                cancel: threading.Event) -> LocalAllocation:
        """Loopback addresses for the nodes and, for a CUDA job, a lease on ``world_size`` GPUs.

        Waits while other jobs (of any process on this machine) hold the GPUs it needs,
        holding none of them meanwhile; ends with ``LaunchTimeout`` (phase "waiting for
        GPUs") at ``deadline`` and ``JobCancelled`` once ``cancel`` is set."""
        # one loopback address per simulated node (all of 127.0.0.0/8 is local): torch
        # elastic tells nodes apart by address and pid, and in PID namespaces every agent is pid 1
        nodes = [AllocatedNode(index=i, address=f"127.0.0.{i + 1}", host=socket.gethostname())
                 for i in range(request.plan.nodes)]
        allocation = LocalAllocation(request=request, folder=folder, nodes=nodes)
        if isinstance(request, LocalRequest) and request.keep_warm > 0:
            return self._acquire_warm(allocation, folder, deadline, cancel)
        if request.plan.device == "cuda":
            allocation.lease = self._lease_gpus(request, folder, deadline, cancel)
            allocation.gpus = list(allocation.lease.gpus)
            if cancel.is_set():
                allocation.lease.close()
                raise JobCancelled(f"job {request.run_id} was cancelled")
        return allocation

    def _warm_key(self, request: Request) -> tuple[Any, ...]:
        plan = request.plan
        namespaces = isinstance(request, LocalRequest) and request.namespaces
        return (plan.nodes, plan.procs_per_node, plan.device, namespaces,
                request.shm_size if isinstance(request, LocalRequest) else "", sys.executable)

    def _acquire_warm(self, allocation: LocalAllocation, folder: "JobFolder", deadline: float,
                      cancel: threading.Event) -> LocalAllocation:
        """An idle warm set of this job's shape from this process's pool, or a new one (which leases
        the job's GPUs and keeps them until the set closes)."""
        request = allocation.request
        key = self._warm_key(request)
        warm = POOL.take(key, owner=id(self))
        if warm is None:
            lease = self._lease_gpus(request, folder, deadline, cancel) if request.plan.device == "cuda" else None
            ppn = request.plan.procs_per_node

            argvs = [self.command_line(request, NodeCommand(i, warm_node_argv(i))) for i in range(request.plan.nodes)]
            env = {**node_base_environment(dict(os.environ)), "PYTHONPATH": _import_path({})}
            try:
                warm = start_set(key, argvs, env, warm_logs_dir(), lease,
                                 lambda i: list(lease.fds[i * ppn:(i + 1) * ppn]) if lease else [],
                                 deadline, cancel, request.run_id, request.spec.timeout)
            except BaseException:
                if lease is not None:
                    lease.close()
                raise
            POOL.add(warm, owner=id(self))
            logger.debug("job %s: started warm set %s (%d node(s))", request.run_id, warm.id, len(warm.nodes))
        else:
            logger.debug("job %s: reusing warm set %s (job %d on it)", request.run_id, warm.id, warm.jobs + 1)
        allocation.warm = warm
        allocation.gpus = warm.gpus
        if cancel.is_set():
            POOL.give_back(warm, _keep_warm(request))
            allocation.warm = None
            raise JobCancelled(f"job {request.run_id} was cancelled")
        return allocation

    def _lease_gpus(self, request: Request, folder: "JobFolder", deadline: float,
                    cancel: threading.Event) -> leases.GpuLease:
        gpus, needed = visible_gpus(), request.plan.world_size
        if needed > len(gpus):  # plan() refuses this; a request planned elsewhere must not wait forever
            raise SGPUConfigError("gpus", needed, f"at most {len(gpus)} on this machine")
        waiting = False
        while True:
            try:
                lease, busy = leases.try_lease(gpus, needed, request.run_id)
            except OSError as exc:
                raise ProvisioningError(
                    f"job {request.run_id} cannot lease GPUs ({exc}): set {leases.LEASE_DIR_ENV} to a folder "
                    "every driver on this machine can write") from exc
            if lease is not None:
                if waiting:
                    logger.info("job %s: leased GPU(s) %s", request.run_id, ",".join(lease.gpus))
                return lease
            if not waiting:
                waiting = True
                logger.warning(
                    "job %s waits for %d GPU(s) of this machine's %d (lease folder %s); in use by other jobs: %s",
                    request.run_id, needed, len(gpus), leases.lease_dir(),
                    "; ".join(f"GPU {g}: {leases.holder(g)}" for g in busy) or "none (retrying)",
                )
            if cancel.wait(LEASE_POLL_S):
                raise JobCancelled(f"job {request.run_id} was cancelled while waiting for GPUs")
            if time.monotonic() > deadline:
                raise LaunchTimeout(request.run_id, request.spec.timeout, phase="waiting for GPUs")

    def start(self, allocation: Allocation, launch: JobLaunch) -> None:
        assert isinstance(allocation, LocalAllocation)
        ppn = allocation.plan.procs_per_node
        for command in launch.commands:
            ours = self.node_env(allocation, command.node)
            if "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in launch.env:
                ours.pop("OMP_NUM_THREADS")  # the user's choice wins
            base = node_base_environment(dict(os.environ))
            env = {**base, **self._node_temp(allocation, base), **launch.env, **launch.secrets, **ours,
                   "SGPU_PAYLOAD_KEY": allocation.folder.key}
            # the caller's import path, so modules importable here are importable in the ranks
            env["PYTHONPATH"] = _import_path(env)
            out = allocation.folder.path(f"agent/node-{command.node}.out")
            out.parent.mkdir(parents=True, exist_ok=True)
            warm = allocation.warm.nodes[command.node] if allocation.warm is not None else None
            if warm is not None and command.argv[1:3] == ["-m", AGENT_MODULE]:
                with self._lock:
                    if allocation.released:
                        return
                    allocation.warm_sent[command.node] = command.argv[3:]
                    warm.launch(command.argv[3:], env, os.getcwd(), out)
                continue
            with self._lock, open(out, "ab") as fh:
                if allocation.released:
                    return
                # the agent holds the lease on its GPUs too: each lasts until the driver and the agent closed it
                mine = allocation.lease.fds[command.node * ppn : (command.node + 1) * ppn] if allocation.lease else []
                forked = self._fork_agent(allocation.request, command, env, out, mine)
                allocation.processes[command.node] = forked or subprocess.Popen(
                    self.command_line(allocation.request, command), env=env, stdin=subprocess.DEVNULL,
                    stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, pass_fds=mine,
                )

    def _fork_agent(self, request: Request, command: NodeCommand, env: dict[str, str], out: Path,
                    fds: list[int]) -> "agent_template.ForkedAgent | None":
        """The node's agent forked from the agent template, or None where it starts as a new interpreter."""
        if self.agent_start != "fork" or command.argv[:3] != [sys.executable, "-m", AGENT_MODULE]:
            return None
        namespaces = isinstance(request, LocalRequest) and request.namespaces
        argv = command.argv[3:] + ([f"--shm-size={request.shm_size}"] if namespaces else [])
        try:
            template = agent_template.template({**node_base_environment(dict(os.environ)),
                                                "PYTHONPATH": _import_path({})})
            agent = template.launch(argv, env, os.getcwd(), str(out), namespaces=namespaces, fds=fds)
            agent.args = self.command_line(request, command)  # the same program, namespaces included
            return agent
        except (agent_template.TemplateUnavailable, OSError) as exc:
            logger.warning("job %s: node %d's agent starts as a new interpreter: %s", request.run_id,
                           command.node, exc)
            return None

    def replace_elastic_node(self, allocation: Allocation, node: int, request: Request, deadline: float,
                             cancel: threading.Event) -> Released | None:
        """A cold node's place made ready for a new agent at once (a local machine is always there): what
        is left of the lost agent's process tree is killed and reaped. Nodes of a warm set are not put back
        (None)."""
        assert isinstance(allocation, LocalAllocation)
        with self._lock:
            proc = allocation.processes.get(node)
            if allocation.released or allocation.warm is not None or proc is None:
                return None
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.error("node %d's lost agent (pid %s) did not exit after SIGKILL", node, proc.pid)
        with self._lock:
            allocation.processes.pop(node, None)
            allocation.reported.discard(node)
            allocation.announced.discard(node)
        return Released(gone=[f"node {node} process tree (pid {proc.pid}), lost"])

    def poll(self, allocation: Allocation) -> list[Event]:
        assert isinstance(allocation, LocalAllocation)
        events: list[Event] = []
        for index, label, pid, code, lost in _agents(allocation):
            if index not in allocation.announced:
                allocation.announced.add(index)
                events.append(NodeUp(index, f"{allocation.nodes[index].address} ({label})"))
            if index in allocation.reported:
                continue
            if lost is not None:
                allocation.reported.add(index)
                events.append(NodeLost(index, lost))
            elif code is not None:
                unknown = getattr(allocation.processes.get(index), "exit_unknown", False)
                events.append(_agent_ended(allocation, index, code, pid, unknown))
        return events

    def _stop_warm(self, allocation: LocalAllocation, grace: float) -> None:
        assert allocation.warm is not None
        running = [n for n in allocation.warm.nodes if n.agent_pid is not None and n.exit_code is None]
        for node in running:
            node.stop(grace)
        for node in running:
            if not node.wait_job(grace + 15.0):
                logger.error("warm node %d (pid %s) did not end its job; closing it", node.index, node.pid)
                node.close()

    def stop(self, allocation: Allocation, grace: float = 10.0) -> None:
        import psutil

        assert isinstance(allocation, LocalAllocation)
        if allocation.warm is not None:
            self._stop_warm(allocation, grace)
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

    @staticmethod
    def _node_temp(allocation: LocalAllocation, base: dict[str, str]) -> dict[str, str]:
        """A temp folder of the node's own (``TMPDIR``, ``TMP``, ``TEMP``), as a separate host has:
        what ranks coordinate through files there (Mosaic Streaming's locks, named by a number each
        node's ranks pick by looking at what exists) is not mixed up with another job's on this
        machine. torch's compile cache stays where it was (it is shared on purpose, and safe to
        share). The job's own ``env=`` wins."""
        import getpass
        import tempfile

        folder = tempfile.mkdtemp(prefix="sgpu-")
        allocation.scratch.append(Path(folder))
        env = {"TMPDIR": folder, "TMP": folder, "TEMP": folder}
        if "TORCHINDUCTOR_CACHE_DIR" not in base:
            try:
                user = getpass.getuser()
            except (KeyError, OSError):  # a uid without a name: torch then finds no cache folder either
                return env
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
        return env

    def release(self, allocation: Allocation) -> Released:
        """Stop every node process tree, then close the driver's hold on the GPU lease.

        The lease ends when the last process holding it closed it: here, once no node
        agent runs any more. Idempotent."""
        assert isinstance(allocation, LocalAllocation)
        with self._lock:
            allocation.released = True
        warm = allocation.warm
        try:
            self.stop(allocation, grace=0.0)  # the job's processes, on warm nodes too
        finally:
            for folder in allocation.scratch:  # the nodes' temp folders, once their processes are gone
                shutil.rmtree(folder, ignore_errors=True)
            allocation.scratch = []
            allocation.warm = None  # a second release gives nothing back twice
            if allocation.lease is not None:
                allocation.lease.close()
            if warm is not None:
                POOL.give_back(warm, _keep_warm(allocation.request))
        gone = [f"node {n.index} job processes (agent pid {n.agent_pid})" for n in (warm.nodes if warm else [])
                if n.agent_pid is not None]
        gone += [f"node {i} process tree (pid {p.pid})" for i, p in sorted(allocation.processes.items())]
        if allocation.gpus and warm is None:
            gone.append(f"lease on GPU(s) {','.join(allocation.gpus)}")
        return Released(gone=gone)

    def warm_set(self, allocation: Allocation) -> Any:
        """The warm set the job runs on (None: cold nodes)."""
        return allocation.warm if isinstance(allocation, LocalAllocation) else None

    def close(self) -> None:
        """Close the idle warm nodes this compute used last (a task runner does at flow end);
        ones in a job close when it ends."""
        POOL.close(owner=id(self))


def _agents(allocation: LocalAllocation) -> list[tuple[int, str, int | None, int | None, str | None]]:
    """Every node agent of the job, cold (a process of its own) or forked on a warm node: (node,
    label, pid, exit code or None while it runs, why its node was lost or None)."""
    found: list[tuple[int, str, int | None, int | None, str | None]] = []
    for index, proc in sorted(allocation.processes.items()):
        found.append((index, f"pid {proc.pid}", proc.pid, proc.poll(), None))
    for node in allocation.warm.nodes if allocation.warm is not None else []:
        if node.agent_pid is None or node.index in allocation.processes:
            continue
        code = node.poll()
        lost = (f"node {node.index}'s warm node (pid {node.pid}) ended while its job ran: {node.broken or 'exited'}"
                if code is None and not node.alive() else None)
        found.append((node.index, f"warm, agent pid {node.agent_pid}", node.agent_pid, code, lost))
    return found


def _agent_ended(allocation: LocalAllocation, index: int, code: int, pid: int | None,
                 unknown: bool = False) -> Event:
    """A node agent's end: its sealed status, or the node lost when it was killed outright (OOM
    killer, kill -9) before it could report. ``unknown``: its exit code was lost with the agent
    template that forked it, and its status alone tells."""
    allocation.reported.add(index)
    status = allocation.folder.status(index)
    if unknown:
        if status is None:
            return NodeLost(index, f"node {index}'s agent (pid {pid}) ended without a report after the agent "
                                   "template that forked it died")
        return NodeExited(index, status.exit_code, status)
    if status is None and code < 0:
        return NodeLost(index, f"node {index}'s agent (pid {pid}) was killed by {signal.Signals(-code).name} "
                               "before it reported")
    return NodeExited(index, code, status)


def _keep_warm(request: Request) -> float:
    return request.keep_warm if isinstance(request, LocalRequest) else 0.0


def warm_logs_dir() -> "Path":
    from prefect_sgpu.store import default_home

    return default_home() / "warm"


def _import_path(env: dict[str, str]) -> str:
    """The caller's import path (and ``env``'s PYTHONPATH): modules importable here are importable in ranks."""
    paths = [p or os.getcwd() for p in sys.path] + env.get("PYTHONPATH", "").split(os.pathsep)
    return os.pathsep.join(dict.fromkeys(p for p in paths if p))


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
