"""The accelerator catalog: which GPU types exist, which EC2 instances carry them.

It is the single place that knows how many GPUs a node of each type has, so that
``gpus=16, gpu_type="H100"`` can be turned into ``2 x p5.48xlarge`` before anything
is provisioned, and so that cost estimates use one price table.
Prices are approximate on-demand list prices (USD per hour) of one region,
:data:`PRICE_REGION`; the catalog has none for other regions. ``prefect-sgpu gpus``
prints the whole catalog (:func:`describe`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from prefect_sgpu.errors import SGPUConfigError

#: the region whose on-demand prices ``InstanceType.price_per_hour`` holds
PRICE_REGION = "us-east-1"


@dataclass(frozen=True)
class InstanceType:
    name: str
    gpus: int
    vcpus: int
    memory_gib: int
    gpu_memory_gib: int
    price_per_hour: float
    efa_interfaces: int = 0

    def price_in(self, region: str) -> float | None:
        """USD per hour in ``region``; None where the catalog has no price for it."""
        return self.price_per_hour if region == PRICE_REGION else None


@dataclass(frozen=True)
class Accelerator:
    name: str
    instance_types: tuple[InstanceType, ...]
    aliases: tuple[str, ...] = ()

    @property
    def gpus_per_node_options(self) -> tuple[int, ...]:
        return tuple(sorted({it.gpus for it in self.instance_types}))

    def instance_for(self, gpus_per_node: int) -> InstanceType:
        for it in self.instance_types:
            if it.gpus == gpus_per_node:
                return it
        raise KeyError(gpus_per_node)


_G5 = (
    InstanceType("g5.xlarge", 1, 4, 16, 24, 1.006),
    InstanceType("g5.12xlarge", 4, 48, 192, 96, 5.672),
    InstanceType("g5.48xlarge", 8, 192, 768, 192, 16.288, efa_interfaces=1),
)
_G6 = (
    InstanceType("g6.xlarge", 1, 4, 16, 24, 0.805),
    InstanceType("g6.12xlarge", 4, 48, 192, 96, 4.602),
    InstanceType("g6.48xlarge", 8, 192, 768, 192, 13.350, efa_interfaces=1),
)
_G6E = (
    InstanceType("g6e.xlarge", 1, 4, 32, 48, 1.861),
    InstanceType("g6e.12xlarge", 4, 48, 384, 192, 10.493),
    InstanceType("g6e.48xlarge", 8, 192, 1536, 384, 30.131, efa_interfaces=4),
)

CATALOG: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("A10", _G5, aliases=("A10G",)),
        Accelerator("L4", _G6),
        Accelerator("L40S", _G6E),
        Accelerator("A100", (InstanceType("p4d.24xlarge", 8, 96, 1152, 320, 21.958, 4),)),
        Accelerator(
            "A100-80GB", (InstanceType("p4de.24xlarge", 8, 96, 1152, 640, 27.447, 4),)
        ),
        Accelerator("H100", (InstanceType("p5.48xlarge", 8, 192, 2048, 640, 55.040, 32),)),
        Accelerator(
            "H200",
            (InstanceType("p5en.48xlarge", 8, 192, 2048, 1128, 63.296, 16),),
            aliases=("H200-P5E",),
        ),
    )
}

_ALIASES = {alias.upper(): a.name for a in CATALOG.values() for alias in (a.name, *a.aliases)}


def known_gpu_types() -> list[str]:
    return sorted(CATALOG)


def lookup(gpu_type: str) -> Accelerator:
    """Return the accelerator for a name or alias (case-insensitive)."""
    name = _ALIASES.get(gpu_type.strip().upper())
    if name is None:
        raise SGPUConfigError(
            "gpu_type", gpu_type, "one of " + ", ".join(known_gpu_types()) + " (or alias A10G)"
        )
    return CATALOG[name]


def instance_type_by_name(name: str) -> InstanceType | None:
    for acc in CATALOG.values():
        for it in acc.instance_types:
            if it.name == name:
                return it
    return None


def plan_nodes(gpu_type: str, gpus: int, nodes: int | None) -> tuple[int, InstanceType]:
    """Split ``gpus`` of ``gpu_type`` into whole nodes of one instance type.

    Without ``nodes``, the fewest nodes win (the largest instance whose GPU count
    divides ``gpus``): 16 x H100 -> 2 x p5.48xlarge, 2 x A10 -> 2 x g5.xlarge.
    """
    acc = lookup(gpu_type)
    options = acc.gpus_per_node_options
    if nodes is not None:
        if gpus % nodes or (gpus // nodes) not in options:
            raise SGPUConfigError(
                "gpus",
                gpus,
                f"with nodes={nodes} and gpu_type={acc.name}, gpus must be nodes x one of "
                f"{list(options)} GPUs per node (the {acc.name} instance sizes)",
            )
        gpn = gpus // nodes
        return nodes, acc.instance_for(gpn)
    for gpn in sorted(options, reverse=True):
        if gpus % gpn == 0:
            return gpus // gpn, acc.instance_for(gpn)
    smallest = min(options)
    raise SGPUConfigError(
        "gpus",
        gpus,
        f"{acc.name} nodes have {list(options)} GPUs; gpus must be a multiple of {smallest} "
        f"(e.g. {smallest}, {2 * smallest}, {4 * smallest})",
    )


def describe(region: str = PRICE_REGION) -> dict[str, Any]:
    """The catalog as plain data: every GPU type, its instance types and their prices in ``region``
    (``usd_per_hour`` None where the catalog has no price there)."""
    gpu_types = []
    for acc in CATALOG.values():
        instances = []
        for it in acc.instance_types:
            row = asdict(it)
            del row["price_per_hour"]
            price = it.price_in(region)
            row["usd_per_hour"] = price
            row["usd_per_gpu_hour"] = None if price is None else round(price / it.gpus, 3)
            instances.append(row)
        gpu_types.append({"name": acc.name, "aliases": list(acc.aliases),
                          "gpus_per_node": list(acc.gpus_per_node_options), "instance_types": instances})
    return {"region": region, "priced_regions": [PRICE_REGION], "gpu_types": gpu_types}
