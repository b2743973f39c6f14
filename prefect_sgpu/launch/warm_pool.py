"""Deprecated location of the warm pool: it is driver-side code and lives in
:mod:`prefect_sgpu.compute.warm_pool` (the pool) and :mod:`prefect_sgpu.procs.warm_channel`
(the channel to one warm node). Names read from here still work, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_MOVED = {
    **dict.fromkeys(("Pooled", "WarmSet", "WarmPool", "POOL", "start_set", "release_warm", "check_keep_warm"),
                    "prefect_sgpu.compute.warm_pool"),
    **dict.fromkeys(("AGENT_MODULE", "WarmNodeProcess", "warm_node_argv"), "prefect_sgpu.procs.warm_channel"),
}


def __getattr__(name: str) -> Any:
    where = _MOVED.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"prefect_sgpu.launch.warm_pool.{name} moved to {where}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(where), name)
