"""RayCompute: ``@distributed`` functions and GPU tasks as Ray Train jobs on an existing cluster.

The cluster (a head and a worker started with ``ray start``, one CPU each) is the
session's ``ray_address`` from ``tests/compute/conftest.py``, shared with the
conformance suite because a process joins one Ray cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from support.ray_cluster import job_leftovers
from prefect_sgpu import RankFailedError, distributed, runtime
from prefect_sgpu.compute.base import Released
from prefect_sgpu.ray.compute import RayAllocation, RayRequest, RayTrainCompute
from prefect_sgpu.ray.placement import fits, scaling_options
from prefect_sgpu.ray import RayCompute
from prefect_sgpu.spec import JobSpec
from support.threads import run_in_thread

pytestmark = pytest.mark.e2e


class GradientExploded(Exception):
    """Defined in the caller's module, raised inside a Ray Train worker."""


@pytest.fixture(scope="module")
def compute(ray_address: str) -> Iterator[RayCompute]:
    compute = RayCompute(address=ray_address)
    yield compute
    compute.close()


def cluster_idle(timeout: float = 60.0) -> bool:
    """Every CPU of the cluster is free again: the job's Ray Train workers are gone."""
    import time

    import ray

    assert ray.is_initialized(), "connected by RayCompute (never a new local instance)"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0.0) == ray.cluster_resources().get("CPU", -1.0):
            return True
        time.sleep(0.5)
    return False


def _all_reduce(tag: str) -> dict:
    import torch
    import torch.distributed as dist

    backend = runtime.init_process_group()  # Ray Train already did: the same call works under both
    t = torch.tensor([float(runtime.rank())])
    dist.all_reduce(t)
    print(f"{tag}: rank {runtime.rank()} of {runtime.world_size()} sum={t.item():g}")
    return {"rank": runtime.rank(), "world": runtime.world_size(), "local_rank": runtime.local_rank(),
            "node": runtime.node_rank(), "sum": t.item(), "backend": backend, "device": str(runtime.device())}


def test_two_workers_return_values_in_rank_order_with_tagged_logs(
        compute: RayCompute, capfd: pytest.CaptureFixture[str]) -> None:
    result = distributed(gpus=2, compute=compute)(_all_reduce).run("ray")
    assert [v["rank"] for v in result.values] == [0, 1]
    assert all(v["world"] == 2 and v["sum"] == 1.0 and v["backend"] == "gloo" for v in result.values)
    assert all(v["device"] == "cpu" and v["local_rank"] == 0 for v in result.values)
    assert sorted(v["node"] for v in result.values) == [0, 1], "one worker per node of the cluster"
    assert [r.rank for r in result.ranks] == [0, 1]
    out = capfd.readouterr().out
    assert "ray: rank 0 of 2 sum=1" in out and "ray: rank 1 of 2 sum=1" in out
    for v in result.values:  # tagged with the node Ray placed the worker on, from the job folder's rank logs
        assert f"[rank {v['rank']} node {v['node']}] ray: rank {v['rank']} of 2 sum=1" in out
    assert "rank 1 of 2" in (Path(result.logs_uri) / "rank-00001.log").read_text()

    from mlflow.tracking import MlflowClient

    run = MlflowClient(result.mlflow_tracking_uri).get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert job_leftovers(result.run_id) == []
    assert cluster_idle()


def test_failing_rank_is_reraised_and_the_run_ends_failed(compute: RayCompute) -> None:
    @distributed(gpus=2, compute=compute)
    def explode() -> int:
        import time

        if runtime.rank() == 1:
            raise GradientExploded("grad norm inf at step 3")
        time.sleep(120)  # stopped with the run, long before this ends
        return runtime.rank()

    job = explode.job()
    with pytest.raises(GradientExploded, match="grad norm inf at step 3") as info:
        job.run()
    failure = info.value.sgpu_failure
    assert failure.rank == 1 and failure.exit_code == 1
    assert 'raise GradientExploded("grad norm inf at step 3")' in failure.remote_traceback
    assert any("rank 1" in note for note in info.value.__notes__)
    assert job.tracked is not None and job.tracked.status == "FAILED"
    assert job_leftovers(job.run_id) == []
    assert cluster_idle(), "the sleeping rank was stopped with the run"


def test_cancel_stops_the_ray_train_run(compute: RayCompute) -> None:
    import threading
    import time

    from prefect_sgpu.errors import JobCancelled
    from prefect_sgpu.observe.logs import RankLogSink

    class Lines(RankLogSink):
        def __init__(self) -> None:
            super().__init__("train_forever", echo=False)
            self.seen: list[str] = []

        def line(self, rank: int, node: int, text: str) -> None:
            self.seen.append(f"[rank {rank}] {text}")

    @distributed(gpus=2, compute=compute)
    def train_forever() -> None:
        import time

        print("training", flush=True)
        time.sleep(600)

    cancel, sink = threading.Event(), Lines()
    job = train_forever.job(cancel_event=cancel, sink=sink)
    runner, outcome = run_in_thread(job)
    try:
        deadline = time.monotonic() + 300
        while not {"[rank 0] training", "[rank 1] training"} <= set(sink.seen):
            assert time.monotonic() < deadline and runner.is_alive(), "the workers never started"
            time.sleep(0.2)
    finally:
        cancel.set()
        runner.join(timeout=120)
    assert outcome and isinstance(outcome[0], JobCancelled)
    assert job.tracked is not None and job.tracked.status == "KILLED"
    assert cluster_idle(), "both workers and the run's placement group were released"


def test_release_removes_the_placement_group_the_run_s_ranks_ran_in(compute: RayCompute, tmp_path: Path) -> None:
    """Ray Train removes its group asynchronously, after its controller ends (minutes when a worker
    died): the group the ranks reported is removed by release, so it is gone when the call returns."""
    import threading
    import time

    import ray

    from prefect_sgpu.errors import JobCancelled

    @distributed(gpus=2, compute=compute, mlflow=False)
    def sleeps(folder: str) -> None:
        import time

        import ray

        group = ray.get_runtime_context().get_placement_group_id()
        Path(folder, f"rank-{runtime.rank()}").write_text(group or "none")
        time.sleep(600)

    job = sleeps.job(str(tmp_path), cancel_event=threading.Event())
    runner, outcome = run_in_thread(job)
    deadline = time.monotonic() + 300
    while len(list(tmp_path.glob("rank-*"))) < 2:
        assert time.monotonic() < deadline and runner.is_alive(), "the workers never started"
        time.sleep(0.2)
    groups = {p.read_text() for p in tmp_path.glob("rank-*")}
    assert len(groups) == 1 and "none" not in groups, groups
    job.cancel_event.set()
    runner.join(timeout=120)
    assert outcome and isinstance(outcome[0], JobCancelled)
    table = ray.util.placement_group_table()
    assert table[groups.pop()]["state"] == "REMOVED"
    assert cluster_idle()


def test_a_rank_that_dies_without_an_exception_becomes_rank_failed_error(compute: RayCompute) -> None:
    @distributed(gpus=1, compute=compute, mlflow=False)
    def vanish() -> None:
        import os

        os._exit(3)  # no envelope: the Ray worker process is gone

    with pytest.raises(RankFailedError):
        vanish.distributed()
    # a dead worker is the slowest case for Ray Train to release (the next test needs both CPUs);
    # on a loaded 2-core machine it has taken over a minute
    assert cluster_idle(timeout=240), "the dead worker's CPU and the run's placement group were released"


def test_a_silent_rank_ends_the_run_as_hung_within_its_hang_timeout(compute: RayCompute) -> None:
    """The driver's watchdog ends a Ray Train run whose rank neither prints nor reports progress
    for ``hang_timeout``; a rank that reports progress without printing is not silent."""
    from support.rank_functions import progress_on_rank_0_silence_on_rank_1

    from prefect_sgpu.errors import JobHung

    job = distributed(gpus=2, compute=compute, mlflow=False, hang_timeout=4,
                      timeout=600)(progress_on_rank_0_silence_on_rank_1).job(12.0)
    with pytest.raises(JobHung) as info:
        job.run()
    assert set(info.value.ranks) == {1}, "rank 0 reported progress all along"
    assert "rank(s) 1 made no progress for 4s" in str(info.value)
    assert job_leftovers(job.run_id) == []
    assert cluster_idle(), "the run's workers and placement group were released"


def test_gpu_task_runs_as_a_ray_train_job(compute: RayCompute, prefect_server: None) -> None:
    from prefect import flow

    from prefect_sgpu import GPUTaskRunner, gpu_task

    @gpu_task(gpus=2, strategy="ddp", return_all=True)
    def ranks() -> tuple[int, int, str]:
        import os

        return runtime.rank(), runtime.world_size(), os.environ["SGPU_STRATEGY"]

    @flow(task_runner=GPUTaskRunner(compute=compute))
    def on_ray() -> list:
        return ranks()

    assert on_ray() == [(0, 2, "ddp"), (1, 2, "ddp")]


def _scaling(spec: JobSpec, cluster: dict[str, float] | None) -> dict:
    compute = RayTrainCompute("ray://head:10001")
    return scaling_options(spec, compute.plan(spec, "r").plan, cluster)


def test_scaling_config_follows_the_resources() -> None:
    cpu_cluster = {"CPU": 8.0}
    gpu_cluster = {"CPU": 96.0, "GPU": 8.0, "accelerator_type:A10G": 1.0}

    spec = JobSpec(gpus=4, gpu_type="A10", nodes=2)
    assert _scaling(spec, gpu_cluster) == {"num_workers": 4, "use_gpu": True, "resources_per_worker": {"GPU": 1},
                                           "placement_strategy": "SPREAD", "accelerator_type": "A10G"}
    opts = _scaling(spec, cpu_cluster)
    assert opts["use_gpu"] is False and opts["resources_per_worker"] == {"CPU": 1}
    assert _scaling(spec, None)["use_gpu"] is True, "planning (not connected): the intent"

    spec = JobSpec(gpus=2)
    assert _scaling(spec, gpu_cluster)["use_gpu"] is False, "no gpu_type: CPU workers"
    assert _scaling(spec, gpu_cluster)["placement_strategy"] == "PACK"
    spec = JobSpec(gpus=2, nodes=1, gpu_type="H100")
    opts = _scaling(spec, gpu_cluster)
    assert opts["placement_strategy"] == "STRICT_PACK" and "accelerator_type" not in opts


def test_fits_packs_bundles_per_node() -> None:
    two_one_cpu_nodes = [{"CPU": 1.0}, {"CPU": 1.0}]
    pack = {"num_workers": 2, "resources_per_worker": {"CPU": 1}, "placement_strategy": "PACK"}
    assert fits(pack, two_one_cpu_nodes)
    assert not fits({**pack, "placement_strategy": "STRICT_PACK"}, two_one_cpu_nodes), "one node holds one"
    assert not fits({**pack, "resources_per_worker": {"CPU": 2}}, two_one_cpu_nodes)
    gpu = {"num_workers": 2, "resources_per_worker": {"GPU": 1}, "placement_strategy": "SPREAD",
           "accelerator_type": "A10G"}
    assert fits(gpu, [{"GPU": 1.0, "accelerator_type:A10G": 1.0}] * 2)
    assert not fits(gpu, [{"GPU": 1.0}] * 2), "the pinned accelerator is not there"


def test_plan_spends_nothing_and_shows_the_scaling_config() -> None:
    compute = RayTrainCompute("ray://head:10001", runtime_env={"pip": ["x"]}, backend="gloo",
                              resources_per_worker={"CPU": 4})
    request = compute.plan(JobSpec(gpus=4, nodes=2, max_restarts=1), "run-1")
    assert isinstance(request, RayRequest) and request.plan.world_size == 4
    shown = request.describe()
    assert shown["scaling_config"] == {"num_workers": 4, "use_gpu": False, "resources_per_worker": {"CPU": 4},
                                       "placement_strategy": "SPREAD"}
    assert (shown["address"], shown["backend"], shown["max_failures"]) == ("ray://head:10001", "gloo", 1)
    assert "heartbeat_ttl_s" not in shown, "a Ray run ends with its driver's connection, not a heartbeat"


def test_the_driver_drives_ray_through_the_contract(compute: RayCompute) -> None:
    assert not hasattr(RayTrainCompute, "execute"), "no whole-job escape hatch"
    job = distributed(gpus=2, compute=compute, mlflow=False)(runtime.rank).job()
    shown = job.dry_run()
    assert shown["nodes"][0]["command"].startswith("ray.train.torch.TorchTrainer")
    result = job.run()
    assert result.values == [0, 1]
    assert isinstance(job.allocation, RayAllocation) and job.allocation.released
    assert job.allocation.request.scaling == shown["scaling_config"], "what dry_run showed was sent"
    assert any("Ray Train run" in gone for gone in result.released)
    assert job.compute.release(job.allocation) == Released(), "release twice: nothing more to give back"
    job.compute.stop(job.allocation)  # and stop after release is harmless


@pytest.mark.own_modules
def test_the_block_builds_this_compute() -> None:
    block = RayCompute(address="ray://head:10001", runtime_env={"env_vars": {"A": "1"}})
    assert block.get_compute() == RayTrainCompute("ray://head:10001", runtime_env={"env_vars": {"A": "1"}})
    dry = distributed(gpus=2, compute=block)(_all_reduce).dry_run("x")
    assert dry["compute"] == "ray" and dry["num_workers"] == 2 and dry["runtime_env"]["env_vars"] == {"A": "1"}
    # this test module was imported from a folder of its own on sys.path: it travels (docs/environment.md)
    assert str(Path(__file__).resolve()) in dry["runtime_env"]["py_modules"], dry["runtime_env"]
