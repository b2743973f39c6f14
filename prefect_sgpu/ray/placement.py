"""Where a Ray Train run's workers go: the ``ScalingConfig`` of a job, whether a cluster can hold
it, and asking an autoscaler for it.

Sizing on the driver's side, apart from the compute's run lifecycle
(:mod:`prefect_sgpu.ray.compute`): what a job asks of a cluster changes with Ray's placement
rules and accelerator names, not with how a run is started, watched or released.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect_sgpu.spec import JobSpec, Plan

logger = logging.getLogger("prefect_sgpu.ray.placement")

#: Ray's accelerator_type names for the catalog's GPU types (``accelerator_type:<name>`` resources)
RAY_ACCELERATOR_NAMES = {"A10": ("A10G", "A10"), "A100-80GB": ("A100-80G", "A100"), "L40S": ("L40S", "L40")}


def placement_strategy(nodes: int | None) -> str:
    """One node: STRICT_PACK, several: SPREAD, unset: PACK (Ray's choice of nodes)."""
    if nodes is None:
        return "PACK"
    return "STRICT_PACK" if nodes == 1 else "SPREAD"


def scaling_options(spec: JobSpec, plan: Plan, cluster: dict[str, float] | None,
                    extra: dict[str, float] | None = None) -> dict[str, Any]:
    """``ScalingConfig`` arguments for a job on a cluster with ``cluster`` resources.

    ``cluster=None`` (planning, nothing connected yet) gives the intent: GPU workers
    when the job names a GPU type. With the cluster's resources, GPUs are used only
    when it has some, and the accelerator type is pinned when it advertises it.
    ``extra`` is merged into every worker's resources (``{"CPU": 4}`` for data loading).
    """
    use_gpu = spec.gpu_type is not None and (cluster is None or cluster.get("GPU", 0) > 0)
    options: dict[str, Any] = {
        "num_workers": plan.world_size,
        "use_gpu": use_gpu,
        "resources_per_worker": {**({"GPU": 1} if use_gpu else {"CPU": 1}), **(extra or {})},
        "placement_strategy": placement_strategy(spec.nodes),
    }
    if use_gpu and cluster is not None:
        assert spec.gpu_type is not None
        for name in RAY_ACCELERATOR_NAMES.get(spec.gpu_type, (spec.gpu_type,)):
            if cluster.get(f"accelerator_type:{name}", 0) > 0:
                options["accelerator_type"] = name
                break
    return options


def fits(scaling: dict[str, Any], nodes: list[dict[str, float]]) -> bool:
    """Can nodes with these resources hold every worker's bundle (STRICT_PACK: all on one node)?"""
    bundle = dict(scaling["resources_per_worker"])
    if "accelerator_type" in scaling:
        bundle[f"accelerator_type:{scaling['accelerator_type']}"] = 0.001  # as Ray Train asks for it
    per_node = []
    for resources in nodes:
        counts = [int(resources.get(name, 0.0) // amount) for name, amount in bundle.items() if amount > 0]
        per_node.append(min(counts) if counts else scaling["num_workers"])
    if scaling["placement_strategy"] == "STRICT_PACK":
        return max(per_node, default=0) >= scaling["num_workers"]
    return sum(per_node) >= scaling["num_workers"]


def alive_node_resources() -> list[dict[str, float]]:
    """The resources of every live node of the connected cluster."""
    import ray

    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]


def ask_autoscaler(scaling: dict[str, Any] | None) -> None:
    """Ask an autoscaler for the workers' bundles (None: withdraw); a no-op on fixed clusters."""
    try:
        from ray.autoscaler.sdk import request_resources

        if scaling is None:
            request_resources(bundles=[])
        else:
            request_resources(bundles=[dict(scaling["resources_per_worker"])] * scaling["num_workers"])
    except Exception:  # noqa: BLE001 - a client connection or an old Ray without the call: just wait
        logger.debug("could not ask the Ray autoscaler for resources", exc_info=True)


def ray_train_elastic() -> tuple[str, bool]:
    """The installed Ray's version, and whether its Ray Train has elastic workers: Ray Train v2's
    ``ScalingConfig(num_workers=(min, max))`` (enabled unless ``RAY_TRAIN_V2_ENABLED=0``; Ray docs,
    "Elastic training", and ``ray/train/v2/api/config.py``)."""
    try:
        import ray
        from ray.train import ScalingConfig
    except ImportError:
        return "not installed", False
    return str(getattr(ray, "__version__", "?")), hasattr(ScalingConfig, "elasticity_enabled")


def refuse_elastic(spec: JobSpec) -> None:
    """Refuse ``nodes=(min, max)`` on RayCompute, saying whether the installed Ray could and what to use."""
    if not spec.elastic:
        return
    from prefect_sgpu.errors import SGPUConfigError

    version, elastic = ray_train_elastic()
    per_node = spec.gpus // (spec.max_nodes or 1)
    workers = f"({(spec.min_nodes or 1) * per_node}, {spec.gpus})"
    if elastic:
        why = (f"Ray {version}'s Ray Train has elastic workers (ScalingConfig(num_workers=(min, max))), but "
               "RayCompute does not map nodes=(min, max) onto them: its job is one fixed Ray Train gang whose "
               "every rank's result it collects, and Ray Train's resize restarts the worker group without "
               "the membership round and previous world size prefect_sgpu.runtime reports")
    else:
        why = (f"the installed Ray ({version}) has no elastic Ray Train workers: that needs Ray Train v2's "
               "ScalingConfig(num_workers=(min, max)) (RAY_TRAIN_V2_ENABLED not 0)")
    raise SGPUConfigError(
        "nodes", spec.nodes, "a whole number of nodes on RayCompute: elastic jobs (nodes=(min, max)) run on the "
        "local compute only for now",
        f"{why}. Use nodes=N on RayCompute, nodes=(min, max) on LocalCompute, or Ray Train itself: "
        f"TorchTrainer(..., scaling_config=ScalingConfig(num_workers={workers})) with ray.train's checkpoints")
