"""GPU tasks under Prefect's engine: states, values, retries, caching, logs, artifacts."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from prefect import flow, task
from prefect.cache_policies import INPUTS

from prefect_sgpu import GPUTaskRunner, SGPUConfigError, gpu_task, runtime

pytestmark = pytest.mark.e2e


def _job_dirs() -> set[str]:
    return {p.name for p in (Path(os.environ["PREFECT_SGPU_HOME"]) / "jobs").glob("*")}


@gpu_task(gpus=2, strategy="ddp", mlflow=False)
def rank_info(offset: int) -> dict:
    print(f"rank {runtime.rank()} says hi")
    return {"rank": runtime.rank(), "value": runtime.rank() + offset,
            "strategy": os.environ.get("SGPU_STRATEGY"), "has_api_key": bool(os.environ.get("PREFECT_API_KEY"))}


@task
def plain(x: int) -> tuple[int, bool]:
    return x + 1, "SGPU_RUN_ID" in os.environ


@pytest.mark.quick  # the inner loop's tier: one short job of this kind
def test_gpu_task_value_logs_and_artifact(prefect_server: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterTaskRunId, FlowRunFilter,
                                                LogFilter, LogFilterTaskRunId, TaskRunFilter)
    from prefect.client.schemas.sorting import ArtifactSort

    monkeypatch.setenv("PREFECT_API_KEY", "pnu_not_for_ranks")

    @flow(task_runner=GPUTaskRunner())
    def pipeline() -> tuple:
        prepped, in_job = plain(1)
        state = rank_info(prepped, return_state=True)
        every = rank_info.with_options(return_all=True).submit(10).result()
        return prepped, in_job, state, every

    prepped, in_job, state, every = pipeline()
    assert (prepped, in_job) == (2, False), "tasks without resources run locally"
    assert state.is_completed() and state.result() == {"rank": 0, "value": 2, "strategy": "ddp",
                                                        "has_api_key": False}
    assert [r["value"] for r in every] == [10, 11]

    task_run_id = state.state_details.task_run_id
    wanted = {"[rank 0 node 0] rank 0 says hi", "[rank 1 node 0] rank 1 says hi"}
    with get_client(sync_client=True) as client:
        deadline = time.monotonic() + 30
        while True:
            logs = client.read_logs(LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])),
                                    limit=200, offset=0)
            if wanted <= {log.message for log in logs} or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert wanted <= {log.message for log in logs}, "rank lines are the task run's logs"

        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(task_run_id=ArtifactFilterTaskRunId(any_=[task_run_id])),
            flow_run_filter=FlowRunFilter(), task_run_filter=TaskRunFilter(),
            sort=ArtifactSort.CREATED_DESC, limit=10, offset=0,
        )
    [artifact] = [a for a in artifacts if a.key == "sgpu-rank-info-job"]
    assert "| rank | node | host | exit code | duration (s) |" in artifact.data
    assert "| 0 | 0 |" in artifact.data and "| 1 | 0 |" in artifact.data


def test_retry_relaunches_the_whole_gang(prefect_server: None, tmp_path: Path) -> None:
    marker = tmp_path / "attempts"

    @gpu_task(gpus=2, retries=1, retry_delay_seconds=0, mlflow=False)
    def flaky(path: str) -> int:
        with open(f"{path}.{runtime.rank()}", "a") as fh:
            fh.write("x")
        if runtime.rank() == 1 and len(Path(f"{path}.1").read_text()) == 1:
            # fail only once rank 0 has written: on a loaded machine rank 0 may still be loading
            # its payload when rank 1 fails, and the stopped gang would then not show the relaunch
            deadline = time.monotonic() + 120
            while not Path(f"{path}.0").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            raise RuntimeError("first attempt fails")
        return len(Path(f"{path}.{runtime.rank()}").read_text())

    @flow(task_runner=GPUTaskRunner())
    def pipeline() -> object:
        return flaky(str(marker), return_state=True)

    state = pipeline()
    assert state.is_completed() and state.result() == 2
    assert Path(f"{marker}.0").read_text() == "xx", "rank 0 ran again: the whole gang was relaunched"


def test_cache_hit_launches_nothing(prefect_server: None) -> None:
    @gpu_task(gpus=2, cache_policy=INPUTS, persist_result=True, mlflow=False)
    def cached_square(x: int) -> int:
        return x * x + runtime.rank()

    @flow(task_runner=GPUTaskRunner())
    def pipeline(x: int) -> object:
        return cached_square(x, return_state=True)

    first = pipeline(7)
    before = _job_dirs()
    second = pipeline(7)
    assert first.result() == second.result() == 49
    assert second.name == "Cached"
    assert _job_dirs() == before, "a cache hit must not launch a job"


def test_map_wait_for_and_runner_defaults(prefect_server: None) -> None:
    @task
    def double(x: int) -> int:
        return 2 * x

    @flow(task_runner=GPUTaskRunner(gpus=2, distribute_all_tasks=True, mlflow=False))
    def pipeline() -> list:
        first = double.submit(1)
        mapped = double.map([3, 4], wait_for=[first])
        return [first.result(), *mapped.result()]

    assert pipeline() == [2, 6, 8]


def test_runner_defaults_fill_what_the_task_did_not_give(prefect_server: None) -> None:
    from prefect_sgpu.adapters.task_runner import task_spec

    @gpu_task(mlflow=False)
    def world() -> tuple[int, int]:
        return runtime.world_size(), runtime.node_rank()

    runner = GPUTaskRunner(gpus=4, nodes=2, timeout=60, return_all=True)
    spec = task_spec(world.sgpu, runner)
    assert (spec.gpus, spec.nodes, spec.timeout, spec.return_all) == (4, 2, 60, True)

    @flow(task_runner=runner)
    def pipeline() -> list:
        return world()

    assert pipeline() == [(4, 0), (4, 0), (4, 1), (4, 1)]


def test_remote_gpu_task_without_a_remote_compute_is_refused(prefect_server: None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PREFECT_SGPU_COMPUTE", "PREFECT_SGPU_REMOTE_COMPUTE"):
        monkeypatch.delenv(name, raising=False)

    @gpu_task(gpus=8, gpu_type="H100", remote=True, mlflow=False)
    def big() -> int:
        return runtime.world_size()

    @flow(task_runner=GPUTaskRunner())
    def pipeline() -> int:
        return big()

    before = _job_dirs()
    with pytest.raises(SGPUConfigError, match="remote=True"):
        pipeline()
    assert _job_dirs() == before, "nothing was launched, not even CPU ranks"

    from prefect_sgpu.compute.local import LocalProcessCompute

    @flow(task_runner=GPUTaskRunner(compute=LocalProcessCompute()))
    def on_local() -> int:
        return big()

    with pytest.raises(SGPUConfigError, match="runs on this machine"):
        on_local()


def test_bad_task_resources_fail_at_decoration() -> None:
    with pytest.raises(SGPUConfigError, match="strategy='zero'"):
        gpu_task(gpus=2, strategy="zero")(lambda: None)
    with pytest.raises(SGPUConfigError, match="gpus=0"):
        rank_info.with_options(gpus=0)
    with pytest.raises(SGPUConfigError, match="distribute_all_tasks"):
        GPUTaskRunner(distribute_all_tasks=True)


def test_a_node_lost_mid_task_is_relaunched_inside_one_task_run(prefect_server: None, tmp_path: Path) -> None:
    """Infrastructure loss is not a Prefect retry: the task run completes in its first attempt, and its
    artifact lists the relaunch."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterTaskRunId, FlowRunFilter,
                                                TaskRunFilter)
    from prefect.client.schemas.sorting import ArtifactSort

    marker = tmp_path / "node-1-started"

    @gpu_task(gpus=2, nodes=2, mlflow=False, max_recoveries=1)
    def loses_node_1_once() -> int:
        if runtime.node_rank() == 1 and not marker.exists():
            marker.write_text("x")
            time.sleep(600)  # the node is killed under it
        return runtime.world_size()

    @flow(task_runner=GPUTaskRunner())
    def pipeline() -> object:
        return loses_node_1_once(return_state=True)

    def kill_node_1() -> None:
        """What a vanished machine looks like: node 1's whole process tree dies, nothing reports."""
        import psutil

        while not marker.exists():
            time.sleep(0.2)
        for proc in psutil.Process().children(recursive=True):
            cmd = " ".join(proc.cmdline())
            if "node_agent" in cmd and "--node-index=1" in cmd and \
                    "--node-index=1" not in " ".join(proc.parent().cmdline()):
                os.killpg(proc.pid, signal.SIGKILL)  # the node's process group, all at once
                return

    killer = threading.Thread(target=kill_node_1, daemon=True)
    killer.start()
    state = pipeline()
    assert state.is_completed() and state.result() == 2
    task_run_id = state.state_details.task_run_id
    with get_client(sync_client=True) as client:
        assert client.read_task_run(task_run_id).run_count == 1, "no Prefect retry was used"
        [artifact] = [a for a in client.read_artifacts(
            artifact_filter=ArtifactFilter(task_run_id=ArtifactFilterTaskRunId(any_=[task_run_id])),
            flow_run_filter=FlowRunFilter(), task_run_filter=TaskRunFilter(),
            sort=ArtifactSort.CREATED_DESC, limit=10, offset=0,
        ) if a.type == "markdown" and a.key.endswith("-job")]
    assert "Recovered from infrastructure loss" in artifact.data and "killed by SIGKILL" in artifact.data


@gpu_task(gpus=2, mlflow=False)
def warm_probe(step: int) -> dict:
    return {"step": step, "preloaded": "torch" in __import__("sys").modules, "pid": os.getpid()}


def test_a_flows_gpu_tasks_share_warm_nodes_until_the_flow_ends(prefect_server: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Three GPU tasks of one flow: the first starts the warm nodes, the next two start on them with
    torch already imported (fresh rank processes each time); when the flow ends, the nodes are gone."""
    from prefect_sgpu.compute.warm_pool import POOL
    from support.processes import warm_node_pids

    monkeypatch.setenv("PREFECT_SGPU_KEEP_WARM", "600")  # only the flow's end may close them
    seen_during: list[int] = []

    @flow(task_runner=GPUTaskRunner())
    def pipeline() -> list[dict]:
        out = []
        for step in range(3):
            out.append(warm_probe(step))
            seen_during.append(len(warm_node_pids()))
        return out

    before = set(warm_node_pids())
    results = pipeline()
    assert [r["step"] for r in results] == [0, 1, 2]
    assert [r["preloaded"] for r in results][1:] == [True, True]
    assert len({r["pid"] for r in results}) == 3, "every task's ranks are new processes"
    assert seen_during == [1, 1, 1], "one warm node (gpus=2 on one node) served all three tasks"
    assert set(warm_node_pids()) <= before and not [w for w in POOL.idle() if w.jobs == 3]
