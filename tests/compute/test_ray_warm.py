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


def _writes_a_marker(path: str) -> int:
    with open(path, "a") as fh:
        fh.write(f"rank {runtime.rank()}\n")
    return runtime.rank()


def test_ranks_that_cannot_form_the_process_group_are_started_again_then_the_job_fails_with_why(
        compute: RayTrainCompute, tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    from prefect_sgpu.errors import RankFailedError
    from prefect_sgpu.protocol.jobfolder import log_key
    from prefect_sgpu.ray.warm_group import SETUP_ATTEMPTS

    marker = tmp_path / "ran"
    # gloo cannot build its device on an interface that does not exist: every attempt fails in setup
    broken = distributed(gpus=2, mlflow=False, compute=compute, timeout=600,
                         env={"GLOO_SOCKET_IFNAME": "sgpu-no-such-if"})(_writes_a_marker)
    job = broken.job(str(marker))
    with caplog.at_level("WARNING", logger="prefect_sgpu.ray.compute"), pytest.raises(RankFailedError) as info:
        job.run()
    assert "could not join the job's process group" in str(info.value)
    assert not marker.exists(), "no rank ran the function"
    attempts = [r.getMessage() for r in caplog.records if "starting its ranks again" in r.getMessage()]
    assert [a.split("(attempt ")[1] for a in attempts] == [f"{n} of {SETUP_ATTEMPTS})" for n in
                                                          range(2, SETUP_ATTEMPTS + 1)]
    logs = "".join((job.folder.store.get(job.run_id, log_key(r)) or b"").decode() for r in (0, 1))
    assert logs.count("sgpu-no-such-if") >= SETUP_ATTEMPTS, "each attempt's reason is in the rank logs"
    (group,) = [g for g in RAY_POOL.idle() if g.owner == id(compute)]
    good = distributed(gpus=2, mlflow=False, compute=compute)(_writes_a_marker)
    assert good.distributed(str(marker)) == [0, 1], "the group serves the next job"
    assert [g for g in RAY_POOL.idle() if g.owner == id(compute)] == [group]
    compute.close()
    assert _settled(job.run_id) == []
