"""Code written for Databricks Runtime ML: pyspark's TorchDistributor API on ``@distributed``."""

from prefect_sgpu.adapters.compat import (
    DEEPSPEED_CONFIG_ENV,
    DeepspeedTorchDistributor,
    TorchDistributor,
    deepspeed_config,
)

__all__ = ["DEEPSPEED_CONFIG_ENV", "DeepspeedTorchDistributor", "TorchDistributor", "deepspeed_config"]
