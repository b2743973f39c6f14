"""RayCompute with a warm worker group: jobs after the first pay only for their function."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Iterator

import pytest

from prefect_sgpu import distributed, runtime
from prefect_sgpu.ray.compute import RayTrainCompute
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.ray.warm_group import RAY_POOL
from support.conformance_ray import SETTLE_S, ray_leftovers

pytestmark = pytest.mark.e2e


@pytest.fixture
def compute(ray_address: str) -> Iterator[RayTrainCompute]:
    compute = RayTrainCompute(address=ray_address, keep_warm=120)
    yield compute
    RAY_POOL.close(owner=id(compute))


class Diverged(Exception):
    pass


def _probe(tag: str) -> dict[str, Any]:
    preloaded = "torch" in sys.modules
    import torch
    import torch.distributed as dist

    initialised = dist.is_initialized()
    os.environ.setdefault("SGPU_LEFT_BEHIND", tag)
    t = torch.tensor([float(runtime.rank())])
    dist.all_reduce(t)
    print(f"rank {runtime.rank()} of {runtime.world_size()} reporting")
    return {"rank": runtime.rank(), "sum": t.item(), "pid": os.getpid(), "preloaded": preloaded,
            "initialised": initialised, "left": os.environ["SGPU_LEFT_BEHIND"]}


def _fails_on_rank_1() -> int:
    if runtime.rank() == 1:
        raise Diverged("rank 1 diverged")
    time.sleep(0.5)
    return runtime.rank()


def _settled(run_id: str) -> list[str]:
    deadline = time.monotonic() + SETTLE_S
    while (left := ray_leftovers(run_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_warm_group_serves_consecutive_jobs_with_fresh_rank_processes(compute: RayTrainCompute,
                                                                      capfd: pytest.CaptureFixture[str]) -> None:
    fn = distributed(gpus=2, mlflow=False, compute=compute)(_probe)
    first = fn.job("first")
    assert "warm worker group" in first.dry_run()["trainer"]
    one = first.run()
    (group,) = [g for g in RAY_POOL.idle() if g.owner == id(compute)]
    two = fn.job("second").run()
    assert [g for g in RAY_POOL.idle() if g.owner == id(compute)] == [group] and group.jobs == 2
    for result in (one, two):
        assert [v["rank"] for v in result.values] == [0, 1]
        assert [v["sum"] for v in result.values] == [1.0, 1.0]
        assert all(v["preloaded"] and v["initialised"] for v in result.values), "torch imported, group set up"
    assert [v["left"] for v in two.values] == ["second", "second"], "no environment of the job before"
    assert {v["pid"] for v in one.values}.isdisjoint(v["pid"] for v in two.values)
    shown = capfd.readouterr().out
    assert shown.count("rank 1 of 2 reporting") == 2, "each job's rank output reached the driver"

    with pytest.raises(Diverged, match="rank 1 diverged") as info:
        distributed(gpus=2, mlflow=False, compute=compute)(_fails_on_rank_1).distributed()
    assert info.value.sgpu_failure.rank == 1  # type: ignore[attr-defined]
    assert distributed(gpus=2, mlflow=False, compute=compute)(_probe).distributed("third")[0]["sum"] == 1.0
    assert group.jobs == 4

    compute.close()  # the flow's end: the group goes, and with it its placement group and CPUs
    assert not [g for g in RAY_POOL.idle() if g.owner == id(compute)]
    assert _settled(two.run_id) == []


def test_a_silent_rank_on_a_warm_group_ends_the_job_as_hung_and_the_group_serves_the_next(
        compute: RayTrainCompute) -> None:
    from support.rank_functions import progress_on_rank_0_silence_on_rank_1

    from prefect_sgpu.errors import JobHung

    fn = distributed(gpus=2, mlflow=False, compute=compute, hang_timeout=4, timeout=600)
    job = fn(progress_on_rank_0_silence_on_rank_1).job(12.0)
    with pytest.raises(JobHung) as info:
        job.run()
    assert set(info.value.ranks) == {1}, "rank 0 reported progress all along"
    (group,) = [g for g in RAY_POOL.idle() if g.owner == id(compute)]
    assert fn(_probe).distributed("after")[1]["sum"] == 1.0
    assert [g for g in RAY_POOL.idle() if g.owner == id(compute)] == [group] and group.jobs == 2
    compute.close()
    assert _settled(job.run_id) == []


def test_keep_warm_is_checked() -> None:
    with pytest.raises(SGPUConfigError, match="keep_warm"):
        RayTrainCompute(address="auto", keep_warm=-5)
