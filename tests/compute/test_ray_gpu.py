"""RayCompute on a cluster that advertises GPUs: workers are placed on GPU bundles of the right type.

The two nodes declare one logical GPU each and an ``accelerator_type:A10G`` resource,
as Ray does on g5 instances. There is no CUDA here, so the process group is pinned
to gloo with ``backend="gloo"``; scheduling, GPU assignment and the accelerator pin
are Ray's own.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from support.ray_cluster import job_leftovers, ray_cluster
from prefect_sgpu import SGPUConfigError, distributed, runtime
from prefect_sgpu.ray.compute import RayTrainCompute
from prefect_sgpu.ray import RayCompute

# the module's GPU-resource cluster is started once: its tests share one xdist worker (docs/testing.md)
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("ray-gpu-cluster")]


@pytest.fixture(scope="module")
def gpu_compute() -> Iterator[RayCompute]:
    import ray

    if ray.is_initialized():  # a process joins one cluster: leave the session's CPU cluster first
        ray.shutdown()
    with ray_cluster(cpus_per_node=1, gpus_per_node=1, resources='{"accelerator_type:A10G": 1}') as address:
        compute = RayCompute(address=address, backend="gloo")
        yield compute
        compute.close()


def _where_am_i() -> dict:
    import os

    import ray
    import torch.distributed as dist

    return {"rank": runtime.rank(), "node": runtime.node_rank(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "backend": dist.get_backend(),
            "sgpu_device": os.environ["SGPU_DEVICE"]}


def _gpus_free_again(total: float, timeout: float = 60.0) -> bool:
    """Ray removes a finished run's placement group asynchronously (seconds on a loaded machine)."""
    import time

    import ray

    deadline = time.monotonic() + timeout
    while ray.available_resources().get("GPU", 0.0) != total:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def test_gpu_type_places_one_worker_per_gpu(gpu_compute: RayCompute) -> None:
    result = distributed(gpus=2, gpu_type="A10", compute=gpu_compute, mlflow=False)(_where_am_i).run()
    assert [v["rank"] for v in result.values] == [0, 1]
    assert sorted(v["node"] for v in result.values) == [0, 1], "SPREAD/PACK over the two one-GPU nodes"
    for v in result.values:
        assert len(v["gpu_ids"]) == 1 and v["visible"] == v["gpu_ids"][0], "Ray assigned this worker one GPU"
        assert v["backend"] == "gloo" and v["sgpu_device"] == "cuda"
    assert job_leftovers(result.run_id) == []
    assert _gpus_free_again(2.0), "both GPUs are free again"


def test_without_gpu_type_the_workers_take_cpus(gpu_compute: RayCompute) -> None:
    result = distributed(gpus=2, compute=gpu_compute, mlflow=False)(_where_am_i).run()
    assert all(v["gpu_ids"] == [] and v["sgpu_device"] == "cpu" for v in result.values)


def test_a_second_cluster_in_the_same_process_is_refused(gpu_compute: RayCompute) -> None:
    gpu_compute.get_compute().connect()  # this process joins the GPU cluster, whichever test ran before
    other = RayCompute(address="127.0.0.99:6379")
    with pytest.raises(SGPUConfigError) as info:
        distributed(gpus=1, compute=other, mlflow=False)(_where_am_i).run()
    assert info.value.field == "address" and "connected to" in str(info.value)


def test_backend_is_checked() -> None:
    with pytest.raises(SGPUConfigError) as info:
        RayTrainCompute(address="auto", backend="mpi")
    assert info.value.field == "backend" and "nccl" in str(info.value)
