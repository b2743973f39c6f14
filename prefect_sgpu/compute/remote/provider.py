"""What a cloud gives the remote-node wing: its machines, and the guarantees of each call.

:class:`Provider` is implemented once per cloud (EC2's:
:class:`prefect_sgpu.compute.ec2.instances.EC2Provisioner`); launching machines is the
cloud's compute's own ``_provision`` (:class:`prefect_sgpu.compute.remote.nodes.RemoteNodeCompute`).
What a dead driver's runs leave in the cloud is found and removed through the provider too
(:meth:`Provider.find_leftovers`, :meth:`Provider.remove_leftovers`), so the sweeper
(:mod:`prefect_sgpu.compute.remote.sweep`) judges runs without knowing which cloud holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from prefect_sgpu.store import Store

#: what a leftover is to the sweeper: a machine, something machines use (a network or placement
#: group), a secret of the run, or the run's own cloud identity; removal goes in this order
LeftoverCategory = Literal["machine", "group", "secret", "identity"]
LEFTOVER_ORDER: tuple[LeftoverCategory, ...] = ("machine", "group", "secret", "identity")


@dataclass(frozen=True)
class CloudLeftover:
    """One thing a cloud holds for a run of a store, as :meth:`Provider.find_leftovers` lists it."""

    run_id: str
    category: LeftoverCategory
    #: what people call it in this cloud ("instance", "security group", "SSM parameter", ...)
    kind: str
    #: the cloud's id or name of it
    name: str
    #: the run's driver-heartbeat TTL as recorded on it when it was made; None when it records none
    heartbeat_ttl_s: float | None = None


@dataclass
class LeftoverScan:
    """What one :meth:`Provider.find_leftovers` call found, and what it could not list."""

    found: list[CloudLeftover] = field(default_factory=list)
    #: one line per part of the cloud that could not be listed ("what: error")
    errors: list[str] = field(default_factory=list)


class Machine(Protocol):
    """One provisioned machine, as the wing needs it."""

    #: the cloud's id of the machine: documents are bound to it, states are read by it
    id: str
    #: the address peers reach it at (node 0's is the rendezvous host); from the cloud's API, never a node
    private_ip: str


class Provider(Protocol):
    """What a cloud gives the remote-node wing besides launching machines (the compute's ``_provision``).

    EC2's is :class:`prefect_sgpu.compute.ec2.instances.EC2Provisioner`.
    """

    #: the states of a machine that will not run a job again (lost, reclaimed, stopped)
    dead_states: tuple[str, ...]

    def instance_states(self, ids: list[str]) -> dict[str, str]:
        """Each machine's state by id. An id the cloud no longer knows reads as a dead state; a
        failed call is logged and returns what it has (possibly nothing): the caller asks again.
        Never raises, spends nothing, safe from any thread."""

    def terminate(self, launch_id: str) -> list[str]:
        """End every machine (and group) launched for ``launch_id`` (a run id or a lease id),
        whether or not this process launched it. Idempotent; returns what it removed."""

    def terminate_machines(self, ids: list[str]) -> list[str]:
        """End these machines alone (a lost node's, when only it is replaced); idempotent, the groups
        stay. Returns those ended."""

    def put_secret(self, name: str, value: str, description: str, kms_key_id: str | None = None) -> None:
        """Store ``value`` encrypted under ``name`` where the run's nodes (and only they, through
        the run's identity) read it; overwritten if it exists. Raises on failure."""

    def delete_secret(self, name: str) -> bool:
        """Delete the secret ``name``; False when it was not there. Never raises (logged)."""

    def cost(self, instances: list[Any], started: float, ended: float) -> dict[str, Any]:
        """Machine-hours and their price between two wall-clock times (may raise: prices are optional)."""

    def find_leftovers(self, store: "Store") -> LeftoverScan:
        """Everything this cloud still holds for runs of ``store``: machines not yet ended, their
        groups, the runs' secrets and identities. Only what was marked with ``store``'s root URI when
        it was made is listed (another store's runs, and anything unmarked, never are), each with its
        run id and, where recorded, the run's heartbeat TTL. A part of the cloud that cannot be listed
        is named in ``errors`` and the rest is still listed. Spends nothing, removes nothing."""

    def remove_leftovers(self, run_id: str, leftovers: list[CloudLeftover], wait: bool = True) -> list[CloudLeftover]:
        """Remove ``leftovers`` of run ``run_id`` (as :meth:`find_leftovers` listed them): machines
        first, then what they used, then the run's secrets and identity. Returns those this call removed
        (one already gone is not). ``wait=False`` never waits for machines to end: what they still use
        stays for a later pass. Raises on a failure other than "already gone"; idempotent, and safe while
        another sweeper removes the same run."""
