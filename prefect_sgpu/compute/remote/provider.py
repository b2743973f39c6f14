"""What a cloud gives the remote-node wing: its machines, and the guarantees of each call.

:class:`Provider` is implemented once per cloud (EC2's:
:class:`prefect_sgpu.compute.ec2.instances.EC2Provisioner`); launching machines is the
cloud's compute's own ``_provision`` (:class:`prefect_sgpu.compute.remote.nodes.RemoteNodeCompute`).
"""

from __future__ import annotations

from typing import Any, Protocol


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
