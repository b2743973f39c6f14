"""Code written for Databricks Runtime ML: pyspark's TorchDistributor API on ``@distributed``."""

from prefect_sgpu.adapters.compat import DeepspeedTorchDistributor, TorchDistributor

__all__ = ["DeepspeedTorchDistributor", "TorchDistributor"]
