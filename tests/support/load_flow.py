"""The flow of the work-pool load test: one 2-rank GPU task whose values are checked."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.cache_policies import NO_CACHE

from prefect_sgpu import GPUTaskRunner, gpu_task
from support import load


@gpu_task(gpus=2, mlflow=False, return_all=True, cache_policy=NO_CACHE)
def ranks(job: int, tag: str) -> dict[str, Any]:
    return load.rank_work(job, tag)


@flow(task_runner=GPUTaskRunner())
def load_flow(job: int, tag: str) -> int:
    wrong = load.check(ranks(job, tag), job, tag)
    if wrong:
        raise ValueError("; ".join(wrong))
    get_run_logger().info("load-check %d ok", job)
    return job
