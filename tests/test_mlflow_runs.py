"""One MLflow run per call, handed to every rank, ended to match the outcome."""

from __future__ import annotations

import os

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from prefect_sgpu import distributed, runtime

pytestmark = pytest.mark.e2e


@distributed(gpus=2)
def log_from_rank_zero(steps: int) -> str:
    import mlflow as ml

    run_id = os.environ["MLFLOW_RUN_ID"]  # mlflow unsets it once a rank resumes the run
    if runtime.is_rank_zero():
        for step in range(steps):
            ml.log_metric("loss", 1.0 / (step + 1), step=step)
    return run_id


def test_ranks_log_into_the_calls_run_which_ends_finished() -> None:
    result = log_from_rank_zero.run(3)
    run_ids = set(result.values)
    assert run_ids == {result.mlflow_run_id}
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [1.0, 0.5, 1 / 3]
    assert run.data.params["sgpu.gpus"] == "2"
    assert run.data.tags["sgpu.run_id"] == result.run_id


def test_call_inside_an_active_run_is_nested() -> None:
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    with mlflow.start_run(run_name="sweep") as parent:
        result = log_from_rank_zero.run(1)
    child = MlflowClient().get_run(result.mlflow_run_id)
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.info.experiment_id == parent.info.experiment_id


def test_failed_call_ends_its_run_failed() -> None:
    @distributed(gpus=2)
    def fails() -> None:
        raise ValueError("bad batch")

    job = fails.job()
    with pytest.raises(ValueError, match="bad batch"):
        job.run()
    run = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(job.tracked.run_id)
    assert run.info.status == "FAILED"


def test_mlflows_system_metrics_switch_logs_each_ranks_metrics_under_its_own_node_id() -> None:
    @distributed(gpus=2, env={"MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "true",
                              "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.5"})
    def busy(seconds: float) -> bool:
        import time

        import mlflow as ml

        from prefect_sgpu import runtime

        client, mine = ml.MlflowClient(), f"system/rank-{runtime.rank()}/cpu_utilization_percentage"
        deadline = time.time() + seconds
        # until this rank's own monitor has logged, however loaded the host; waiting, not computing: a
        # pure-Python loop holding the GIL starved the monitor's thread of it on a saturated machine
        while time.time() < deadline and mine not in client.get_run(os.environ["MLFLOW_RUN_ID"]).data.metrics:
            time.sleep(0.5)
        ml.log_metric("done", 1.0)  # resuming the run in user code starts no second monitor
        return "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING" in os.environ

    result = busy.run(300.0)
    assert result.values == [False, False], "the switch is taken out of the rank's environment"
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    metrics = client.get_run(result.mlflow_run_id).data.metrics
    for rank in (0, 1):
        assert f"system/rank-{rank}/cpu_utilization_percentage" in metrics, sorted(metrics)
        assert f"system/rank-{rank}/system_memory_usage_megabytes" in metrics, sorted(metrics)
    assert not [k for k in metrics if k.startswith("system/") and not k.startswith("system/rank-")], \
        "every system metric carries its rank's node id"


@distributed(gpus=2)
def first_rank_leaves_early() -> str:
    import time

    import mlflow as ml
    import psutil
    import torch.distributed as dist

    run_id = os.environ["MLFLOW_RUN_ID"]
    runtime.init_process_group()
    pids: list[int] = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    dist.destroy_process_group()
    if runtime.is_rank_zero():
        ml.log_metric("early", 1.0)  # resumes the job's run as this process's active run
        return "left"
    while psutil.pid_exists(pids[0]) and psutil.Process(pids[0]).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.2)  # until rank 0's process, and so its exit handlers, are done
    return ml.MlflowClient().get_run(run_id).info.status


def test_a_rank_that_resumed_the_run_leaves_it_running_for_the_others_when_it_exits(monkeypatch) -> None:
    # spawned ranks: rank 0's process ends right after its exit handlers (a forked rank waits for
    # its siblings inside torch elastic), so rank 1 looks once every exit handler of rank 0 ran
    monkeypatch.setenv("PREFECT_SGPU_RANK_START", "spawn")
    result = first_rank_leaves_early.run()
    assert result.values == ["left", "RUNNING"], "rank 0's exit left the shared run as it was"
    run = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED", "the driver ends the run once every rank is done"
    assert run.data.metrics["early"] == 1.0


def test_without_the_switch_no_system_metrics_are_logged() -> None:
    result = log_from_rank_zero.run(1)
    metrics = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(result.mlflow_run_id).data.metrics
    assert not [k for k in metrics if k.startswith("system/")], sorted(metrics)


def test_system_metrics_resume_after_the_store_fails_a_read(tmp_path, monkeypatch) -> None:
    """MLflow's own monitor stops for good at its first store error; the rank's monitor starts again."""
    import threading
    import time

    from prefect_sgpu.launch.rank_main import _KeptMonitor

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("metrics")).info.run_id
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    real_get_run, failures, lock = MlflowClient.get_run, [3], threading.Lock()

    def flaky_get_run(self, rid):  # the store refuses the first three reads, as a locked SQLite file does
        with lock:
            if failures[0]:
                failures[0] -= 1
                raise RuntimeError("database is locked")
        return real_get_run(self, rid)

    monkeypatch.setattr(MlflowClient, "get_run", flaky_get_run)
    monitor = _KeptMonitor(run_id, "rank-0", uri)
    monitor.start()
    deadline = time.monotonic() + 120
    while "system/rank-0/cpu_utilization_percentage" not in real_get_run(client, run_id).data.metrics:
        assert time.monotonic() < deadline, "no system metric was logged after the store came back"
        time.sleep(0.2)
    assert monitor.restarts >= 1
    monitor.finish()
    assert not monitor.thread.is_alive()
    client.set_terminated(run_id)
