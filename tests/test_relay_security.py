"""Relayed MLflow records cross the job store: whoever can write the store must not be able to
change the run's tags, plant metrics, replay or move records, or drop a rank's good records
by spoiling one line. A real job folder on a local store, a real MLflow sqlite store, the
rank's real relay store writing the files, the driver's real relay replaying them."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from prefect_sgpu.observe import mlflow_relay
from prefect_sgpu.compute.remote.sweep import Sweeper
from prefect_sgpu.protocol.jobfolder import JobFolder, new_key
from prefect_sgpu.observe.mlflow_relay import MetricRelay, metrics_key
from prefect_sgpu.store import LocalStore

RUN = "job-a"


class World:
    def __init__(self, tmp_path: Path, uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.store = LocalStore(tmp_path / "jobs")
        self.key = new_key()
        folder = JobFolder(self.store, RUN, self.key)
        folder.put_payload(b"payload")
        folder.beat()  # a live job: the sweeper must leave its run alone
        self.uri = uri
        self.client = MlflowClient(self.uri)
        experiment = self.client.create_experiment(f"relay-{tmp_path.name}")
        self.mlflow_run = self.client.create_run(
            experiment, tags={"sgpu.run_id": RUN, "sgpu.store": self.store.root_uri}).info.run_id
        self.relay = MetricRelay(self.store, RUN, self.uri, self.mlflow_run, self.key)

    def rank(self, rank: int, run_id: str = RUN, key: str | None = None) -> Any:
        """The relay store a rank's MLflow gets (``MLFLOW_TRACKING_URI=sgpu-relay:``), as ``rank_main`` arms it."""
        self.monkeypatch.setenv("MLFLOW_TRACKING_URI", f"{mlflow_relay.SCHEME}:")
        self.monkeypatch.setenv("SGPU_JOB_DIR", str(self.store.root / run_id))
        self.monkeypatch.setenv("RANK", str(rank))
        self.monkeypatch.delenv(mlflow_relay.KEY_ENV, raising=False)
        mlflow_relay.arm(key or self.key)
        return mlflow_relay.store_builder()

    def path(self, rank: int, run_id: str = RUN) -> Path:
        return self.store.root / run_id / metrics_key(rank)

    def lines(self, rank: int, run_id: str = RUN) -> list[bytes]:
        return self.path(rank, run_id).read_bytes().splitlines(keepends=True)

    def plant(self, rank: int, *lines: bytes) -> None:
        """What a store writer does: append lines to a rank's relay file."""
        with open(self.path(rank), "ab") as fh:
            fh.write(b"".join(lines))

    def run(self) -> Any:
        return self.client.get_run(self.mlflow_run)

    def history(self, key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in self.client.get_metric_history(self.mlflow_run, key)]


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite store for the module (its schema is made once); each test has an experiment and a run of its own."""
    return f"sqlite:///{tmp_path_factory.mktemp('relay-mlflow') / 'mlflow.db'}"


@pytest.fixture
def world(tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    yield World(tmp_path, mlflow_uri, monkeypatch)


def _metric(key: str, value: float, step: int) -> Metric:
    return Metric(key, value, int(time.time() * 1000), step)


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "prefect_sgpu.observe.mlflow_relay" and "was refused" in r.getMessage()]


def test_a_forged_record_cannot_retag_the_run_and_get_it_swept(world: World,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A store writer plants ``sgpu.run_id`` (and a metric) in rank 0's file: unsigned, in the relay's
    old plain format, and sealed with a key that is not this job's. The run keeps its tags, gets none
    of the planted metric, and the next sweep leaves the live run RUNNING."""
    rank0 = world.rank(0)
    for step in range(3):
        rank0.log_batch(world.mlflow_run, [_metric("loss", 1.0 / (step + 1), step)], [], [])
    world.relay.poll()
    with caplog.at_level(logging.WARNING, logger="prefect_sgpu.observe.mlflow_relay"):
        world.plant(0, b'{"metrics":[["planted",1.0,0,0]],"tags":[["sgpu.run_id","gone"]]}\n')  # unsigned
        world.relay.poll()
        assert world.run().data.tags["sgpu.run_id"] == RUN, "a planted tag reached the run"
        forged = mlflow_relay.Record(w="eve", n=1, metrics=[("planted", 1.0, 0, 0)],
                                     tags=[("sgpu.run_id", "gone")])
        world.plant(0, mlflow_relay.seal_record(mlflow_relay.relay_key(new_key()), RUN, 0, forged))
        rank0.log_batch(world.mlflow_run, [_metric("loss", 0.25, 3)], [], [])
        world.relay.poll()

    run = world.run()
    assert run.data.tags["sgpu.run_id"] == RUN, "a planted tag reached the run"
    assert "planted" not in run.data.metrics
    assert world.history("loss") == [(0, 1.0), (1, 0.5), (2, 1 / 3), (3, 0.25)], "the rank's own records"
    refused = _refusals(caplog)
    assert len(refused) == 2 and all("rank 0" in m for m in refused), refused
    assert "not a sealed record" in refused[0] and "signature does not match" in refused[1], refused

    Sweeper(world.store, ttl_s=60.0, tracking_uri=world.uri).sweep()
    assert world.run().info.status == "RUNNING", "the sweeper killed a live run"


def test_a_rank_cannot_set_mlflow_or_sgpu_tags_through_the_relay(world: World,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The rank's relay store drops reserved tags (its other tags and metrics go through), and a
    record that holds one anyway (sealed with the right key, by code that skips the store) is
    refused by the driver."""
    rank0 = world.rank(0)
    rank0.log_batch(world.mlflow_run, [_metric("loss", 0.5, 0)], [Param("lr", "0.1")],
                    [RunTag("sgpu.run_id", "gone"), RunTag("mlflow.user", "eve"), RunTag("team", "vision")])
    world.relay.poll()
    assert world.run().data.tags["sgpu.run_id"] == RUN
    sealed = mlflow_relay.Record(w="rank-code", n=1, metrics=[("extra", 1.0, 0, 0)],
                                 tags=[("SGPU.store", "s3://elsewhere"), ("ok", "1")])
    world.plant(0, mlflow_relay.seal_record(mlflow_relay.relay_key(world.key), RUN, 0, sealed))
    with caplog.at_level(logging.WARNING, logger="prefect_sgpu.observe.mlflow_relay"):
        world.relay.poll()

    run = world.run()
    assert run.data.tags["sgpu.run_id"] == RUN
    assert run.data.tags.get("mlflow.user") != "eve"
    assert run.data.tags["team"] == "vision" and run.data.params["lr"] == "0.1"
    assert world.history("loss") == [(0, 0.5)]
    assert "extra" not in run.data.metrics and "ok" not in run.data.tags, "the record was refused whole"
    refused = _refusals(caplog)
    assert len(refused) == 1 and "rank 0" in refused[0] and "'SGPU.store'" in refused[0], refused


def test_a_bad_record_is_refused_alone_and_the_rest_of_its_chunk_is_replayed(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    """One read holds good records around a damaged line, a param name MLflow rejects and a changed
    param: each bad one is refused with its own log line, every good one is replayed."""
    rank1 = world.rank(1)
    rank1.log_batch(world.mlflow_run, [_metric("loss", 1.0, 0)], [Param("lr", "0.1")], [])
    world.plant(1, b"\x1b[2J not a record\n")
    rank1.log_batch(world.mlflow_run, [_metric("loss", 0.5, 1)], [], [RunTag("phase", "train")])
    rank1.log_batch(world.mlflow_run, [], [Param("bad?name", "1")], [])
    rank1.log_batch(world.mlflow_run, [], [Param("lr", "0.2")], [])
    rank1.log_batch(world.mlflow_run, [_metric("loss", 1 / 3, 2)], [Param("epochs", "3")], [])
    with caplog.at_level(logging.WARNING, logger="prefect_sgpu.observe.mlflow_relay"):
        world.relay.poll()

    run = world.run()
    assert world.history("loss") == [(0, 1.0), (1, 0.5), (2, 1 / 3)]
    assert run.data.params == {"lr": "0.1", "epochs": "3"}
    assert run.data.tags["phase"] == "train"
    refused = _refusals(caplog)
    assert len(refused) == 3 and all("rank 1" in m for m in refused), refused
    assert "line 2: not a sealed record" in refused[0]
    assert "MLflow refused it" in refused[1] and "MLflow refused it" in refused[2]
    assert all("\x1b" not in m for m in refused), "nothing of the line reaches the log raw"


def test_records_replayed_moved_or_from_another_job_are_refused(world: World,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """Sealed genuine records written again by a store writer: into the same file, into another
    rank's file, from another job of the store, and an earlier gang's after a relaunch. None changes
    the run: the tag stays what the rank set last."""
    rank0 = world.rank(0)
    rank0.log_batch(world.mlflow_run, [], [], [RunTag("phase", "warmup")])
    rank0.log_batch(world.mlflow_run, [], [], [RunTag("phase", "train")])
    first, _second = world.lines(0)
    world.rank(1).log_batch(world.mlflow_run, [_metric("loss", 1.0, 0)], [], [])
    other = world.rank(0, run_id="job-b", key=new_key())  # another job of the same store
    other.log_batch("another-run", [], [], [RunTag("phase", "job-b")])
    from_other_job = world.lines(0, "job-b")[0]
    world.relay.poll()
    assert world.run().data.tags["phase"] == "train"

    attacks = {"written again": (0, first), "moved to rank 1": (1, first), "of another job": (0, from_other_job)}
    with caplog.at_level(logging.WARNING, logger="prefect_sgpu.observe.mlflow_relay"):
        for what, (rank, line) in attacks.items():
            world.plant(rank, line)
            world.relay.poll()
            assert world.run().data.tags["phase"] == "train", what
        # a relaunch: the new gang's files start empty; the old gang's first record is written back
        world.relay.restart()
        JobFolder(world.store, RUN, world.key).reset_for_relaunch(1)
        world.rank(0).log_batch(world.mlflow_run, [_metric("loss", 0.5, 1)], [], [])
        world.plant(0, first)
        world.relay.poll()
    assert world.run().data.tags["phase"] == "train", "an earlier gang's record"
    assert world.history("loss") == [(0, 1.0), (1, 0.5)], "the new gang's own record was replayed"
    refused = _refusals(caplog)
    assert len(refused) == 4, refused
    assert "rank 0" in refused[0] and "already replayed" in refused[0]
    assert "rank 1" in refused[1] and "bound to" in refused[1]
    assert "rank 0" in refused[2] and "signature does not match" in refused[2]
    assert "rank 0" in refused[3] and "already replayed" in refused[3]


def test_a_process_without_the_relay_key_writes_nothing(world: World) -> None:
    """A process that was never given the key (not a rank of this job) has nothing to seal with:
    it writes no record at all, rather than one the driver would have to refuse."""
    world.rank(0)
    world.monkeypatch.delenv(mlflow_relay.KEY_ENV, raising=False)
    store = mlflow_relay.store_builder()
    store.log_batch(world.mlflow_run, [_metric("loss", 1.0, 0)], [], [])
    assert not world.path(0).exists() or world.path(0).read_bytes() == b""
