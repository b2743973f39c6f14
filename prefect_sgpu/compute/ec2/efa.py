"""How each EFA instance family is wired: its EFA interfaces, RDMA, and the bus bandwidth it must reach.

One row per family, from AWS's pages "Maximize network bandwidth on Amazon EC2 instances with multiple
network cards" (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html, with its
section "EFA configuration for P5 and P5e instances") and "Elastic Fabric Adapter: supported instance
types" (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa.html#efa-instance-types):

- the primary interface (network card 0, device index 0) may never be ``efa-only``: it is ``efa``
  (EFA with ENA), which carries the instance's IP address and an EFA device at once;
- on families that support ``efa-only`` interfaces (p5, p5e, p5en, trn2), each further network card
  gets one ``efa-only`` interface at device index 0: EFA devices for NCCL's traffic, no IP address
  (none to spend from the subnet, no second route); the other families (p4d, p4de, trn1, g5, g6,
  g6e) get an ``efa`` interface at device index 1 on each further card, as the launch always sent;
- RDMA (``FI_EFA_USE_DEVICE_RDMA``) is on the page's list for p4d/p4de, p5/p5e/p5en and trn1/trn2,
  not for g5, g6 or g6e.

``min_bus_gbps`` is the all-reduce bus bandwidth (GB/s, as nccl-tests computes it) under which the gang
check refuses a two-node job (:mod:`prefect_sgpu.observe.nccl_transport`). The calibration rule: about
half of what published nccl-tests runs reach between two nodes of the family over all its EFA cards
(p4d ~76 GB/s, p5 ~435 GB/s: the check's single 256 MiB all-reduce, with a cold communicator and
fewer channels, reaches less), and at least five times what the same all-reduce reaches over TCP
sockets (~8 GB/s on p4d), so that NCCL's fallback to sockets can never pass. Families without a
published two-node figure have no floor (``None``): their transport is still checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect_sgpu import catalog
from prefect_sgpu.observe.nccl_transport import EFA_ENV, EFA_RDMA_ENV, FLOOR_ENV, INSTANCE_TYPE_ENV


@dataclass(frozen=True)
class EFALayout:
    family: str
    #: EFA interfaces (one per network card) the launch asks for
    cards: int
    #: the type of the interfaces on network cards 1..: ``efa-only`` where the family supports it
    secondary: str
    rdma: bool
    min_bus_gbps: float | None = None


LAYOUTS: dict[str, EFALayout] = {
    layout.family: layout for layout in (
        EFALayout("p4d", 4, "efa", rdma=True, min_bus_gbps=40.0),
        EFALayout("p4de", 4, "efa", rdma=True, min_bus_gbps=40.0),
        EFALayout("p5", 32, "efa-only", rdma=True, min_bus_gbps=150.0),
        EFALayout("p5e", 32, "efa-only", rdma=True, min_bus_gbps=150.0),
        EFALayout("p5en", 16, "efa-only", rdma=True, min_bus_gbps=150.0),
        EFALayout("trn1", 8, "efa", rdma=True),
        EFALayout("trn2", 16, "efa-only", rdma=True),
        EFALayout("g5", 1, "efa", rdma=False),
        EFALayout("g6", 1, "efa", rdma=False),
        EFALayout("g6e", 4, "efa", rdma=False),
    )
}


def layout_for(instance_type: str) -> EFALayout | None:
    """The family's layout, with the catalog's count of EFA cards for this size; None without EFA
    (a size the catalog gives no EFA, or a family not in the table)."""
    family = instance_type.partition(".")[0]
    layout = LAYOUTS.get(family)
    known = catalog.instance_type_by_name(instance_type)
    if layout is None or known is None or not known.efa_interfaces:
        return None
    if known.efa_interfaces != layout.cards:
        return EFALayout(layout.family, known.efa_interfaces, layout.secondary, layout.rdma, layout.min_bus_gbps)
    return layout


def network_interfaces(instance_type: str, subnet_id: str | None, groups: list[str]) -> list[dict[str, Any]]:
    """The ``NetworkInterfaces`` of a ``run_instances`` for an EFA type (empty without EFA): card 0's
    ``efa`` interface at device index 0, then one interface per further network card."""
    layout = layout_for(instance_type)
    if layout is None:
        return []
    where = {"SubnetId": subnet_id} if subnet_id else {}
    interfaces = [{"DeviceIndex": 0, "NetworkCardIndex": 0, **where, "Groups": list(groups),
                   "InterfaceType": "efa", "DeleteOnTermination": True}]
    for card in range(1, layout.cards):
        interfaces.append({"DeviceIndex": 0 if layout.secondary == "efa-only" else 1, "NetworkCardIndex": card,
                           **where, "Groups": list(groups), "InterfaceType": layout.secondary,
                           "DeleteOnTermination": True})
    return interfaces


def rank_hints(instance_type: str) -> dict[str, str]:
    """What every rank of a job on ``instance_type`` learns about its network (nothing without EFA): read by
    :mod:`prefect_sgpu.launch.nccl_env` (NCCL's environment) and the gang check (the transport and floor)."""
    layout = layout_for(instance_type)
    if layout is None:
        return {}
    hints = {EFA_ENV: "1", EFA_RDMA_ENV: "1" if layout.rdma else "0", INSTANCE_TYPE_ENV: instance_type}
    if layout.min_bus_gbps is not None:
        hints[FLOOR_ENV] = f"{layout.min_bus_gbps:g}"
    return hints
