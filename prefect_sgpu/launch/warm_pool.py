"""Warm allocations of the local compute: node processes kept between jobs.

A cold local job starts one interpreter per node and one per rank, each importing torch.
A warm allocation keeps one :mod:`~prefect_sgpu.launch.warm_node` process per node (torch
imported, nothing of any job in it) and hands it the next job of the same shape, so
consecutive GPU tasks of a flow and repeated ``.distributed()`` calls of one driver pay the
start once.

Lifetime: a warm set belongs to this driver process. It is in one job at a time; between
jobs it waits in the pool of this process, and goes away

- when the compute that used it last is closed (the task runner closes its compute when
  the flow ends), or on demand (:func:`release_warm`);
- after ``keep_warm`` seconds without a job;
- when this interpreter exits; and if the driver dies outright, because each warm node
  exits when its stdin (a pipe from the driver) reaches end of file.

A warm node that died, or whose job could not be stopped cleanly, is never reused.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from prefect_sgpu.errors import JobCancelled, LaunchTimeout, ProvisioningError, SGPUConfigError

logger = logging.getLogger("prefect_sgpu.launch.warm_pool")

#: the module every warm node runs; node commands of other programs (Ray nodes) start cold
AGENT_MODULE = "prefect_sgpu.launch.node_agent"


class WarmNodeProcess:
    """The driver's end of one warm node: its process, and the JSON-lines channel to it."""

    def __init__(self, index: int, argv: list[str], env: dict[str, str], log: Path, pass_fds: list[int]) -> None:
        self.index = index
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         start_new_session=True, pass_fds=pass_fds)
        self.messages: "queue.Queue[dict[str, Any]]" = queue.Queue()
        self.ready = False
        self.agent_pid: int | None = None
        self.exit_code: int | None = None
        self.broken: str | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name=f"sgpu-warm-node-{index}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if "exited" in message:
                self.exit_code = int(message["exited"])
            self.messages.put(message)
        self.messages.put({"gone": self.proc.wait()})

    def _send(self, **message: Any) -> None:
        assert self.proc.stdin is not None
        with self._lock:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()

    def _next(self, timeout: float) -> dict[str, Any] | None:
        try:
            message = self.messages.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None
        if "gone" in message:
            self.broken = f"warm node {self.index} (pid {self.pid}) exited with code {message['gone']}"
        if "error" in message:
            self.broken = f"warm node {self.index}: {message['error']}"
        return message

    def alive(self) -> bool:
        return self.broken is None and self.proc.poll() is None

    def wait_ready(self, until: float, cancel: threading.Event, run_id: str, timeout: float) -> None:
        """Until the node has imported what it preloads; raises if it died, ``cancel`` or ``until``."""
        while not self.ready:
            message = self._next(0.2)
            if message is not None and "ready" in message:
                self.ready = True
            elif not self.alive():
                raise ProvisioningError(f"{self.broken or 'warm node exited'}; its log: {self.log}: "
                                        f"{_tail(self.log)}")
            elif cancel.is_set():
                raise JobCancelled(f"job {run_id} was cancelled while its warm nodes started")
            elif time.monotonic() > until:
                raise LaunchTimeout(run_id, timeout, phase="starting warm nodes")

    def preloaded(self, wait: float = 0.0) -> bool:
        """Has the node imported what it preloads (and is it alive)? Waits at most ``wait`` seconds."""
        until = time.monotonic() + wait
        while not self.ready and self.alive():
            message = self._next(until - time.monotonic())
            if message is None:
                break
            self.ready = "ready" in message
        return self.ready and self.alive()

    def launch(self, argv: list[str], env: dict[str, str], cwd: str, out: Path, cgroup: str | None = None) -> None:
        """Start one job's node agent (argv: its arguments) and return once it was forked; ``cgroup``:
        the ``cgroup.procs`` of the job's cgroup, which the agent enters first
        (:mod:`prefect_sgpu.launch.job_cgroup`)."""
        self.exit_code = None
        self.agent_pid = None
        self._send(op="launch", argv=argv, env=env, cwd=cwd, out=str(out), **({"cgroup": cgroup} if cgroup else {}))
        until = time.monotonic() + 30.0
        while self.agent_pid is None:
            message = self._next(until - time.monotonic())
            if message is not None and "started" in message:
                self.agent_pid = int(message["started"])
            elif not self.alive() or time.monotonic() > until:
                raise ProvisioningError(self.broken or f"warm node {self.index} did not start the job's agent")

    def poll(self) -> int | None:
        """The job's exit code once its agent ended and the node killed what it left; else None."""
        while self.exit_code is None and self._next(0) is not None:
            pass
        return self.exit_code

    def stop(self, grace: float) -> None:
        """Ask the job's agent to stop; the node kills everything of the job after ``grace``."""
        if self.agent_pid is not None and self.exit_code is None and self.alive():
            try:
                self._send(op="stop", grace=grace)
            except OSError:
                self.broken = f"warm node {self.index} is gone"

    def wait_job(self, timeout: float) -> bool:
        until = time.monotonic() + timeout
        while self.agent_pid is not None and self.poll() is None:
            if not self.alive() or time.monotonic() > until:
                return False
            self._next(min(0.1, max(until - time.monotonic(), 0.0)))
        return True

    def close(self, timeout: float = 10.0) -> None:
        """End the node: end of file on its stdin makes it kill what runs and exit; forced after ``timeout``."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            self.proc.wait(timeout=10)
        self.broken = self.broken or "closed"


def _tail(path: Path, size: int = 2000) -> str:
    try:
        return path.read_bytes()[-size:].decode("utf-8", "replace").strip() or "(empty)"
    except OSError:
        return "(unreadable)"


@dataclass(kw_only=True)
class Pooled:
    """What the pool keeps of anything warm (local warm sets, Ray warm groups): its shape and its
    idle time. Subclasses say whether it can serve another job (``healthy``) and how it ends."""

    key: tuple[Any, ...]
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    jobs: int = 0
    idle_since: float = 0.0
    keep_warm: float = 0.0
    owner: int = 0
    in_use: bool = True
    closed: bool = False

    def healthy(self) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


@dataclass(kw_only=True)
class WarmSet(Pooled):
    """The warm nodes of one allocation shape, and the GPUs they hold."""

    nodes: list[WarmNodeProcess]
    lease: Any = None  # the GpuLease (prefect_sgpu.compute.leases) its node holds, if any

    @property
    def gpus(self) -> list[str]:
        return list(self.lease.gpus) if self.lease is not None else []

    def healthy(self) -> bool:
        return not self.closed and all(n.alive() for n in self.nodes)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for node in self.nodes:  # end of file to all first: they stop together
            try:
                if node.proc.stdin is not None:
                    node.proc.stdin.close()
            except OSError:
                pass
        for node in self.nodes:
            node.close()
        if self.lease is not None:
            self.lease.close()
        logger.debug("warm set %s closed after %d job(s)", self.id, self.jobs)


def start_set(key: tuple[Any, ...], argvs: list[list[str]], env: dict[str, str], logs: Path,
              lease: Any, fds_of: Callable[[int], list[int]], until: float,
              cancel: threading.Event, run_id: str, timeout: float) -> WarmSet:
    """Start one warm node per argv and wait until all have preloaded; on any failure none is left."""
    nodes: list[WarmNodeProcess] = []
    warm = WarmSet(key=key, nodes=nodes, lease=lease)
    try:
        for index, argv in enumerate(argvs):
            nodes.append(WarmNodeProcess(index, argv, env, logs / f"warm-{warm.id}-node-{index}.log", fds_of(index)))
        for node in nodes:
            node.wait_ready(until, cancel, run_id, timeout)
    except BaseException:
        warm.close()
        raise
    return warm


class WarmPool:
    """This process's idle warm sets, by shape; one reaper thread ends the ones idle too long."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sets: list[Pooled] = []
        self._wake = threading.Event()
        self._reaper: threading.Thread | None = None

    def take(self, key: tuple[Any, ...], owner: int) -> Any:
        """An idle healthy set of this shape, now in use by ``owner``; broken ones are closed."""
        broken: list[Pooled] = []
        found = None
        with self._lock:
            for warm in list(self._sets):
                if warm.in_use or warm.key != key:
                    continue
                if not warm.healthy():
                    self._sets.remove(warm)
                    broken.append(warm)
                    continue
                warm.in_use, warm.owner, found = True, owner, warm
                break
        for warm in broken:
            warm.close()
        return found

    def add(self, warm: Pooled, owner: int) -> None:
        with self._lock:
            warm.in_use, warm.owner = True, owner
            self._sets.append(warm)

    def give_back(self, warm: Pooled, keep_warm: float) -> None:
        """After a job: idle, for the next job of its shape, until ``keep_warm`` seconds pass (closed
        at once when its owner was closed meanwhile, or when it is not healthy)."""
        if warm.keep_warm < 0 or keep_warm <= 0 or not warm.healthy():
            self.discard(warm)
            return
        with self._lock:
            warm.in_use, warm.idle_since, warm.keep_warm = False, time.monotonic(), keep_warm
            warm.jobs += 1
            if self._reaper is None or not self._reaper.is_alive():
                self._reaper = threading.Thread(target=self._reap, name="sgpu-warm-reaper", daemon=True)
                self._reaper.start()
        self._wake.set()

    def discard(self, warm: Pooled) -> None:
        with self._lock:
            if warm in self._sets:
                self._sets.remove(warm)
        warm.close()

    def close(self, owner: int | None = None) -> int:
        """Close idle sets (of ``owner``, or all); sets in a job close when it gives them back."""
        with self._lock:
            gone = [w for w in self._sets if not w.in_use and (owner is None or w.owner == owner)]
            for warm in self._sets:
                if warm.in_use and (owner is None or warm.owner == owner):
                    warm.keep_warm = -1.0  # closed on give_back
            for warm in gone:
                self._sets.remove(warm)
        for warm in gone:
            warm.close()
        return len(gone)

    def idle(self) -> list[Any]:
        with self._lock:
            return [w for w in self._sets if not w.in_use]

    def _reap(self) -> None:
        while True:
            self._wake.wait(1.0)
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                expired = [w for w in self._sets if not w.in_use and now - w.idle_since >= w.keep_warm]
                for warm in expired:
                    self._sets.remove(warm)
            for warm in expired:
                logger.debug("warm set %s idle for %.0fs: closing it", warm.id, now - warm.idle_since)
                warm.close()


POOL = WarmPool()


def release_warm() -> int:
    """Close every idle warm allocation of this process now; returns how many were closed.

    Warm sets that are in a job close when that job ends."""
    return POOL.close()


atexit.register(release_warm)


def check_keep_warm(field: str, value: Any, zero: str) -> float:
    """``keep_warm`` seconds as a float, or SGPUConfigError naming ``field`` (``zero``: what 0 means)."""
    try:
        seconds = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError):
        seconds = -1.0
    if seconds < 0:
        raise SGPUConfigError(field, value, f"seconds (a number >= 0; 0: {zero})")
    return seconds


def warm_node_argv(index: int, shm_size: str = "") -> list[str]:
    """``shm_size``: the warm node mounts a /dev/shm of its own (it must be in its own mount namespace)."""
    return [sys.executable, "-m", "prefect_sgpu.launch.warm_node", f"--node-index={index}",
            *([f"--shm-size={shm_size}"] if shm_size else [])]
