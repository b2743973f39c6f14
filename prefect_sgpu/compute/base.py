"""The compute contract: what every place a job can run promises the driver.

A compute turns a validated :class:`~prefect_sgpu.spec.JobSpec` into running ranks
and gives everything back afterwards. Two kinds are first-class and speak the same
contract, so the driver never asks which kind it holds:

- **node computes** (local processes, EC2) acquire nodes and start one torch elastic
  node agent per node from the commands in :class:`JobLaunch`;
- **job computes** (an existing Ray cluster) run the whole job themselves from the
  payload in the job folder and report it as one node.

Both write rank logs and sealed result envelopes into the job folder, and both report
through :meth:`Compute.poll` as typed events. The driver calls, in this order::

    request = compute.plan(spec, run_id)          # spends nothing; dry_run prints this object
    allocation = compute.acquire(request, folder, deadline, cancel)
    compute.start(allocation, launch)
    while ...: events = compute.poll(allocation)  # NodeUp / NodeExited / NodeLost
    compute.stop(allocation, grace)               # on failure, cancel, timeout
    released = compute.release(allocation)        # always, even after a failed acquire

Adding a compute means one module implementing this class, registered in the
conformance suite (``tests/compute/test_conformance.py``).
"""

from __future__ import annotations

import sys
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from prefect_sgpu.spec import JobSpec, Plan

if TYPE_CHECKING:
    from prefect_sgpu.compute.remote.sweep import Sweeper
    from prefect_sgpu.environment import EnvironmentOptions
    from prefect_sgpu.protocol.jobfolder import JobFolder, NodeStatus
    from prefect_sgpu.store import Store


#: never handed to a node: ranks do not need Prefect's API, and must not hold its key
SECRET_ENV = ("PREFECT_API_KEY", "PREFECT_API_AUTH_STRING", "PREFECT_CLOUD_API_KEY",
              "SGPU_CHECKPOINT_SECRET")  # the driver's: a rank gets its own location's key only
#: shown as *** wherever a launch is printed
MASKED_ENV = ("SGPU_PAYLOAD_KEY", "SGPU_CHECKPOINT_KEY")


#: the secret settings of Prefect's schema (below) as of Prefect 3.8, for a driver that never imported
#: Prefect: reading the schema costs Prefect's import (about a second), which a call outside a flow
#: run does not otherwise pay. A test checks that the installed Prefect's schema names no other.
KNOWN_PREFECT_SECRETS = ("PREFECT_API_AUTH_STRING", "PREFECT_API_DATABASE_CONNECTION_URL",
                         "PREFECT_API_DATABASE_PASSWORD", "PREFECT_API_KEY", "PREFECT_CLOUD_API_KEY",
                         "PREFECT_SERVER_API_AUTH_STRING", "PREFECT_SERVER_DATABASE_CONNECTION_URL",
                         "PREFECT_SERVER_DATABASE_PASSWORD")


def prefect_secret_settings() -> tuple[str, ...]:
    """The environment variables of every secret Prefect setting (API key, auth strings, database
    password and URL): read from Prefect's own settings schema where Prefect is imported already,
    so a new one is covered too; else the known ones, without importing Prefect."""
    if "prefect.settings" not in sys.modules:
        return tuple(sorted({*SECRET_ENV, *KNOWN_PREFECT_SECRETS}))
    return tuple(sorted({*KNOWN_PREFECT_SECRETS, *schema_secret_settings()}))


@lru_cache(maxsize=1)
def schema_secret_settings() -> tuple[str, ...]:
    """The secret settings of the installed Prefect's settings schema (and ``SECRET_ENV``); imports Prefect."""
    names = set(SECRET_ENV)
    try:
        from prefect.settings.models.root import Settings

        schema = Settings.model_json_schema()
    except Exception:  # noqa: BLE001 - an older or newer Prefect: the known names still go
        return tuple(sorted(names))
    for model in [schema, *schema.get("$defs", {}).values()]:
        for prop in model.get("properties", {}).values():
            kinds = [prop, *prop.get("anyOf", [])]
            if any(isinstance(k, dict) and k.get("format") == "password" for k in kinds):
                names.update(prop.get("supported_environment_variables") or [])
    return tuple(sorted(names))


def node_base_environment(environ: dict[str, str]) -> dict[str, str]:
    """The caller's environment minus secrets that ranks must not see."""
    secret = set(prefect_secret_settings())
    return {k: v for k, v in environ.items() if k not in secret}


def rank_prefect_environment() -> dict[str, str]:
    """What every rank's environment says about Prefect's secret settings: empty. An environment
    variable outranks every other source Prefect reads (a profile, ``.env``, ``prefect.toml``,
    ``pyproject.toml`` in the working directory), so none of them hands a rank a credential.
    The database URL is only removed, not emptied: Prefect derives its default from the rank's
    own Prefect home (the node agent gives every job one)."""
    return {name: "" for name in prefect_secret_settings() if "CONNECTION_URL" not in name}


def masked(env: dict[str, str]) -> dict[str, str]:
    return {k: ("***" if k in MASKED_ENV else v) for k, v in env.items()}


# --- what plan() returns and acquire() consumes ----------------------------------------------


@dataclass(frozen=True)
class Request:
    """Everything ``acquire`` will ask for, decided before anything is spent.

    Computes subclass it with their own typed fields (EC2: the ``run_instances``
    request). ``describe()`` is what ``dry_run`` prints, so what users see is exactly
    what is sent.
    """

    run_id: str
    compute: str
    plan: Plan
    spec: JobSpec
    #: seconds without a driver heartbeat after which this compute's nodes stop themselves
    heartbeat_ttl_s: float

    def describe(self) -> dict[str, Any]:
        return {"compute": self.compute, "run_id": self.run_id, "plan": self.plan,
                "heartbeat_ttl_s": self.heartbeat_ttl_s}


# --- what acquire() returns ------------------------------------------------------------------


@dataclass
class AllocatedNode:
    """One node of an allocation: where it is and what it runs on."""

    index: int
    #: the address other nodes reach it at (node 0's is the rendezvous host)
    address: str
    #: a name for messages (hostname, instance id)
    host: str
    #: the cloud instance behind it, when there is one
    instance_id: str | None = None


@dataclass
class Allocation:
    """The nodes a job holds, from ``acquire`` until ``release``.

    Computes subclass it for their own state (processes, instances, a Ray run).
    """

    request: Request
    folder: "JobFolder"
    nodes: list[AllocatedNode]
    released: bool = False

    @property
    def run_id(self) -> str:
        return self.request.run_id

    @property
    def plan(self) -> Plan:
        return self.request.plan

    def kept_in(self) -> Any:
        """The warm set (a :class:`~prefect_sgpu.compute.warm_pool.Pooled`) these nodes are kept in
        between jobs, or None (the default: nodes of this job alone)."""
        return None


# --- what start() consumes -------------------------------------------------------------------


@dataclass(frozen=True)
class NodeCommand:
    """The node agent one node runs (node computes)."""

    node: int
    argv: list[str]


@dataclass(frozen=True)
class JobLaunch:
    """What to start: the same for every compute.

    ``env`` is every rank's extra environment (no secrets: the job key travels
    separately, through the job folder's own channel). Node computes run
    ``commands``; job computes run the payload in ``folder`` directly.
    """

    env: dict[str, str]
    commands: list[NodeCommand]
    rendezvous: str
    #: rank environment read from Prefect Secret blocks: each compute delivers it through a channel
    #: of its own that nothing stores in plaintext (process environment, SSM SecureString, Ray)
    secrets: dict[str, str] = field(default_factory=dict, repr=False)
    #: the command of a node that joins later (an elastic job's), from its index and address; None: none can
    node_command: "Callable[[int, str], NodeCommand] | None" = field(default=None, repr=False, compare=False)

    def describe(self, compute: "Compute", request: Request) -> list[dict[str, Any]]:
        import shlex

        return [{"index": c.node, "command": shlex.join(compute.command_line(request, c)), "env": masked(self.env),
                 "secrets": sorted(self.secrets)} for c in self.commands]


# --- what poll() reports ---------------------------------------------------------------------


@dataclass(frozen=True)
class NodeUp:
    """A node's agent (or the job compute's run) is running."""

    node: int
    host: str


@dataclass(frozen=True)
class NodeExited:
    """A node's agent ended; ``status`` is its sealed report, when it wrote one."""

    node: int
    exit_code: int
    status: "NodeStatus | None" = None


@dataclass(frozen=True)
class NodeLost:
    """A node went away before its ranks finished (instance gone, silent too long)."""

    node: int
    reason: str


@dataclass(frozen=True)
class NodeNotice:
    """The cloud announced it will take this node away (a spot interruption).

    Its ranks were told (``runtime.preemption_requested()``); whatever the gang does next,
    its end counts as infrastructure loss, which the driver recovers from.

    With ``reclaim=False`` the cloud only recommended moving work off the node (an EC2 rebalance
    recommendation): a warning, shown and logged; the node is not lost, nothing is replaced or
    relaunched for it, and a reclaim notice may follow (a second event) or never come."""

    node: int
    notice: str
    reclaim: bool = True


Event = NodeUp | NodeExited | NodeLost | NodeNotice


# --- what release() guarantees ---------------------------------------------------------------


@dataclass
class Released:
    """What ``release`` removed, and what the job cost, for the result and the task's artifact."""

    gone: list[str] = field(default_factory=list)
    cost: dict[str, Any] | None = None


def total_cost(costs: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Several costs as one (a job's gangs, machines that ran for different times): numbers add up,
    parts (dicts: a market's, the storage's) add up part by part, lists join, the rest is the last one's."""
    known = [c for c in costs if c]
    if len(known) <= 1:
        return known[0] if known else None
    total: dict[str, Any] = {}
    for cost in known:
        _add_cost(total, cost)
    return total


def _add_cost(total: dict[str, Any], cost: dict[str, Any]) -> None:
    for key, value in cost.items():
        if isinstance(value, dict) and isinstance(total.get(key, {}), dict):
            total[key] = dict(total.get(key, {}))
            _add_cost(total[key], value)
        elif isinstance(value, list) and isinstance(total.get(key, []), list):
            seen = total.get(key, [])
            total[key] = [*seen, *(v for v in value if isinstance(v, dict) or v not in seen)]
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(total.get(key, 0), (int, float)):
            total[key] = round(total.get(key, 0) + value, 6)
        else:
            total[key] = value


class Compute(ABC):
    """Where jobs run. Every method's promise is part of the contract.

    Subclasses set ``name`` (``local``, ``ec2``, ``ray``), ``remote`` (True when the
    compute runs on other machines, so ``remote=True`` jobs may use it) and
    ``runs_node_agents`` (node compute or job compute).
    """

    name: ClassVar[str]
    remote: ClassVar[bool]
    #: True: a node compute (start runs ``JobLaunch.commands``, one node agent per node);
    #: False: a job compute (start runs the payload itself; launchers that need nodes refuse it)
    runs_node_agents: ClassVar[bool] = True
    #: seconds the driver keeps polling after a node failed, for a ``NodeLost`` that explains it
    #: (a lost node's peers often fail first, on a broken collective)
    loss_grace_s: ClassVar[float] = 1.0
    #: True: this compute's nodes build the job's environment themselves from what the driver shipped
    #: to the store (:mod:`prefect_sgpu.environment.ship`), so the driver hands them the package
    #: indexes' credentials with the job's secrets; False: the nodes run one they already have
    ships_environment: ClassVar[bool] = False
    #: the ``environment=`` this compute's block gave, set on the instance by the block; a spec layer
    #: below the call's (:func:`prefect_sgpu.spec.compute_layer`). None: the block gave none
    sgpu_environment: "EnvironmentOptions | None" = None

    # -- before anything is spent -------------------------------------------------------------

    def default_store(self) -> "Store | None":
        """A store this compute's nodes can reach; None: the caller's default local store."""
        return None

    def check_store(self, store: "Store") -> None:
        """Raise SGPUConfigError if this compute's nodes cannot use ``store``. Spends nothing."""

    def check_secrets(self, secrets: dict[str, str]) -> None:
        """Raise SGPUConfigError if this compute cannot deliver ``secrets`` (the rank environment
        read from the job's Secret blocks, as :class:`JobLaunch` carries it): a channel's size limit,
        say. The driver calls it once the blocks are read, before anything is spent."""

    @abstractmethod
    def plan(self, spec: JobSpec, run_id: str) -> Request:
        """Resolve ``spec`` into a typed request, or raise SGPUConfigError naming the field.

        Pure: no process, VM, connection or cloud call that costs money. The returned
        object is exactly what ``acquire`` consumes and what ``dry_run`` prints.
        """

    # -- spending ------------------------------------------------------------------------

    def replan(self, request: Request, gang: int) -> Request:
        """The request for replacement capacity after infrastructure loss (``gang`` counts from 1).

        Same resources as ``request``; a compute whose requests are idempotent per run
        (EC2's ClientToken) makes them new here, so the relaunch gets new nodes. Pure."""
        return request

    @abstractmethod
    def acquire(self, request: Request, folder: "JobFolder", deadline: float,
                cancel: threading.Event) -> Allocation:
        """The job's nodes, ready for ``start``.

        ``deadline`` is a ``time.monotonic()`` value (the job's own timeout): past it,
        acquire gives back what it got and raises ``LaunchTimeout`` (phase says where).
        Once ``cancel`` is set it gives back what it got and raises ``JobCancelled``.
        On any exception nothing acquired is left behind. The driver's heartbeat in ``folder``
        is the driver's own (:mod:`prefect_sgpu.driver.heartbeat`): fresh from before acquire until the
        folder goes; no compute writes it.
        """

    def replace_nodes(self, allocation: Allocation, lost: set[int], request: Request, deadline: float,
                      cancel: threading.Event) -> Released | None:
        """After infrastructure loss and ``stop``: keep the allocation's other nodes, end the ``lost``
        ones and put new nodes in their places (the same indices), ready for the next ``start``
        (``request``: ``replan``'s, for the gang that starts next). Returns what was ended, with its
        cost; None when this compute cannot, or the nodes it would keep are unfit: the allocation is
        then as it was, and the driver releases it and acquires a whole new one. An exception leaves
        everything to ``release``, as after ``acquire``."""
        return None

    def replace_elastic_node(self, allocation: Allocation, node: int, request: Request, deadline: float,
                             cancel: threading.Event) -> Released | None:
        """While an elastic job goes on without its lost ``node`` (the others keep running): end what is
        left of it and put a new node in its place (the same index), ready for a ``start`` of that node's
        command alone, whose agent joins the running job's next round. May take as long as capacity does:
        the driver calls it from a thread of its own. Returns what was ended, with its cost; None when this
        compute cannot (the job then goes on with fewer nodes). After ``release`` it puts nothing back."""
        return None

    @abstractmethod
    def start(self, allocation: Allocation, launch: JobLaunch) -> None:
        """Start the job: node computes run ``launch.commands`` (one agent per node);
        job computes run the payload in the folder. Returns once started, not finished."""

    @abstractmethod
    def poll(self, allocation: Allocation) -> list[Event]:
        """What happened since the last poll. Cheap enough to call every 50 ms (computes
        rate-limit their own remote calls). Each node reports ``NodeExited`` or ``NodeLost``
        exactly once; ranks' envelopes are in the folder before their node's ``NodeExited``."""

    @abstractmethod
    def stop(self, allocation: Allocation, grace: float = 10.0) -> None:
        """Stop every rank: ask, wait ``grace`` seconds, then force. Returns when no rank
        runs any more (or its node is known gone). Safe to call more than once."""

    @abstractmethod
    def release(self, allocation: Allocation) -> Released:
        """Give back everything ``acquire`` took. Idempotent; runs on every exit path.

        Afterwards nothing of the job runs or is billed: no process (local), no
        instance, security group, placement group or SSM parameter (EC2), no Ray Train
        run or actor (Ray). ``Released.gone`` lists what was removed.
        """

    def price_per_hour(self, request: Request) -> float | None:
        """US dollars an hour that ``request``'s machines cost together while they run, as
        :meth:`running_cost` prices them; None (the default): this compute has no price, and a job's
        ``max_cost_usd`` is refused before anything is spent. Pure."""
        return None

    def running_cost(self, allocation: Allocation) -> dict[str, Any] | None:
        """What the allocation's machines have cost from their launch until now, in ``Released.cost``'s
        shape (``usd``, ``usd_per_hour``, ...); None (the default): no price. The driver reads it to hold
        a job to its ``max_cost_usd`` (:mod:`prefect_sgpu.driver.cost_cap`). May raise: prices are optional."""
        return None

    def command_line(self, request: Request, command: NodeCommand) -> list[str]:
        """The exact argv a node runs for ``command`` (``dry_run`` prints this)."""
        return list(command.argv)

    def rendezvous_endpoint(self, allocation: Allocation) -> str:
        """``host:port`` of node 0's c10d store for node computes (here: a free local port on
        node 0's address); job computes, which rendezvous on their own, return ``""``."""
        from prefect_sgpu.compute.ports import free_port

        host = allocation.nodes[0].address
        return f"{host}:{free_port(host)}"

    def node_of_rank(self, allocation: Allocation, rank: int) -> int:
        """Which node ``rank`` runs on, for tagging its log lines. Node computes place ranks in
        order; a job compute whose scheduler places them (Ray) knows better and overrides this."""
        return rank // max(allocation.plan.procs_per_node, 1)

    def warm_set(self, allocation: Allocation) -> Any:
        """The warm set (a :class:`~prefect_sgpu.compute.warm_pool.Pooled`) this allocation's nodes were
        kept in between jobs, or None (the default: nodes of this job alone). The driver notes on it
        when the set passed the gang check, so an unchanged set is not checked again at every job.
        The default: what the allocation says it is kept in (:meth:`Allocation.kept_in`)."""
        return allocation.kept_in()

    def describe(self, allocation: Allocation) -> dict[str, Any]:
        """The allocation for people: nodes, addresses, hosts, instances."""
        return {"compute": self.name, "run_id": allocation.run_id,
                "nodes": [{"index": n.index, "address": n.address, "host": n.host,
                           **({"instance_id": n.instance_id} if n.instance_id else {})}
                          for n in allocation.nodes]}

    def sweeper(self, tracking_uri: str | None = None, **options: Any) -> "Sweeper | None":
        """What removes the leftovers of this compute's dead runs (:mod:`prefect_sgpu.compute.remote.sweep`),
        when they are more than files in a job store: a compute with a cloud returns a sweeper of its
        own store with its provider (what it lists and removes) and its nodes' heartbeat TTL;
        ``options`` are the :class:`~prefect_sgpu.compute.remote.sweep.Sweeper`'s. None (the default):
        its runs leave only files in the store it names (:meth:`default_store`), which the caller
        sweeps with the TTL of nodes on this machine. Spends nothing; removes nothing by itself."""
        return None

    def close(self) -> None:
        """Drop connections this compute opened (a Ray client); the task runner calls it at flow end."""
