"""The driver's end of one warm node process: starting it, and its JSON-lines channel.

A warm node (:mod:`prefect_sgpu.launch.warm_node`) is started by whoever keeps warm nodes on
a machine: the local compute's warm pool on the driver's machine
(:mod:`prefect_sgpu.compute.warm_pool`), and the lease node on a remote one
(:mod:`prefect_sgpu.launch.lease_node`). Both talk to it through :class:`WarmNodeProcess`.
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
from typing import Any

from prefect_sgpu.errors import JobCancelled, LaunchTimeout, ProvisioningError

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


def warm_node_argv(index: int, shm_size: str = "") -> list[str]:
    """``shm_size``: the warm node mounts a /dev/shm of its own (it must be in its own mount namespace)."""
    return [sys.executable, "-m", "prefect_sgpu.launch.warm_node", f"--node-index={index}",
            *([f"--shm-size={shm_size}"] if shm_size else [])]
