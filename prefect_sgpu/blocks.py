"""The blocks users save and load (``from prefect_sgpu.blocks import EC2Compute``)."""

from prefect_sgpu.adapters.blocks import EC2Compute, LocalCompute, RayCompute, SGPUStore

__all__ = ["EC2Compute", "LocalCompute", "RayCompute", "SGPUStore"]
