"""One Ray node as a child process we own: ``ray start --block``, watched and stopped by pid.

``ray stop`` kills every Ray process on the host, including other jobs' simulated
nodes and clusters that are not ours. Running ``ray start --block`` as our own child
instead lets us stop exactly this node: SIGTERM (Ray's handler tears down its
raylet, GCS and workers; the drain wait is switched off), then SIGKILL for whatever
of the process tree we saw is still alive.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable

from prefect_sgpu.procs.processes import kill_and_reap

#: what ``ray start`` prints once the node has registered with the GCS
READY_LINE = "Ray runtime started"
#: what ``ray start`` says when its fixed wait for the raylet ran out (a busy machine, not a broken node)
STARTUP_TIMED_OUT = "timed out during startup"

#: environment of every Ray process we start: no usage stats, no metrics, no docker CPU warning,
#: immediate stop. Nothing a job needs listens without being asked to: Ray's metrics
#: collection (the dashboard agent's Prometheus exporter on ``--metrics-export-port``, and
#: every process's reporting to it) is off, and the dashboard process's own Prometheus server
#: gets a port outside 0-65535: Ray 2.x has no switch for that server, fails to start it,
#: logs that once in ``dashboard.log`` and carries on without it.
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_enable_metrics_collection": "0",
    "DASHBOARD_METRIC_PORT": "-1",
    "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
}

#: the one address Ray's own servers (GCS, raylet, core workers, dashboard agent) bind to
#: alone; for any other node address they listen on every interface
LOOPBACK = "127.0.0.1"


def ray_ip(address: str, keep_loopback: bool = False) -> str:
    """The address a Ray node may bind on this host.

    Ray replaces 127.0.0.1 and localhost with the host's routable address, in a joining
    node's ``--address`` too. A head that no node joins keeps 127.0.0.1 when asked
    (``keep_loopback``; ``head_env`` stops the replacement), so a one-node cluster listens
    on loopback only; otherwise 127.0.0.1 becomes 127.0.1.1. Any other loopback address
    (all of 127.0.0.0/8 is local) is kept as given, so simulated nodes stay on loopback.
    """
    host = address.strip()
    if host in ("localhost", "::1"):
        host = LOOPBACK
    return "127.0.1.1" if host == LOOPBACK and not keep_loopback else host


def head_env(node_ip: str) -> dict[str, str]:
    """Environment a head on ``node_ip`` (and drivers beside it) needs to keep that address.

    Ray resolves 127.0.0.1 to the host's routable address unless it is told the cluster
    is a one-host one (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which changes only that
    resolution and makes ``ray start`` refuse to start a joining node).
    """
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"} if node_ip == LOOPBACK else {}


def cluster_address(spec: "RayNodeSpec", argv: list[str]) -> str:
    """The GCS address of the cluster this node belongs to (its own ``--port`` on a head).

    It goes into ``RAY_ADDRESS`` of ``ray start``, and so of every process the node starts:
    Ray code that finds "the" cluster by itself (Ray Train's placement-group cleaner asks the
    state API with no address) then finds this one, never another cluster on the same host,
    where it would fail with "Found multiple active Ray instances" and leave the run's
    placement group behind.
    """
    if spec.head_address:
        return spec.head_address
    port = next(a.split("=", 1)[1] for a in argv if a.startswith("--port="))
    return f"{spec.ip}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A listening port for a Ray component: free, outside the ephemeral range, not handed out before."""
    from prefect_sgpu.compute.ports import free_port as listener_port

    return listener_port(host)


#: how many of ``ray start``'s last output lines an error about it quotes
TAIL_LINES = 12
#: how many times a node is started when Ray's fixed 30 s raylet wait runs out: each try costs
#: that wait and a few seconds of process start, so five fit well inside ``@ray_launch``'s
#: default join budget (600 s) while a raylet that never registers still fails in minutes
START_ATTEMPTS = 5
#: a try started with less of the budget left than this could not outlast Ray's own 30 s wait
MIN_ATTEMPT_S = 35.0


@dataclass
class RayNodeSpec:
    """What ``ray start`` needs for one node: head (``gcs_port``) or worker (``head_address``)."""

    node_ip: str
    temp_dir: str
    num_cpus: int | None = None
    num_gpus: int | None = None
    gcs_port: int | None = None
    head_address: str | None = None
    resources: str | None = None  # JSON, e.g. '{"accelerator_type:A10G": 1}'
    single_node: bool = False  # a head no node joins: it may stay on 127.0.0.1 (loopback only)
    object_store_memory: int | None = None
    extra_args: list[str] = field(default_factory=list)

    @property
    def is_head(self) -> bool:
        return self.head_address is None

    @property
    def ip(self) -> str:
        """The address this node announces and binds to."""
        return ray_ip(self.node_ip, keep_loopback=self.is_head and self.single_node)

    def env(self) -> dict[str, str]:
        """What ``ray start`` needs in its environment besides ``RAY_ENV``."""
        return head_env(self.ip) if self.is_head else {}

    def argv(self) -> list[str]:
        """The ``ray start`` command line; every port a job-unique free one.

        Ray's workers take random ports: its default worker range (10002-19999)
        overlaps the listener ports chosen here, and ``ray start`` refuses to start
        when the two meet. Every service that takes an address gets the node's own;
        no dashboard, no autoscaler monitor (whose Prometheus server would listen on
        a fixed port) and no metrics export (``RAY_ENV``).
        """
        ip = self.ip
        argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats",
                f"--node-ip-address={ip}", f"--temp-dir={self.temp_dir}",
                "--min-worker-port=0", "--max-worker-port=0", "--no-monitor",
                f"--dashboard-agent-listen-port={free_port(ip)}", f"--runtime-env-agent-port={free_port(ip)}"]
        if self.is_head:
            argv += ["--head", f"--port={self.gcs_port or free_port(ip)}", "--include-dashboard=false",
                     f"--dashboard-host={ip}", f"--dashboard-port={free_port(ip)}",
                     f"--ray-client-server-port={free_port(ip)}"]
        else:
            argv.append(f"--address={self.head_address}")
        if self.num_cpus is not None:
            argv.append(f"--num-cpus={self.num_cpus}")
        if self.num_gpus is not None:
            argv.append(f"--num-gpus={self.num_gpus}")
        if self.resources:
            argv.append(f"--resources={self.resources}")
        if self.object_store_memory:
            argv.append(f"--object-store-memory={self.object_store_memory}")
        return argv + list(self.extra_args)


class RayNodeProcess:
    """Start one Ray node, wait until it has joined, stop it and everything it started."""

    def __init__(self, spec: RayNodeSpec, env: dict[str, str] | None = None,
                 output: IO[str] | None = None) -> None:
        self.spec = spec
        self.env = {**(env if env is not None else os.environ), **RAY_ENV, **spec.env()}
        self.output = output if output is not None else sys.stdout
        self.proc: subprocess.Popen[str] | None = None
        self._ready = threading.Event()
        self._pump: threading.Thread | None = None
        self._seen: dict[int, float] = {}  # pid -> create time of every process of the tree seen
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    def start(self, timeout: float = 120.0, should_stop: Callable[[], bool] = lambda: False,
              attempts: int = START_ATTEMPTS) -> None:
        """Run ``ray start --block`` and return once the node is up; raise if it is not.

        Ray waits a fixed 30 s for a new node's raylet to register with the GCS
        (``raylet_start_wait_time_s``, a constant in Ray 2.x's ``ray/_private/node.py``: no
        option or environment variable changes it). The raylet registers only once its
        dashboard agent and runtime-env agent, two Python processes, are serving; on a machine
        too busy for that, ``ray start`` exits with "timed out during startup" although nothing
        is wrong. The node is then stopped and started again (``attempts`` tries in all, a
        backoff of a few seconds between them, all within ``timeout``); the next try finds
        Ray's modules in the page cache. Any other failure is raised at once, as is a timeout
        once ``should_stop`` says so."""
        from prefect_sgpu import retry

        deadline = retry.CLOCK.monotonic() + timeout
        tries = 0

        def once() -> None:
            nonlocal tries
            if tries:
                self.output.write(f"[sgpu] the Ray node at {self.spec.ip} {STARTUP_TIMED_OUT} "
                                  f"(attempt {tries} of {attempts}): starting it again\n")
                self._forget()
            tries += 1
            try:
                self._start_once(max(1.0, deadline - retry.CLOCK.monotonic()), should_stop)
            except RuntimeError as exc:
                if STARTUP_TIMED_OUT in str(exc):
                    self.stop(grace=5.0)  # whatever the try left, before any wait
                raise

        def transient(exc: BaseException) -> bool:
            return (isinstance(exc, RuntimeError) and STARTUP_TIMED_OUT in str(exc) and tries < attempts
                    and retry.CLOCK.monotonic() < deadline - MIN_ATTEMPT_S and not should_stop())

        retry.retrying(once, transient=transient, budget_s=timeout, base_s=1.0, cap_s=5.0,
                       what=f"starting the Ray node at {self.spec.ip}", log=self._note)

    def _note(self, line: str) -> None:
        self.output.write(f"[sgpu] {line}\n")

    def _forget(self) -> None:
        """Forget the last (stopped) try, for a fresh ``ray start``."""
        self._ready.clear()
        self._seen.clear()
        self._tail.clear()

    def _start_once(self, timeout: float, should_stop: Callable[[], bool]) -> None:
        os.makedirs(self.spec.temp_dir, exist_ok=True)
        argv = self.spec.argv()
        self.proc = subprocess.Popen(
            argv, env={**self.env, "RAY_ADDRESS": cluster_address(self.spec, argv)},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self._pump = threading.Thread(target=self._forward, name="ray-start-output", daemon=True)
        self._pump.start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.1):
            self._remember_tree()
            if self.proc.poll() is not None:
                self._pump.join(timeout=5)
                tail = "".join(self._tail).rstrip()
                raise RuntimeError(f"ray start exited with code {self.proc.returncode} before the node was up"
                                   + (f"; its last lines:\n{tail}" if tail else ""))
            if time.monotonic() > deadline or should_stop():
                raise TimeoutError(f"the Ray node did not start within {timeout:g}s")
        self._remember_tree()

    def _forward(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._tail.append(line)
            try:
                self.output.write(line)
                self.output.flush()
            except (OSError, ValueError):
                pass
            if READY_LINE in line:
                self._ready.set()

    def _remember_tree(self) -> None:
        import psutil

        if self.proc is None:
            return
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                self._seen.setdefault(p.pid, p.create_time())
        except psutil.NoSuchProcess:
            pass

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the node (Ray stops its own processes), then SIGKILL what is left of its tree."""
        import psutil

        if self.proc is None:
            return
        self._remember_tree()
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        survivors = []
        for pid, created in self._seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    survivors.append(p)
            except psutil.NoSuchProcess:
                continue
        kill_and_reap(survivors)
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self._pump is not None:
            self._pump.join(timeout=2)
