"""The driver's end of the agent template: one process per driver that has torch imported and
forks cold node agents.

A cold node agent started as a new interpreter spends about two CPU seconds importing torch
before it does anything, once per node of every job. The template pays that once per driver
process: it imports what a warm node preloads, then forks a fresh node agent for each node it
is asked for. The agent is the same program as a cold one: it never shares a job with another,
its ranks start as the job asks (forked or spawned), its environment is the job's whole, it
starts in the job's working directory, and with namespaces it is PID 1 of its own PID and
mount namespaces (:mod:`prefect_sgpu.launch.warm_node`). The template
itself never runs user code, never initialises a process group and never touches CUDA.

The driver starts the template and holds its channel, so this half lives on the compute side;
the template process is :mod:`prefect_sgpu.launch.agent_template` (it runs node agents), and
the messages between them are :mod:`prefect_sgpu.procs.template_wire`.

Agents outlive the template as cold agents outlive their driver: each stops itself when the
driver's heartbeat goes stale. The job key and secrets travel in the launch message, never on
disk.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

from prefect_sgpu.procs.template_wire import MAX_MESSAGE

logger = logging.getLogger("prefect_sgpu.compute.agent_template")

#: ``fork``: cold local node agents are forked from the driver's agent template; ``exec``: each
#: is a new interpreter (``python -m prefect_sgpu.launch.node_agent``)
AGENT_START_ENV = "PREFECT_SGPU_AGENT_START"
AGENT_STARTS = ("fork", "exec")
#: the module the template process runs
TEMPLATE_MODULE = "prefect_sgpu.launch.agent_template"
#: seconds to wait for a new template's imports before its agents start with exec instead
READY_TIMEOUT_S = 120.0


class TemplateUnavailable(RuntimeError):
    """The template could not start or fork an agent; the caller starts the agent with exec."""



class ForkedAgent:
    """A node agent forked by the template: the parts of ``subprocess.Popen`` the local compute uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        #: the command line of the cold agent this one stands for (its caller sets it; ``Popen.args``)
        self.args: list[str] = []
        self.returncode: int | None = None
        #: it ended after the template died, so its exit status is lost (its node's status file says)
        self.exit_unknown = False
        self._ended = threading.Event()

    def _exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"node agent {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def _orphaned(self) -> None:
        """The template is gone, and with it this agent's exit status: watch the process instead."""
        import psutil

        try:
            proc = psutil.Process(self.pid)
            proc.wait()
        except psutil.Error:
            pass
        self.exit_unknown = True
        self._exited(1)


class AgentTemplate:
    """The driver's handle on its template process."""

    def __init__(self, env: dict[str, str]) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE)
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", TEMPLATE_MODULE], stdin=theirs, stdout=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        finally:
            theirs.close()
        self.ready = threading.Event()
        self.gone = threading.Event()
        self._lock = threading.Lock()
        self._launching: dict[str, tuple[threading.Event, list[ForkedAgent]]] = {}
        self._agents: dict[int, ForkedAgent] = {}
        threading.Thread(target=self._read, name="sgpu-agent-template", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            if "ready" in message:
                self.ready.set()
            elif "started" in message:  # always before the same agent's "exited"
                agent = ForkedAgent(int(message["started"]))
                with self._lock:
                    self._agents[agent.pid] = agent
                    event, found = self._launching.pop(message["id"], (None, []))
                if event is None:  # its launch gave up waiting and started the node otherwise
                    _kill_group(agent.pid)
                    continue
                found.append(agent)
                event.set()
            elif "exited" in message:
                with self._lock:
                    agent = self._agents.pop(int(message["pid"]), None)
                if agent is not None:
                    agent._exited(int(message["exited"]))
        self.gone.set()
        self.ready.set()
        with self._lock:
            left, self._agents = list(self._agents.values()), {}
            launching, self._launching = list(self._launching.values()), {}
        for event, _ in launching:
            event.set()
        for agent in left:
            threading.Thread(target=agent._orphaned, name=f"sgpu-orphan-agent-{agent.pid}", daemon=True).start()

    def alive(self) -> bool:
        return not self.gone.is_set() and self.proc.poll() is None

    def launch(self, argv: list[str], env: dict[str, str], cwd: str, out: str, namespaces: bool,
               fds: list[int], timeout: float = 30.0) -> ForkedAgent:
        """Fork one node agent (``argv``: the node agent's arguments); raises ``TemplateUnavailable``."""
        if not self.ready.wait(READY_TIMEOUT_S) or not self.alive():
            raise TemplateUnavailable(f"the agent template (pid {self.proc.pid}) is not running")
        ident = uuid.uuid4().hex
        data = json.dumps({"op": "launch", "id": ident, "argv": argv, "env": env, "cwd": cwd, "out": out,
                           "namespaces": namespaces}).encode()
        if len(data) > MAX_MESSAGE:
            raise TemplateUnavailable(f"the launch message is {len(data)} bytes, over {MAX_MESSAGE}")
        event, found = threading.Event(), []
        with self._lock:
            self._launching[ident] = (event, found)
        try:
            socket.send_fds(self.sock, [data], fds)
        except OSError as exc:
            with self._lock:
                self._launching.pop(ident, None)
            raise TemplateUnavailable(f"the agent template (pid {self.proc.pid}) took no launch: {exc}") from exc
        if not event.wait(timeout) or not found:
            # a fork that comes late is an agent no one waits for: it finds no rendezvous and ends
            raise TemplateUnavailable(f"the agent template (pid {self.proc.pid}) forked no agent in {timeout:g} s")
        return found[0]

    def close(self, wait: bool = True) -> None:
        """End the template: end of file on its channel, after which it exits (its agents run on).
        ``wait=False`` (at interpreter exit) does not wait for it: the process unmaps torch's memory as
        it exits, a fraction of a second the driver's exit need not take (the template is its own
        session's and runs nothing after end of file)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # end of file: the template exits; its agents run on
            self.sock.close()
        except OSError:
            pass
        if not wait:
            return
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_TEMPLATE: AgentTemplate | None = None
_TEMPLATE_LOCK = threading.Lock()


def template(env: dict[str, str]) -> AgentTemplate:
    """This process's template, started on first use (and again if it died) with ``env``."""
    global _TEMPLATE
    with _TEMPLATE_LOCK:
        if _TEMPLATE is None or not _TEMPLATE.alive():
            _TEMPLATE = AgentTemplate(env)
        return _TEMPLATE


def _close_template() -> None:
    global _TEMPLATE
    with _TEMPLATE_LOCK:
        found, _TEMPLATE = _TEMPLATE, None
    if found is not None:
        found.close(wait=False)


def _forget_in_child() -> None:
    """A fork of the driver does not share its template (nor its lock)."""
    global _TEMPLATE, _TEMPLATE_LOCK
    _TEMPLATE, _TEMPLATE_LOCK = None, threading.Lock()


atexit.register(_close_template)
os.register_at_fork(after_in_child=_forget_in_child)


def agent_start() -> str:
    """How cold local agents start: ``PREFECT_SGPU_AGENT_START``, else ``fork``."""
    from prefect_sgpu.errors import SGPUConfigError

    raw = os.environ.get(AGENT_START_ENV, "").strip().lower() or "fork"
    if raw not in AGENT_STARTS:
        raise SGPUConfigError(AGENT_START_ENV, raw, f"one of {', '.join(AGENT_STARTS)}")
    return raw
