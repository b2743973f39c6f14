"""One job from start to finish on the driver: plan, acquire, start, watch, recover, release."""

from typing import Any

#: what ``prefect_sgpu.driver`` held before it was a package, now in :mod:`prefect_sgpu.driver.job`
_JOB_NAMES = ("Job", "JobResult", "RankReport", "Recovery", "Launcher", "TorchrunLauncher", "new_run_id", "rank_start")


def __getattr__(name: str) -> Any:
    if name not in _JOB_NAMES:
        raise AttributeError(f"module 'prefect_sgpu.driver' has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn(f"prefect_sgpu.driver.{name} moved to prefect_sgpu.driver.job", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module("prefect_sgpu.driver.job"), name)
