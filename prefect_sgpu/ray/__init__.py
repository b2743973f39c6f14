"""Ray for prefect-sgpu: a Ray cluster per job (``@ray_launch``) and existing clusters (``RayCompute``).

Importing this package imports neither Ray nor Prefect: the nodes of a ``@ray_launch``
job import its modules, and the names below load on first use.

- ``@ray_launch(gpus=16, gpu_type="A10", remote=True)``: node 0 of the job hosts a Ray
  head, the other nodes join it, and the function runs once as the Ray driver.
- ``RayCompute(address="auto")`` (the block): ``@distributed`` functions and GPU tasks run
  on an existing cluster as Ray Train ``TorchTrainer`` jobs, one worker per rank.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RayCompute", "RayLaunchFunction", "RayLauncher", "ray_launch"]

_LAZY = {
    "RayCompute": "prefect_sgpu.adapters.blocks",
    "RayLaunchFunction": "prefect_sgpu.adapters.ray_launch",
    "RayLauncher": "prefect_sgpu.adapters.ray_launch",
    "ray_launch": "prefect_sgpu.adapters.ray_launch",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prefect_sgpu.ray' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
