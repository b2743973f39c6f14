"""MLflow registration on a real sqlite store: aliases, faults, run status."""

from __future__ import annotations

import uuid
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.pipeline import registry
from prefect_sgpu.pipeline.registry import CANDIDATE, CHAMPION, register_model


@pytest.fixture()
def store(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 1)


def _name() -> str:
    return f"model-{uuid.uuid4().hex[:8]}"


def test_champion_moves_only_on_improvement(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name, client = _name(), MlflowClient(store)
    first = register_model(_model(0), name=name, metric_name="perplexity", metric_value=9.0,
                           params={"lr": 0.01}, metrics={"train_loss": 2.5}, tracking_uri=store)
    assert first.champion and first.previous_champion is None
    worse = register_model(_model(1), name=name, metric_name="perplexity", metric_value=9.5, tracking_uri=store)
    assert not worse.champion and worse.previous_champion == first.version
    assert str(client.get_model_version_by_alias(name, CANDIDATE).version) == worse.version
    assert str(client.get_model_version_by_alias(name, CHAMPION).version) == first.version
    better = register_model(_model(2), name=name, metric_name="perplexity", metric_value=8.0, tracking_uri=store)
    assert better.champion
    assert str(client.get_model_version_by_alias(name, CHAMPION).version) == better.version

    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    location = client.get_experiment(run.info.experiment_id).artifact_location
    assert location == (Path(store[len("sqlite:///"):]).parent / "mlartifacts").as_uri(), "artifacts sit by the store"
    assert run.data.params["lr"] == "0.01"
    assert run.data.metrics == {"train_loss": 2.5, "perplexity": 9.0}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    loaded = mlflow.pytorch.load_model(f"models:/{name}@{CHAMPION}")
    assert isinstance(loaded, torch.nn.Linear), "pickle serialization loads back the original class"
    assert torch.equal(loaded.weight, _model(2).weight)


def test_higher_is_better_direction(store: str) -> None:
    name = _name()
    register_model(_model(0), name=name, metric_name="accuracy", metric_value=0.8, lower_is_better=False,
                   tracking_uri=store)
    lower = register_model(_model(1), name=name, metric_name="accuracy", metric_value=0.7,
                           lower_is_better=False, tracking_uri=store)
    higher = register_model(_model(2), name=name, metric_name="accuracy", metric_value=0.9,
                            lower_is_better=False, tracking_uri=store)
    assert (lower.champion, higher.champion) == (False, True)


def test_fault_between_logging_and_registering_leaves_no_version(store: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    name, client = _name(), MlflowClient(store)

    def broken(*args: object, **kwargs: object) -> None:
        raise ConnectionError("registry went away")

    monkeypatch.setattr(MlflowClient, "create_model_version", broken)
    with pytest.raises(ConnectionError):
        register_model(_model(0), name=name, metric_name="loss", metric_value=1.0, tracking_uri=store)
    assert client.search_model_versions(f"name='{name}'") == []
    runs = client.search_runs([client.get_experiment_by_name("prefect-sgpu").experiment_id])
    assert runs and all(r.info.status != "RUNNING" for r in runs)
    assert runs[0].info.status == "FAILED"


def test_fault_after_creating_the_version_deletes_it_and_restores_candidate(
        store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name, client = _name(), MlflowClient(store)
    first = register_model(_model(0), name=name, metric_name="loss", metric_value=1.0, tracking_uri=store)
    real = MlflowClient.set_registered_model_alias

    def fails_on_champion(self: MlflowClient, model: str, alias: str, version: str) -> None:
        if alias == CHAMPION:
            raise RuntimeError("injected fault while moving champion")
        real(self, model, alias, version)

    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", fails_on_champion)
    with pytest.raises(RuntimeError, match="injected fault"):
        register_model(_model(1), name=name, metric_name="loss", metric_value=0.5, tracking_uri=store)
    monkeypatch.undo()
    versions = client.search_model_versions(f"name='{name}'")
    assert [str(v.version) for v in versions] == [first.version], "the unfinished version was deleted"
    assert str(client.get_model_version_by_alias(name, CANDIDATE).version) == first.version
    assert str(client.get_model_version_by_alias(name, CHAMPION).version) == first.version
    statuses = {r.info.status for r in client.search_runs(
        [client.get_experiment_by_name("prefect-sgpu").experiment_id])}
    assert statuses == {"FINISHED", "FAILED"}


def test_a_logged_model_without_its_files_is_never_registered(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name, client = _name(), MlflowClient(store)
    monkeypatch.setattr(registry, "_artifact_files", lambda *args: {"MLmodel"})
    with pytest.raises(registry.RegistrationError, match="data/model.pth"):
        register_model(_model(0), name=name, metric_name="loss", metric_value=1.0, tracking_uri=store)
    assert client.search_model_versions(f"name='{name}'") == []


def test_bad_input_fails_before_any_run(store: str) -> None:
    with pytest.raises(SGPUConfigError, match="metric_value"):
        register_model(_model(0), name="m", metric_name="loss", metric_value=float("nan"), tracking_uri=store)
    with pytest.raises(SGPUConfigError, match="name"):
        register_model(_model(0), name="a/b", metric_name="loss", metric_value=1.0, tracking_uri=store)
    assert MlflowClient(store).get_experiment_by_name("prefect-sgpu") is None


def test_a_version_registered_into_the_training_run_links_to_it_and_leaves_its_status(store: str) -> None:
    name, client = _name(), MlflowClient(store)
    experiment = client.create_experiment(f"train-{uuid.uuid4().hex[:6]}")
    training = client.create_run(experiment, run_name="train")
    for step, loss in enumerate([3.0, 2.0, 1.5]):
        client.log_metric(training.info.run_id, "train_loss", loss, step=step)
    client.log_param(training.info.run_id, "lr", "0.01")
    client.set_terminated(training.info.run_id, "FINISHED")

    version = register_model(_model(0), name=name, metric_name="perplexity", metric_value=7.0,
                             params={"lr": 0.02, "gpus": 2}, tracking_uri=store, run_id=training.info.run_id)

    assert version.run_id == training.info.run_id
    mv = client.get_model_version(name, version.version)
    assert mv.run_id == training.info.run_id, "the version links to the run with the loss curve"
    run = client.get_run(training.info.run_id)
    assert run.info.status == "FINISHED", "the training run's status is left as its job set it"
    assert run.data.metrics["perplexity"] == 7.0
    assert [m.value for m in client.get_metric_history(run.info.run_id, "train_loss")] == [3.0, 2.0, 1.5]
    assert run.data.params == {"lr": "0.01", "gpus": "2"}, "a param the run has is kept, new ones added"
    assert client.search_runs([experiment]) and len(client.search_runs([experiment])) == 1, "no extra run"

    with pytest.raises(SGPUConfigError, match="run_id='nope'"):
        register_model(_model(0), name=name, metric_name="perplexity", metric_value=7.0, tracking_uri=store,
                       run_id="nope")
