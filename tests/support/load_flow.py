"""The flow of the work-pool load test: one 2-rank GPU task whose values are checked."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.cache_policies import NO_CACHE

from prefect_sgpu import GPUTaskRunner, gpu_task


@gpu_task(gpus=2, mlflow=False, return_all=True, cache_policy=NO_CACHE)
def ranks(job: int, tag: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from prefect_sgpu import runtime

    runtime.init_process_group()
    value = torch.tensor([100.0 * job + runtime.rank()])
    dist.all_reduce(value)
    return {"tag": tag, "job": job, "rank": runtime.rank(), "world": dist.get_world_size(),
            "sum": int(value.item())}


@flow(task_runner=GPUTaskRunner())
def load_flow(job: int, tag: str) -> int:
    values = ranks(job, tag)
    wrong = [v for v in values if (v["tag"], v["job"], v["world"], v["sum"]) != (tag, job, 2, 200 * job + 1)]
    if [v["rank"] for v in values] != [0, 1] or wrong:
        raise ValueError(f"job {job}: wrong rank values {values}")
    get_run_logger().info("load-check %d ok", job)
    return job
