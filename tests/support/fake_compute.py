"""A compute that runs every rank as a thread of the test process: fast unit tests of the driver.

It keeps the contract (typed request, deadline and cancel in acquire, events from poll,
idempotent release) and records every call, so a test can check what the driver asked
for. Ranks run the real payload code (``rank_main.run_payload``) and seal real envelopes
into the job folder; what they cannot do is be separate processes.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from prefect_sgpu.protocol import jobfolder
from prefect_sgpu.protocol import payload
from prefect_sgpu.compute.base import (
    AllocatedNode,
    Allocation,
    Compute,
    Event,
    JobLaunch,
    NodeExited,
    NodeLost,
    Released,
    Request,
)
from prefect_sgpu.errors import JobCancelled, LaunchTimeout
from prefect_sgpu.protocol.jobfolder import NodeStatus
from prefect_sgpu.spec import JobSpec, Plan


@dataclass
class FakeAllocation(Allocation):
    threads: list[threading.Thread] = field(default_factory=list)
    codes: dict[int, int] = field(default_factory=dict)
    reported: set[int] = field(default_factory=set)


class FakeCompute(Compute):
    name = "fake"
    remote = False

    def __init__(self, nodes: int = 1, acquire_blocks: bool = False, lose_node: int | None = None,
                 node_exit: dict[int, int] | None = None, lose_times: int | None = None) -> None:
        self.nodes = nodes
        #: in how many gangs (acquires) ``lose_node`` is lost; None: in every one
        self.lose_times = lose_times
        self.acquired = 0
        self.acquire_blocks = acquire_blocks
        self.lose_node = lose_node
        self.node_exit = node_exit or {}
        self.calls: list[tuple[str, Any]] = []
        self.releases = 0

    def plan(self, spec: JobSpec, run_id: str) -> Request:
        plan = Plan(nodes=self.nodes, procs_per_node=spec.gpus // self.nodes, device="cpu")
        return Request(run_id=run_id, compute=self.name, plan=plan, spec=spec, heartbeat_ttl_s=60.0)

    def acquire(self, request: Request, folder: jobfolder.JobFolder, deadline: float,
                cancel: threading.Event) -> FakeAllocation:
        self.calls.append(("acquire", deadline))
        self.acquired += 1
        while self.acquire_blocks:
            if cancel.wait(0.05):
                raise JobCancelled("cancelled while acquiring")
            if time.monotonic() > deadline:
                raise LaunchTimeout(request.run_id, request.spec.timeout, phase="acquire")
        nodes = [AllocatedNode(i, f"127.0.0.{i + 1}", socket.gethostname()) for i in range(request.plan.nodes)]
        return FakeAllocation(request=request, folder=folder, nodes=nodes)

    def start(self, allocation: Allocation, launch: JobLaunch) -> None:
        assert isinstance(allocation, FakeAllocation)
        self.calls.append(("start", launch))
        plan = allocation.plan
        for node in range(plan.nodes):
            thread = threading.Thread(target=self._node, args=(allocation, node), daemon=True)
            allocation.threads.append(thread)
            thread.start()

    def _node(self, allocation: FakeAllocation, node: int) -> None:
        from prefect_sgpu.launch.rank_main import run_payload

        folder = allocation.folder
        sealed = folder.store.get(folder.run_id, jobfolder.PAYLOAD) or b""
        plan = allocation.plan
        worst = 0
        for local in range(plan.procs_per_node):
            rank = node * plan.procs_per_node + local
            base = {"rank": rank, "node": node, "local_rank": local, "host": "fake"}
            envelope, code = run_payload(sealed, folder.key, folder.run_id, base)
            folder.put_result(rank, payload.dump_envelope(envelope))
            worst = worst or code
        code = self.node_exit.get(node, worst) if self._losing() else worst
        if not (node == self.lose_node and self._losing()):
            folder.put_status(node, NodeStatus(node=node, host="fake", exit_code=code))
        allocation.codes[node] = code

    def poll(self, allocation: Allocation) -> list[Event]:
        assert isinstance(allocation, FakeAllocation)
        events: list[Event] = []
        for node, code in sorted(allocation.codes.items()):
            if node in allocation.reported:
                continue
            allocation.reported.add(node)
            if node == self.lose_node and self._losing():
                events.append(NodeLost(node, f"node {node} vanished"))
            else:
                events.append(NodeExited(node, code, allocation.folder.status(node)))
        return events

    def _losing(self) -> bool:
        return self.lose_times is None or self.acquired <= self.lose_times

    def stop(self, allocation: Allocation, grace: float = 10.0) -> None:
        self.calls.append(("stop", grace))

    def release(self, allocation: Allocation) -> Released:
        self.releases += 1
        allocation.released = True
        return Released(gone=[f"{len(allocation.nodes)} fake node(s)"])
