"""prefect-sgpu: multi-node GPU jobs for Prefect, on your own cloud or laptop.

Importing the package does not import torch, ray or mlflow: they load when a job
needs them.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect_sgpu import runtime
from prefect_sgpu.errors import (
    EnvironmentMismatch,
    JobCancelled,
    LaunchTimeout,
    PayloadError,
    PayloadImportError,
    ProvisioningError,
    RankFailedError,
    ResultRefused,
    SGPUConfigError,
    SGPUError,
)

__all__ = [
    "__version__",
    "DistributedFunction",
    "EnvironmentMismatch",
    "JobCancelled",
    "LaunchTimeout",
    "PayloadError",
    "PayloadImportError",
    "ProvisioningError",
    "RankFailedError",
    "ResultRefused",
    "SGPUConfigError",
    "SGPUError",
    "distributed",
    "run_script",
    "runtime",
    "GPUTaskRunner",
    "gpu_task",
    "LocalCompute",
    "EC2Compute",
    "RayCompute",
    "SGPUStore",
    "ray_launch",
    "release_warm",
]

_LAZY = {
    # the decorator loads the job spec and the driver: not for node agents and ranks, which
    # import this package for its small modules (the job folder, the runtime, the payload)
    "DistributedFunction": "prefect_sgpu.adapters.decorator",
    "distributed": "prefect_sgpu.adapters.decorator",
    "run_script": "prefect_sgpu.adapters.decorator",
    "GPUTaskRunner": "prefect_sgpu.adapters.task_runner",
    "gpu_task": "prefect_sgpu.adapters.task_runner",
    "GPUTask": "prefect_sgpu.adapters.task_runner",
    "LocalCompute": "prefect_sgpu.adapters.blocks",
    "EC2Compute": "prefect_sgpu.adapters.blocks",
    "RayCompute": "prefect_sgpu.adapters.blocks",
    "SGPUStore": "prefect_sgpu.adapters.blocks",
    "SGPUWorker": "prefect_sgpu.adapters.worker",
    "ray_launch": "prefect_sgpu.ray",
    "release_warm": "prefect_sgpu.compute.warm_pool",
}


def _register_blocks() -> None:
    """Expose the block classes on the package, so ``prefect block register -m prefect_sgpu``
    (and Prefect's collection loader, through the entry point) finds them."""
    from prefect_sgpu import blocks

    for name in ("LocalCompute", "EC2Compute", "RayCompute", "SGPUStore"):
        globals()[name] = getattr(blocks, name)
    from prefect_sgpu.adapters.worker import SGPUWorker  # the "sgpu" work pool type

    globals()["SGPUWorker"] = SGPUWorker


def _version() -> str:
    """The installed distribution's version: pyproject.toml is its one source. A checkout on
    ``sys.path`` without an install has no metadata and says so."""
    from prefect_sgpu.protocol.versions import distribution_version

    return distribution_version("prefect-sgpu") or "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":  # read on first use: ranks import this package and never ask
        return _version()
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prefect_sgpu' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


#: modules that moved into the packages that group them: their old names still import (the same
#: module object), with a DeprecationWarning naming the new place
MOVED = {
    "environment_files": "environment.files",
    "environment_index": "environment.index",
    "environment_ship": "environment.ship",
    "store_s3": "store.s3",
    "checkpoint_manifest": "checkpoints.manifest",
    "jobfolder": "protocol.jobfolder",
    "payload": "protocol.payload",
    "versions": "protocol.versions",
    "heartbeat": "driver.heartbeat",
    "interrupts": "driver.interrupts",
    "logs": "observe.logs",
    "live": "observe.live",
    "progress_watch": "observe.progress_watch",
    "stragglers": "observe.stragglers",
    "tracking": "observe.tracking",
    "mlflow_relay": "observe.mlflow_relay",
    "gang_check": "observe.gang_check",
}


class _MovedModules:
    """Imports ``prefect_sgpu.<old>`` as the module it moved to (a finder and loader on ``sys.meta_path``)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not fullname.startswith("prefect_sgpu.") or fullname[len("prefect_sgpu."):] not in MOVED:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        import importlib
        import warnings

        new = "prefect_sgpu." + MOVED[spec.name[len("prefect_sgpu."):]]
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: Any) -> None:
        """The module it moved to is already executed."""


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())

# Prefect loading its collections (entry point), a CLI or a flow: expose the blocks now.
# Ranks import only the payload code and never pay for importing Prefect.
if "prefect" in sys.modules:
    _register_blocks()
