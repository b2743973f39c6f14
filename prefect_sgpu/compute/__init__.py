"""Where jobs run. One small protocol; local processes are the embedded default."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from prefect_sgpu.spec import Plan, Resources


#: never handed to a node: ranks do not need Prefect's API, and must not hold its key
SECRET_ENV = ("PREFECT_API_KEY", "PREFECT_API_AUTH_STRING", "PREFECT_CLOUD_API_KEY")


def node_base_environment(environ: dict[str, str]) -> dict[str, str]:
    """The caller's environment minus secrets that ranks must not see."""
    return {k: v for k, v in environ.items() if k not in SECRET_ENV}


@dataclass
class Node:
    index: int
    address: str
    handle: Any = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Allocation:
    run_id: str
    plan: Plan
    nodes: list[Node]
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class NodeLaunch:
    """What to start on one node: the agent's argv and environment."""

    node: Node
    argv: list[str]
    env: dict[str, str]


class Compute(ABC):
    """Acquire nodes, start one agent per node, watch them, always release."""

    #: a store this compute's nodes can reach (None: the caller's default local store)
    def default_store(self) -> Any:
        return None

    def rendezvous_endpoint(self, allocation: Allocation) -> str:
        """host:port of node 0's c10d store: a free port locally, a fixed one on remote nodes."""
        from prefect_sgpu.compute.ports import free_port

        host = allocation.nodes[0].address
        return f"{host}:{free_port(host)}"

    @abstractmethod
    def plan(self, resources: Resources) -> Plan:
        """Resolve resources into nodes x ranks, or raise SGPUConfigError. Spends nothing."""

    @abstractmethod
    def dry_run(self, run_id: str, plan: Plan, launches: list[NodeLaunch]) -> dict[str, Any]:
        """What acquire+start would do (requests, commands), without doing it."""

    @abstractmethod
    def acquire(self, run_id: str, plan: Plan, cancel: "threading.Event | None" = None) -> Allocation:
        """The job's nodes. A compute that waits for them (VMs booting) stops waiting once
        ``cancel`` is set, releases what it got and raises ``JobCancelled``."""

    @abstractmethod
    def start(self, allocation: Allocation, launch: NodeLaunch) -> None: ...

    @abstractmethod
    def poll(self, allocation: Allocation, node: Node) -> int | None:
        """The node agent's exit code, or None while it runs."""

    @abstractmethod
    def stop(self, allocation: Allocation, grace: float = 10.0) -> None:
        """Stop every node's processes: SIGTERM, ``grace`` seconds, then SIGKILL."""

    @abstractmethod
    def release(self, allocation: Allocation) -> None:
        """Give back everything acquired. Idempotent; runs on every exit path."""
