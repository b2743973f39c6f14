"""The agent template process: it imports what a warm node preloads, then forks one fresh node
agent per launch message from its driver.

The driver starts it and holds its channel (:mod:`prefect_sgpu.compute.agent_template`, which
says why it exists and what a forked agent guarantees); the messages are
:mod:`prefect_sgpu.procs.template_wire`. It never runs user code, never initialises a process
group and never touches CUDA; each agent it forks runs the node agent as a warm node does
(:func:`prefect_sgpu.launch.warm_node.run_agent`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from prefect_sgpu.procs.template_wire import MAX_MESSAGE


class _Template:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.children = threading.Condition()
        self.agents: set[int] = set()

    def say(self, **message: Any) -> None:
        with self.lock:
            self.sock.send(json.dumps(message).encode())

    def launch(self, message: dict[str, Any], fds: list[int]) -> None:
        from prefect_sgpu.launch.warm_node import run_agent

        sys.stdout.flush()
        sys.stderr.flush()
        with self.children:  # held from fork to recording the pid: the reaper reports only agents
            pid = os.fork()
            if pid == 0:
                run_agent(message, self.sock.fileno(), forked=False, namespaces=bool(message.get("namespaces")),
                       title=True)
            self.agents.add(pid)
            self.children.notify_all()
            self.say(started=pid, id=message["id"])  # under the lock: before the reaper's "exited"
        for fd in fds:  # the agent holds its GPU leases now
            os.close(fd)

    def reap(self) -> None:
        while True:
            with self.children:
                while not self.agents:
                    self.children.wait()
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                time.sleep(0.05)
                continue
            with self.children:
                if pid not in self.agents:
                    continue
                self.agents.discard(pid)
            try:
                self.say(exited=os.waitstatus_to_exitcode(status), pid=pid)
            except OSError:
                return  # the driver is gone


def main() -> int:
    from prefect_sgpu.launch.warm_node import preload

    sock = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.close(null)
    for sig in (signal.SIGINT, signal.SIGHUP):  # its own session; the driver decides when it ends
        signal.signal(sig, signal.SIG_IGN)
    node = _Template(sock)
    preload()
    threading.Thread(target=node.reap, name="reaper", daemon=True).start()
    node.say(ready=os.getpid())
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 64)
        except OSError:
            break
        if not data:
            break
        message = json.loads(data)
        if message.get("op") == "launch":
            node.launch(message, fds)
        else:
            for fd in fds:
                os.close(fd)
    return 0


if __name__ == "__main__":
    # no interpreter teardown: unloading torch and the other preloaded modules costs CPU seconds the
    # driver's own exit waits for (it waits for this process), and nothing is left to flush (stdout
    # is /dev/null; the agents are processes of their own)
    os._exit(main())
