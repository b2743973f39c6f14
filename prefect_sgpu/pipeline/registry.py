"""Log a trained model to MLflow, register a version, move ``candidate`` and ``champion``.

Registration runs on the driver (or rank 0) with :class:`mlflow.tracking.MlflowClient`:

1. an MLflow run gets the parameters and metrics;
2. the model is logged with pickle serialization and explicit pip requirements (fast:
   no ``torch.export``, no requirement inference) and its artifacts are checked;
3. only then is a model version created, so no version ever points to a missing model;
4. the new version gets the ``candidate`` alias, and ``champion`` moves to it only when
   its evaluation metric beats the current champion's (``lower_is_better`` for loss or
   perplexity).

If anything after step 3 fails, the new version is deleted and ``candidate`` goes back
to where it was; the run always ends FINISHED or FAILED, never RUNNING.

Given ``run_id`` (the training job's run, which holds its loss curve), everything goes into
that run instead and the version links to it: one run shows how the model was trained, how it
scored and which version it became. That run's status is its job's; registration leaves it as
it is, and keeps a parameter the run already has rather than overwrite it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from prefect_sgpu.errors import SGPUConfigError

logger = logging.getLogger("prefect_sgpu.registry")

CANDIDATE = "candidate"
CHAMPION = "champion"
MODEL_ARTIFACT = "model"


class RegistrationError(RuntimeError):
    """The model could not be registered; nothing half-made was left in the registry."""


@dataclass(frozen=True)
class RegisteredVersion:
    """What :func:`register_model` produced."""

    name: str
    version: str
    run_id: str
    model_uri: str  #: ``models:/NAME/VERSION``
    metric_name: str
    metric_value: float
    champion: bool  #: this version now holds the ``champion`` alias
    previous_champion: str | None  #: the version that held it before, if any


def default_pip_requirements() -> list[str]:
    """torch and transformers pinned to the versions that produced the model."""
    from importlib.metadata import PackageNotFoundError, version

    reqs = []
    for package in ("torch", "transformers"):
        try:
            reqs.append(f"{package}=={version(package)}")
        except PackageNotFoundError:
            continue
    return reqs


def is_better(value: float, than: float | None, lower_is_better: bool) -> bool:
    """True when ``value`` beats ``than`` (None: nothing to beat)."""
    if than is None or math.isnan(than):
        return True
    return value < than if lower_is_better else value > than


def register_model(
    model: Any,
    *,
    name: str,
    metric_name: str,
    metric_value: float,
    lower_is_better: bool = True,
    params: dict[str, Any] | None = None,
    metrics: dict[str, float] | None = None,
    pip_requirements: list[str] | None = None,
    experiment_name: str = "prefect-sgpu",
    run_name: str | None = None,
    tags: dict[str, str] | None = None,
    tracking_uri: str | None = None,
    run_id: str | None = None,
) -> RegisteredVersion:
    """Log ``model`` (a torch module) with its params and metrics, register it, move aliases.

    ``run_id``: an existing run (the training run) to log into and link the version to; by
    default a new run is made for the registration.
    """
    if not name or "/" in name or "@" in name:
        raise SGPUConfigError("name", name, "a registered model name without '/' or '@'")
    if not isinstance(metric_value, (int, float)) or not math.isfinite(metric_value):
        raise SGPUConfigError("metric_value", metric_value, "a finite number (the evaluation metric)")
    from mlflow.entities import Metric, Param
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from prefect_sgpu.observe.tracking import default_tracking_uri, experiment_id

    uri = tracking_uri or default_tracking_uri()
    client = MlflowClient(uri)
    existing = params_before = None
    if run_id is not None:
        try:
            existing = client.get_run(run_id)
        except MlflowException as exc:
            raise SGPUConfigError("run_id", run_id, f"a run of the tracking store {uri} ({exc.message})") from None
        if existing.info.lifecycle_stage != "active":
            raise SGPUConfigError("run_id", run_id, "a run that is not deleted")
        params_before = existing.data.params
        if tags:
            for key, value in tags.items():
                client.set_tag(run_id, key, value)
    else:
        run = client.create_run(experiment_id(client, experiment_name, uri),
                                run_name=run_name or f"register-{name}", tags=tags or {})
        run_id = run.info.run_id
    status = "FAILED"
    try:
        import time

        now = int(time.time() * 1000)
        all_metrics = {**(metrics or {}), metric_name: float(metric_value)}
        new_params = {k: str(v) for k, v in (params or {}).items()}
        for key in set(new_params) & set(params_before or {}):
            if new_params.pop(key) != params_before[key]:
                logger.warning("MLflow run %s keeps its param %s=%r (registration had %r)", run_id, key,
                               params_before[key], str(params[key]))
        client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in all_metrics.items()],
                         params=[Param(k, v) for k, v in new_params.items()])
        model_source, model_id = _log_model(client, uri, run_id, model, pip_requirements)
        registered = _create_version(client, name, model_source, run_id, model_id, metric_name,
                                     float(metric_value), lower_is_better)
        status = "FINISHED"
        return registered
    finally:
        if existing is None:  # a run of its own: ended here; the training run's status is its job's
            try:
                client.set_terminated(run_id, status=status)
            except Exception:  # noqa: BLE001 - do not mask the registration's own outcome
                logger.exception("could not end MLflow run %s as %s", run_id, status)


def _log_model(client: Any, uri: str, run_id: str, model: Any,
               pip_requirements: list[str] | None) -> tuple[str, str]:
    """Log the model as a logged model of the run; return (version source, model id) once verified.

    ``mlflow.pytorch.save_model`` with pickle serialization and explicit requirements is
    what ``mlflow.pytorch.log_model(serialization_format="pickle", ...)`` does, minus the
    process-wide tracking URI it resolves: here every call goes through ``client``, so a
    registry given by ``tracking_uri`` never changes the caller's MLflow settings.
    """
    import tempfile

    import mlflow.pytorch
    from mlflow.entities import LoggedModelOutput

    experiment_id = client.get_run(run_id).info.experiment_id
    logged = client.create_logged_model(experiment_id, name=MODEL_ARTIFACT, source_run_id=run_id)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            local = f"{tmp}/{MODEL_ARTIFACT}"
            mlflow.pytorch.save_model(model, local, serialization_format="pickle",
                                      pip_requirements=pip_requirements or default_pip_requirements())
            client.log_model_artifacts(logged.model_id, local)
        files = _artifact_files(client, logged.model_id)
        missing = [f for f in ("MLmodel", "data/model.pth") if f not in files]
        if missing:
            raise RegistrationError(f"logged model {logged.model_id} lacks {', '.join(missing)}; "
                                    "no version was created")
        client.finalize_logged_model(logged.model_id, "READY")
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
    except BaseException:
        _quietly(client.finalize_logged_model, logged.model_id, "FAILED")
        raise
    # the artifact location, not ``models:/<id>``: MLflow resolves the latter through the
    # process-wide tracking URI, which may not be this client's
    return str(logged.artifact_location), logged.model_id


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the original failure is the one to report
        logger.exception("cleanup step %s failed", getattr(fn, "__name__", fn))


def _artifact_files(client: Any, model_id: str) -> set[str]:
    """Relative paths of every file of a logged model."""
    found: set[str] = set()

    def walk(path: str | None) -> None:
        for entry in client.list_logged_model_artifacts(model_id, path):
            if entry.is_dir:
                walk(entry.path)
            else:
                found.add(entry.path)

    walk(None)
    return found


def _alias_version(client: Any, name: str, alias: str) -> Any | None:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def _metric_of(client: Any, version: Any, metric_name: str) -> float | None:
    """A version's evaluation metric: its tag, else its run's metric."""
    if metric_name in (version.tags or {}):
        return float(version.tags[metric_name])
    if version.run_id:
        value = client.get_run(version.run_id).data.metrics.get(metric_name)
        return float(value) if value is not None else None
    return None


def _create_version(client: Any, name: str, source: str, run_id: str, model_id: str | None,
                    metric_name: str, metric_value: float, lower_is_better: bool) -> RegisteredVersion:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    previous_candidate = _alias_version(client, name, CANDIDATE)
    champion = _alias_version(client, name, CHAMPION)
    version = client.create_model_version(name, source=source, run_id=run_id, model_id=model_id,
                                          tags={metric_name: repr(metric_value)})
    try:
        client.set_registered_model_alias(name, CANDIDATE, version.version)
        champion_value = _metric_of(client, champion, metric_name) if champion is not None else None
        if champion is not None and champion_value is None:
            logger.warning("champion v%s of %s has no %s: it stays champion", champion.version, name, metric_name)
            promote = False
        else:
            promote = is_better(metric_value, champion_value, lower_is_better)
        if promote:
            client.set_registered_model_alias(name, CHAMPION, version.version)
    except BaseException:
        _undo_version(client, name, version.version, previous_candidate)
        raise
    return RegisteredVersion(
        name=name, version=str(version.version), run_id=run_id, model_uri=f"models:/{name}/{version.version}",
        metric_name=metric_name, metric_value=metric_value, champion=promote,
        previous_champion=str(champion.version) if champion is not None else None,
    )


def _undo_version(client: Any, name: str, version: str, previous_candidate: Any | None) -> None:
    """Delete a version whose registration did not finish; give ``candidate`` back."""
    try:
        client.delete_model_version(name, version)
        if previous_candidate is not None:
            client.set_registered_model_alias(name, CANDIDATE, previous_candidate.version)
    except Exception:  # noqa: BLE001 - the original failure is the one to report
        logger.exception("could not remove unfinished version %s of %s", version, name)
