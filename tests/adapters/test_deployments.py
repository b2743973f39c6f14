"""`prefect deploy`, the sgpu work pool, a UI-style retry that resumes, and cancellation.

Everything runs for real: the Prefect CLI against the session's server, a worker
process of type ``sgpu``, flow-run processes, torch elastic jobs, MLflow sqlite.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import psutil
import pytest
from support.processes import default_sigint

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
POOL = "sgpu-local"


def _env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_CANCELLATION_POLL_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "5"}


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def deployment_id(prefect_server: None) -> UUID:
    from prefect.client.orchestration import get_client

    out = _cli("work-pool", "create", POOL, "--type", "sgpu", "--overwrite")
    assert out.returncode == 0, out.stdout + out.stderr
    saved = subprocess.run([sys.executable, "blocks/save_blocks.py", "local-default.json"], cwd=ROOT,
                           env=_env(), capture_output=True, text=True)
    assert saved.returncode == 0, saved.stderr
    out = _cli("deploy", "--all", "--prefect-file", "deployments/prefect.yaml")
    assert out.returncode == 0, out.stdout + out.stderr
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("mlp-ddp/mlp-ddp-nightly")
        assert deployment.work_pool_name == POOL
        assert deployment.job_variables["compute_block"] == "sgpu-local-compute/local-default"
        assert [s.schedule.cron for s in deployment.schedules] == ["0 3 * * *"]
        assert [s.slug for s in deployment.schedules] == ["mlp-ddp-nightly"]
        pool = client.read_work_pool(POOL)
        assert pool.type == "sgpu"
        return deployment.id


def _run_worker_once() -> subprocess.CompletedProcess[str]:
    return _cli("worker", "start", "--pool", POOL, "--type", "sgpu", "--run-once", timeout=400)


def _logs(flow_run_id: UUID, client: Any = None) -> list[str]:
    """The flow run's log messages, through ``client`` when given (a poll loop's own: a new client costs a TLS context)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    if client is None:
        with get_client(sync_client=True) as client:
            return _logs(flow_run_id, client)
    return [log.message for log in client.read_logs(
        LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=0)]


def test_failed_run_retried_like_the_ui_resumes_from_its_checkpoint(deployment_id: UUID, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.states import Scheduled

    fault = tmp_path / "inject-fault"
    fault.write_text("fail once")
    data_file = Path(os.environ["PREFECT_SGPU_HOME"]) / "data" / "regression-5000x10-0.pt"
    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(deployment_id, parameters={
            "num_epochs": 4, "batch_size": 256, "gpus": 2, "nodes": 1,
            "fault_file": str(fault), "fault_epoch": 2})

        worker = _run_worker_once()
        state = client.read_flow_run(run.id).state
        assert state.is_failed(), f"{state}\n{worker.stdout[-3000:]}\n{worker.stderr[-3000:]}"
        assert any("injected fault at epoch 2" in m for m in _logs(run.id))
        data_mtime = data_file.stat().st_mtime

        fault.unlink()  # the fault is fixed; retry the same flow run as the UI's Retry does
        client.set_flow_run_state(run.id, Scheduled(), force=True)
        worker = _run_worker_once()
        state = client.read_flow_run(run.id).state
        assert state.is_completed(), f"{state}\n{worker.stdout[-3000:]}\n{worker.stderr[-3000:]}"

        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    prep_states = sorted(tr.state.name for tr in task_runs if tr.task_key.startswith("prepare_data"))
    assert prep_states == ["Cached", "Completed"], "data prep ran once; the retry took its persisted result"
    assert data_file.stat().st_mtime == data_mtime
    messages = _logs(run.id)
    assert "[rank 0 node 0] resuming from checkpoint after epoch 1" in messages
    assert any("training started at epoch 2" in m for m in messages)
    assert not any("[rank 0 node 0] epoch 0:" in m for m in messages[messages.index(
        "[rank 0 node 0] resuming from checkpoint after epoch 1"):]), "the retry did not restart at epoch 0"


def _job_agents() -> list[psutil.Process]:
    home = os.environ["PREFECT_SGPU_HOME"]
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "prefect_sgpu.launch" in cmd and home in cmd:
            found.append(proc)
    return found


def test_cancelling_the_flow_run_stops_every_rank_and_kills_the_mlflow_run(deployment_id: UUID) -> None:
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    before = {p.pid for p in _job_agents()}
    worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL,
                               "--type", "sgpu"], cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True,
                              preexec_fn=default_sigint)  # Prefect turns SIGTERM into SIGINT
    try:
        with get_client(sync_client=True) as client:
            # ranks that stay in training while the cancel travels, each epoch followed by a 1 s wait
            # (at full speed they train, log and checkpoint flat out on every core meanwhile)
            run = client.create_flow_run_from_deployment(deployment_id, parameters={
                "num_epochs": 100000, "batch_size": 512, "gpus": 2, "nodes": 1, "pace_s": 1.0})
            deadline = time.monotonic() + 420  # a worker, a flow run and a job start: minutes when loaded
            while not any("[rank 0 node 0] epoch 0:" in m for m in _logs(run.id, client)):
                assert time.monotonic() < deadline, "training never started"
                time.sleep(1)
            assert {p.pid for p in _job_agents()} - before, "the job's processes should be running"
            client.set_flow_run_state(run.id, Cancelling(), force=True)
            deadline = time.monotonic() + 120
            while not client.read_flow_run(run.id).state.is_cancelled():
                assert time.monotonic() < deadline, f"not cancelled: {client.read_flow_run(run.id).state}"
                time.sleep(1)
        deadline = time.monotonic() + 60
        while {p.pid for p in _job_agents() if p.is_running()} - before:
            assert time.monotonic() < deadline, "ranks left running after cancellation"
            time.sleep(0.5)
        mlflow_client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
        exps = [e.experiment_id for e in mlflow_client.search_experiments()]
        deadline = time.monotonic() + 30
        while True:
            runs = mlflow_client.search_runs(exps, filter_string=f"tags.`prefect.flow_run_id` = '{run.id}'")
            if runs and runs[0].info.status != "RUNNING" or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert [r.info.status for r in runs] == ["KILLED"]
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=60)
