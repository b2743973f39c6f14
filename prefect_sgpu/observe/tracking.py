"""One MLflow run per distributed call, as Databricks' serverless GPU API does.

The driver creates the run (nested under an active run when there is one), hands
``MLFLOW_RUN_ID`` and the tracking URI to every rank, and ends it FINISHED, FAILED
or KILLED to match the outcome. Creating the store on the driver first also avoids
ranks racing on a fresh sqlite store's schema migration.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from prefect_sgpu.store import default_home

logger = logging.getLogger("prefect_sgpu.observe.tracking")


def default_tracking_uri() -> str:
    """The user's tracking URI if they set one, else a sqlite file under PREFECT_SGPU_HOME."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_uri, get_tracking_uri

        if _tracking_uri:  # set in this process with mlflow.set_tracking_uri()
            return str(get_tracking_uri())
    except ImportError:
        pass
    home = default_home()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'mlflow.db'}"


def mlflow_available() -> bool:
    try:
        import mlflow  # noqa: F401
    except ImportError:
        return False
    return True


class TrackedRun:
    """The MLflow run of one job; ``end()`` is idempotent and never raises."""

    def __init__(self, run_id: str, tracking_uri: str, experiment_id: str) -> None:
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.experiment_id = experiment_id
        self.status: str | None = None

    @property
    def env(self) -> dict[str, str]:
        return {"MLFLOW_RUN_ID": self.run_id, "MLFLOW_TRACKING_URI": self.tracking_uri,
                "MLFLOW_EXPERIMENT_ID": self.experiment_id}

    def url(self) -> str:
        return f"{self.tracking_uri}#/experiments/{self.experiment_id}/runs/{self.run_id}"

    def set_tags(self, tags: dict[str, str]) -> None:
        """Tags on the run; never raises (tracking must not mask the job's outcome)."""
        try:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(self.tracking_uri)
            for key, value in tags.items():
                client.set_tag(self.run_id, key, value)
        except Exception:  # noqa: BLE001
            logger.exception("could not tag MLflow run %s", self.run_id)

    def end(self, status: str) -> None:
        if self.status is not None:
            return
        self.status = status
        try:
            from mlflow.tracking import MlflowClient

            MlflowClient(self.tracking_uri).set_terminated(self.run_id, status=status)
        except Exception:  # noqa: BLE001 - tracking must not mask the job's own outcome
            logger.exception("could not end MLflow run %s as %s", self.run_id, status)


def active_parent() -> tuple[str, str] | None:
    """(run id, experiment id) of the caller's active MLflow run, read in the caller's thread."""
    import sys

    if "mlflow" not in sys.modules:  # nobody started a run without importing mlflow
        return None
    import mlflow

    run = mlflow.active_run()
    return (run.info.run_id, run.info.experiment_id) if run is not None else None


def start_run(name: str, tags: dict[str, str], params: dict[str, Any],
              parent: tuple[str, str] | None = None) -> TrackedRun:
    from mlflow.tracking import MlflowClient

    uri = default_tracking_uri()
    client = MlflowClient(uri)
    if parent is not None:
        experiment_id = parent[1]
        tags = {**tags, "mlflow.parentRunId": parent[0]}
    else:
        experiment_id = _experiment_id(client, uri)
    run = client.create_run(experiment_id, run_name=name, tags=tags)
    for key, value in params.items():
        client.log_param(run.info.run_id, key, value)
    return TrackedRun(run.info.run_id, uri, experiment_id)


def artifact_location(uri: str) -> str | None:
    """Beside a sqlite store's file; MLflow's default is ``./mlruns`` under the current directory."""
    if not uri.startswith("sqlite:///"):
        return None
    from pathlib import Path

    return (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").absolute().as_uri()


def experiment_id(client: Any, name: str, uri: str) -> str:
    """The id of experiment ``name``, created (artifacts beside a sqlite store) when missing."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return str(experiment.experiment_id)
    try:
        return str(client.create_experiment(name, artifact_location=artifact_location(uri)))
    except Exception:  # noqa: BLE001 - created concurrently by another caller
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return str(experiment.experiment_id)


def _experiment_id(client: Any, uri: str) -> str:
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    return experiment_id(client, os.environ.get("MLFLOW_EXPERIMENT_NAME", "prefect-sgpu"), uri)
