"""What the node bootstrap needs from the machine it runs on, whatever the cloud.

:mod:`prefect_sgpu.launch.bootstrap` runs the remote-node protocol over the store (sealed
documents, heartbeats, logs, results); everything it asks of the cloud goes through a
:class:`NodeHost`. EC2's is :class:`prefect_sgpu.launch.ec2_host.EC2NodeHost` (IMDSv2 and
SSM); another cloud is one more class with these methods.

Each method's guarantee:

- :meth:`NodeHost.identity`: who this node is, asked once at boot; it may wait for the
  metadata service to come up and raises when it never does.
- :meth:`NodeHost.read_secret`: a secret (a job's or a lease's key, a job's ``secrets=``)
  by the name the node derives from a run id, never from a document; raises when it is not
  there (yet) or cannot be read, and the caller decides how long to try.
- :meth:`NodeHost.delete_secret`: best effort; raises when it failed (the caller ignores
  it: the driver's release and the sweeper delete it too).
- :meth:`NodeHost.reclaim_notice`: a notice that the cloud will take the machine away
  (a spot interruption), or None; cheap to call every tick (it limits its own
  rate) and never raises for an unreachable metadata service.
- :meth:`NodeHost.rebalance_notice`: a warning that the cloud may take the machine away later,
  or never (an EC2 rebalance recommendation), or None; never a reclaim. Cheap and never raises,
  as :meth:`NodeHost.reclaim_notice`.
- :meth:`NodeHost.terminate`: end this machine through the cloud's API; raises when the
  API refused, and then :meth:`NodeHost.power_off` is the last resort.
- :meth:`NodeHost.error_text`: a short name for an error of this cloud's API, for logs.

A node's command line names its host (``--host ec2``); :data:`HOSTS` maps each name to the class
that implements it, as a ``"module:Class"`` string, and :func:`open_host` imports it only when
asked: this module imports nothing of any cloud. A new cloud adds one line to :data:`HOSTS` (or
its command line names its ``"module:Class"`` directly).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol

#: node host name (a node's ``--host``) -> the class implementing it, as ``"module:Class"``
HOSTS = {"ec2": "prefect_sgpu.launch.ec2_host:EC2NodeHost"}
#: the host of a node whose command line names none
DEFAULT_HOST = "ec2"


@dataclass(frozen=True)
class NodeIdentity:
    """Who a node is: its instance id, its index in the gang and its private address."""

    instance_id: str
    launch_index: int
    private_ip: str


class NodeHost(Protocol):
    """The cloud as one node sees it (see the module docstring for each guarantee)."""

    def identity(self) -> NodeIdentity: ...

    def read_secret(self, name: str) -> str: ...

    def delete_secret(self, name: str) -> None: ...

    def reclaim_notice(self) -> str | None: ...

    def rebalance_notice(self) -> str | None: ...

    def terminate(self, identity: NodeIdentity) -> None: ...

    def power_off(self, reason: str) -> int: ...

    def error_text(self, exc: BaseException) -> str: ...


def open_host(name: str, **options: Any) -> NodeHost:
    """The node host ``name`` (a key of :data:`HOSTS`, or a ``"module:Class"``), built with ``options``
    (what the node's command line says of its cloud: ``region``, ``endpoint_url``)."""
    target = HOSTS.get(name, name)
    module, _, cls = target.partition(":")
    if not cls:
        raise ValueError(f"node host {name!r}: not one of {sorted(HOSTS)} and not a 'module:Class'")
    return getattr(importlib.import_module(module), cls)(**options)
