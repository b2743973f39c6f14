"""The ``sgpu`` worker: job variables checked before a flow run starts, GPU defaults, kill safety.

A real Prefect server, the Prefect CLI's worker (``--run-once``), real flow-run processes
and torch elastic jobs; nothing of Prefect is mocked.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
FLOW = TESTS / "support" / "pool_defaults_flow.py"
POOL = "sgpu-worker-test"


def _env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    path = os.pathsep.join(p for p in (str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()),
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "5", "PYTHONPATH": path}


def _cli(*args: str, timeout: int = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def pool(prefect_server: None) -> str:
    made = _cli("work-pool", "create", POOL, "--type", "sgpu", "--overwrite")
    assert made.returncode == 0, made.stdout + made.stderr
    saved = subprocess.run([sys.executable, "blocks/save_blocks.py", "local-default.json"], cwd=ROOT,
                           env=_env(), capture_output=True, text=True)
    assert saved.returncode == 0, saved.stderr
    return POOL


def _deploy(name: str, job_variables: dict[str, Any]) -> UUID:
    from prefect import flow

    return flow.from_source(source=str(FLOW.parent), entrypoint=f"{FLOW.name}:pool_defaults_flow").deploy(
        name=name, work_pool_name=POOL, job_variables=job_variables, print_next_steps=False)


def _run_worker_once() -> subprocess.CompletedProcess[str]:
    return _cli("worker", "start", "--pool", POOL, "--type", "sgpu", "--run-once")


def _logs(flow_run_id: UUID) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        return [log.message for log in client.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=0)]


def _task_runs(flow_run_id: UUID) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


@pytest.mark.e2e
def test_pool_gpu_defaults_decide_a_gpu_task_that_gives_none(pool: str) -> None:
    from prefect.client.orchestration import get_client

    deployment_id = _deploy("gpu-defaults", {"gpus": 2, "nodes": 1,
                                             "compute_block": "sgpu-local-compute/local-default"})
    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(deployment_id)
        worker = _run_worker_once()
        finished = client.read_flow_run(run.id)
    assert finished.state.is_completed(), \
        f"{finished.state}\n{worker.stdout[-3000:]}\n{worker.stderr[-3000:]}"
    assert "pool-defaults ranks=2 worlds=[2]" in _logs(run.id)
    assert finished.infrastructure_pid.startswith(f"{socket.gethostname()}:")


@pytest.mark.e2e  # a worker CLI runs four flow runs
def test_a_block_that_does_not_exist_fails_the_run_before_it_starts(pool: str) -> None:
    from prefect.blocks.core import Block
    from prefect.client.orchestration import get_client
    from prefect_sgpu.blocks import LocalCompute

    LocalCompute().save("deleted-soon", overwrite=True)
    deleted_id = Block.load("sgpu-local-compute/deleted-soon")._block_document_id
    cases = {
        "missing-name": ({"compute_block": "sgpu-local-compute/no-such-block"},
                         "compute_block='sgpu-local-compute/no-such-block' is not allowed",
                         "no sgpu-local-compute block named 'no-such-block'"),
        "deleted-ref": ({"compute_block": {"$ref": {"block_document_id": str(deleted_id)}}},
                        f"compute_block='block document {deleted_id}' is not allowed",
                        "no such block document exists"),
        "missing-store": ({"store_block": "sgpu-store/nowhere"}, "store_block='sgpu-store/nowhere'",
                          "no sgpu-store block named 'nowhere'"),
        "unknown-gpu-type": ({"gpu_type": "Z100"}, "job variable gpu_type='Z100' is not allowed", "H100"),
    }
    runs = {}
    with get_client(sync_client=True) as client:
        for name, (variables, _, _) in cases.items():
            runs[name] = client.create_flow_run_from_deployment(_deploy(name, variables)).id
        client.delete_block_document(deleted_id)
        worker = _run_worker_once()
        finished = {name: client.read_flow_run(run_id) for name, run_id in runs.items()}
        history = {name: [s.type.value for s in client.read_flow_run_states(run_id)]
                   for name, run_id in runs.items()}
    for name, (_, names_value, says_why) in cases.items():
        state = finished[name].state
        assert state.is_crashed(), f"{name}: {state}\n{worker.stdout[-3000:]}\n{worker.stderr[-3000:]}"
        assert names_value in state.message and says_why in state.message, f"{name}: {state.message}"
        assert "RUNNING" not in history[name], f"{name}: the flow run started: {history[name]}"
        assert _task_runs(runs[name]) == [], f"{name}: a task ran"


def test_a_wrong_block_type_or_gpu_count_is_refused_at_deploy_time(pool: str) -> None:
    from prefect.deployments.runner import DeploymentApplyError

    for field, value in (("compute_block", "sgpu-ec2-computer/h100-pool"), ("gpus", 0)):
        with pytest.raises(DeploymentApplyError, match=f"Validation failed for field '{field}'"):
            _deploy("refused", {field: value})


def test_kill_infrastructure_refuses_a_process_of_another_host() -> None:
    from prefect.exceptions import InfrastructureNotAvailable

    from prefect_sgpu.adapters.worker import SGPUWorker

    configuration = _configuration_for_a_flow_run()
    victim = _flow_run_process(configuration)
    try:
        worker = SGPUWorker(work_pool_name="any")
        with pytest.raises(InfrastructureNotAvailable, match="otherhost"):
            asyncio.run(worker.kill_infrastructure(f"otherhost:{victim.pid}", configuration=configuration,
                                                   grace_seconds=1))
        assert victim.poll() is None, "a process was killed on the word of another host"
        asyncio.run(worker.kill_infrastructure(f"{socket.gethostname()}:{victim.pid}", configuration=configuration,
                                               grace_seconds=5))
        assert victim.wait(timeout=30) is not None
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()


def _configuration_for_a_flow_run() -> Any:
    """The job configuration Prefect prepares for a flow run (and hands to ``kill_infrastructure``)."""
    from uuid import uuid4

    from prefect.client.schemas.objects import FlowRun

    from prefect_sgpu.adapters.worker import SGPUJobConfiguration

    configuration = SGPUJobConfiguration()
    configuration.prepare_for_flow_run(FlowRun(id=uuid4(), flow_id=uuid4(), name="cancelled"))
    return configuration


def _flow_run_process(configuration: Any | None) -> subprocess.Popen[bytes]:
    """A process started as the worker starts a flow run's (its configuration's environment), or, for
    None, any other process of this user."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT__FLOW_RUN_ID"}
    if configuration is not None:
        env.update({k: v for k, v in configuration.env.items() if v is not None})
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)


def test_kill_infrastructure_signals_only_the_process_of_the_flow_run_it_cancels() -> None:
    """Whoever can edit a flow run sets its ``infrastructure_pid``: naming another process of the
    worker's user (the worker's own, another flow run's) gets nothing signalled."""
    from prefect.exceptions import InfrastructureNotAvailable

    from prefect_sgpu.adapters.worker import SGPUWorker

    cancelled, other = _configuration_for_a_flow_run(), _configuration_for_a_flow_run()
    bystander, other_run, target = _flow_run_process(None), _flow_run_process(other), _flow_run_process(cancelled)
    worker = SGPUWorker(work_pool_name="any")
    try:
        for proc, configuration in ((bystander, cancelled), (other_run, cancelled), (target, None)):
            with pytest.raises(InfrastructureNotAvailable, match="Unable to kill process"):
                asyncio.run(worker.kill_infrastructure(f"{socket.gethostname()}:{proc.pid}",
                                                       configuration=configuration, grace_seconds=1))
        assert [p.poll() for p in (bystander, other_run, target)] == [None] * 3, "a process was signalled"
        asyncio.run(worker.kill_infrastructure(str(target.pid), configuration=cancelled, grace_seconds=5))
        assert target.wait(timeout=30) is not None
        assert bystander.poll() is None and other_run.poll() is None
    finally:
        for proc in (bystander, other_run, target):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_pool_offers_block_pickers_for_its_block_variables() -> None:
    """The UI renders a block-document picker for a variable whose schema refers to a block type."""
    from prefect_sgpu.adapters.worker import SGPUWorker

    variables = SGPUWorker.get_default_base_job_template()["variables"]

    def picked(field: str) -> set[str]:
        refs = [o["$ref"].rsplit("/", 1)[-1] for o in variables["properties"][field]["anyOf"] if "$ref" in o]
        return {variables["definitions"][name]["block_type_slug"] for name in refs}

    assert picked("compute_block") == {"sgpu-local-compute", "sgpu-ec2-compute", "sgpu-ray-compute"}
    assert picked("store_block") == {"sgpu-store"}
    gpu_defaults = {"gpus", "gpu_type", "nodes", "strategy", "max_recoveries", "hang_timeout"}
    assert gpu_defaults <= set(variables["properties"])


def test_dev_without_arguments_prints_its_usage_only() -> None:
    usage = subprocess.run([str(ROOT / "dev")], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0, usage.stderr
    lines = (ROOT / "dev").read_text().splitlines()[1:]
    header = lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))]
    assert usage.stdout.splitlines() == header
    assert any("./dev package" in line for line in header), "every command is in the usage"
