"""The sweeper on a local job store and a real MLflow store: only dead runs of its own store go."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prefect_sgpu.protocol import jobfolder
from prefect_sgpu.protocol.jobfolder import JobFolder, new_key
from prefect_sgpu.store import LocalStore
from prefect_sgpu.compute.remote.sweep import Sweeper

REPO = Path(__file__).resolve().parents[1]
TTL_S = 60.0


def _job(store: LocalStore, run_id: str, age_s: float) -> JobFolder:
    """A job folder as a driver leaves it mid-run, its files last written ``age_s`` ago."""
    folder = JobFolder(store, run_id, new_key())
    folder.put_payload(b"payload")
    folder.beat()
    store.put(run_id, jobfolder.status_key(0), b"status")
    store.put(run_id, jobfolder.log_key(0), b"rank 0 says hello\n")
    store.put(run_id, "checkpoints/step-00000010/COMPLETE", b"")
    then = time.time() - age_s
    for path in (store.root / run_id).rglob("*"):
        os.utime(path, (then, then))
    return folder


def _mlflow_run(uri: str, run_id: str, store: str) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("sweep") or None
    experiment_id = experiment.experiment_id if experiment else client.create_experiment("sweep")
    return str(client.create_run(experiment_id, tags={"sgpu.run_id": run_id, "sgpu.store": store}).info.run_id)


@pytest.fixture
def world(tmp_path: Path) -> dict[str, object]:
    store = LocalStore(tmp_path / "jobs")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _job(store, "dead", age_s=TTL_S + 120)
    _job(store, "alive", age_s=5)
    store.put("ended", jobfolder.log_key(0), b"done\n")  # a finished job: logs only
    runs = {name: _mlflow_run(uri, name, store.root_uri) for name in ("dead", "alive", "ended")}
    runs["foreign"] = _mlflow_run(uri, "dead", "s3://another-bucket/jobs")  # same run id, another store
    return {"store": store, "uri": uri, "runs": runs}


def _status(uri: str, mlflow_run: str) -> str:
    from mlflow.tracking import MlflowClient

    return str(MlflowClient(uri).get_run(mlflow_run).info.status)


def test_only_the_dead_run_of_this_store_is_swept(world: dict[str, object]) -> None:
    store, uri, runs = world["store"], str(world["uri"]), world["runs"]
    assert isinstance(store, LocalStore) and isinstance(runs, dict)
    sweeper = Sweeper(store, ttl_s=TTL_S, tracking_uri=uri)

    dry = sweeper.sweep(dry_run=True)
    assert {(x.run_id, x.kind) for x in dry.found} == {("dead", "store files"), ("dead", "MLflow run"),
                                                       ("ended", "MLflow run")}
    assert not dry.removed and (store.root / "dead" / "heartbeat").exists(), "a dry run removes nothing"
    assert "alive" in dry.live

    report = sweeper.sweep()
    assert {(x.run_id, x.kind) for x in report.removed} == {(x.run_id, x.kind) for x in dry.found}
    assert not report.errors
    left = sorted(p.relative_to(store.root / "dead").as_posix() for p in (store.root / "dead").rglob("*")
                  if p.is_file())
    assert left == ["checkpoints/step-00000010/COMPLETE", "logs/rank-00000.log"], "logs and checkpoints stay"
    assert (store.root / "alive" / "heartbeat").exists() and (store.root / "alive" / "payload.bin").exists()
    assert _status(uri, runs["dead"]) == "KILLED" and _status(uri, runs["ended"]) == "KILLED"
    assert _status(uri, runs["alive"]) == "RUNNING"
    assert _status(uri, runs["foreign"]) == "RUNNING", "another store's run is never judged"

    assert not sweeper.sweep().found, "a second pass finds nothing"


def test_two_sweepers_at_once_remove_each_thing_once_and_fail_nothing(world: dict[str, object]) -> None:
    store, uri = world["store"], str(world["uri"])
    assert isinstance(store, LocalStore)
    reports = []
    start = threading.Barrier(2)

    def sweep() -> None:
        start.wait()
        reports.append(Sweeper(store, ttl_s=TTL_S, tracking_uri=uri).sweep())

    threads = [threading.Thread(target=sweep) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(reports) == 2 and not [e for r in reports for e in r.errors], [r.errors for r in reports]
    killed = [x for r in reports for x in r.removed if x.kind == "MLflow run"]
    assert len({x.name for x in killed}) == 2  # "dead" and "ended", each by one sweeper or both
    assert not (store.root / "dead" / "heartbeat").exists()


@pytest.mark.e2e  # the gc command in a process of its own
def test_the_gc_command_sweeps_a_local_store(world: dict[str, object]) -> None:
    store, uri = world["store"], str(world["uri"])
    assert isinstance(store, LocalStore)
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "prefect_sgpu.cli", "gc", "--store", str(store.root), "--ttl-seconds", str(TTL_S)]
    dry = subprocess.run([*argv, "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert "would remove store files" in dry.stdout and "of job dead" in dry.stdout, dry.stdout
    assert (store.root / "dead" / "heartbeat").exists()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "removed MLflow run" in done.stdout and not (store.root / "dead" / "heartbeat").exists(), done.stdout
    bad = subprocess.run([*argv, "--store", "x", "--compute-block", "y"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "not allowed with argument" in bad.stderr


@pytest.mark.usefixtures("prefect_server")
def test_the_gc_flow_sweeps_and_publishes_what_it_removed(world: dict[str, object]) -> None:
    from prefect.client.orchestration import get_client

    from prefect_sgpu.adapters.sweep_flow import gc

    store, uri = world["store"], str(world["uri"])
    assert isinstance(store, LocalStore)
    state = gc(store=str(store.root), tracking_uri=uri, return_state=True)
    assert state.is_completed(), state
    report = state.result()
    assert {(x["run_id"], x["kind"]) for x in report["removed"]} == {
        ("dead", "store files"), ("dead", "MLflow run"), ("ended", "MLflow run")}
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:  # this flow run's own artifact, whatever ran before it
        artifact = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["prefect-sgpu-gc"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    assert len(artifact) == 1 and "dead" in str(artifact[0].data), artifact


def test_the_sweeper_of_the_local_compute_is_the_local_job_store(sgpu_home: Path) -> None:
    from prefect_sgpu.compute.local import LocalProcessCompute, heartbeat_ttl
    from prefect_sgpu.compute.remote.sweep import sweeper

    made = sweeper(LocalProcessCompute())
    assert made.store.root_uri == str(sgpu_home / "jobs") and made.ttl_s == heartbeat_ttl()
    assert made.cloud is None
