"""What the driver tracks of one remote-node job: its request and its machines, until release.

:class:`RemoteRequest` is what a remote-node compute's ``plan`` renders (a cloud subclasses it
with its own fields); :class:`RemoteAllocation` holds the job's machines, its secrets' names,
its warm lease and what polling has seen of each node
(:class:`~prefect_sgpu.compute.remote.nodes.RemoteNodeCompute` reads and writes it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefect_sgpu.compute.base import Allocation, Released, Request, total_cost
from prefect_sgpu.compute.remote.lease import WarmLease


@dataclass(frozen=True)
class RemoteRequest(Request):
    """What a remote-node job launches, rendered by ``plan``."""

    #: seconds every node's bootstrap gets to announce itself
    agent_timeout_s: float = 900.0
    #: seconds the machines wait for the next job of this shape (0: this job's own, ended after it)
    keep_warm: float = 0.0
    #: the lease the machines are launched for when no warm one fits; empty for a cold job
    lease_id: str = ""

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "agent_timeout_s": self.agent_timeout_s,
                **({"keep_warm": self.keep_warm, "lease": self.lease_id} if self.lease_id else {})}


@dataclass
class RemoteAllocation(Allocation):
    """One job's machines and what the driver tracks about them until release."""

    instances: list[Any] = field(default_factory=list)
    started: float = 0.0
    key_parameter: str | None = None
    #: the secret of the job's ``secrets=``, once written
    secrets_parameter: str | None = None
    progress: Any = None
    announced: set[int] = field(default_factory=set)
    reported: set[int] = field(default_factory=set)
    launched: bool = False
    polled: float = 0.0
    states_checked: float = 0.0
    states: dict[str, str] = field(default_factory=dict)
    alive_version: dict[int, str | None] = field(default_factory=dict)
    alive_changed: dict[int, float] = field(default_factory=dict)
    noticed: set[int] = field(default_factory=set)
    #: the version of each node's notice document last read (a reclaim notice replaces a rebalance one)
    notice_version: dict[int, str | None] = field(default_factory=dict)
    outcome: Released | None = None
    #: the warm lease this job runs on (None: a cold job, its machines its own)
    lease: WarmLease | None = None
    #: a node was lost or received a reclaim notice: its lease serves no other job
    lost: bool = False
    #: machines of lost nodes, ended when new ones took their places (:meth:`RemoteNodeCompute.replace_nodes`)
    retired: list[Any] = field(default_factory=list)
    #: when (wall clock) each machine that took a lost node's place was launched; the others: ``started``
    joined: dict[str, float] = field(default_factory=dict)

    def cost(self, provisioner: Any, machines: list[Any], ended: float) -> dict[str, Any] | None:
        """What ``machines`` cost from each one's launch to ``ended`` (may raise: prices are optional)."""
        since: dict[float, list[Any]] = {}
        for machine in machines:
            since.setdefault(self.joined.get(machine.id, self.started), []).append(machine)
        return total_cost([provisioner.cost(group, start, ended) for start, group in since.items()])
    #: release gave the lease back to the pool (its machines wait for the next job)
    kept: bool = False
    #: an elastic job's search for the nodes it still lacks (:class:`~prefect_sgpu.compute.remote.elastic.Growth`)
    growth: Any = None
    #: an elastic job's searches for a lost node's replacement, by node (each a ``Growth`` in place)
    replacing: dict[int, Any] = field(default_factory=dict)
    #: nodes whose machine an elastic job's replacement took over while the job ran: their commands are
    #: made again for the new machine's address
    put_back: set[int] = field(default_factory=set)

    def instance_id(self, node: int) -> str:
        return self.instances[node].id

    def kept_in(self) -> WarmLease | None:
        """The warm lease the job runs on (its gang check may stand for the lease's next jobs)."""
        return self.lease


def cost_text(cost: dict[str, Any] | None) -> str:
    if not cost:
        return ""
    hours = cost.get("instance_hours")
    usd = cost.get("usd", cost.get("estimated_usd"))
    if hours is None or usd is None:
        return str(cost)
    source = cost.get("price_source")
    return f"{hours:.4f} instance-hours, about ${usd:.4f}" + (f" ({source})" if source else "")
