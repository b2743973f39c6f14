"""A flow whose GPU task gives no resources: the work pool's job variables decide them."""

from __future__ import annotations

import os

from prefect import flow, get_run_logger
from prefect.cache_policies import NO_CACHE

from prefect_sgpu import GPUTaskRunner, gpu_task


@gpu_task(mlflow=False, return_all=True, cache_policy=NO_CACHE)
def world() -> dict[str, int]:
    return {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"])}


@flow(task_runner=GPUTaskRunner())
def pool_defaults_flow() -> int:
    values = world()
    worlds = sorted({v["world"] for v in values})
    get_run_logger().info("pool-defaults ranks=%d worlds=%s", len(values), worlds)
    return len(values)
