"""MLflow from remote ranks into the driver's run, whatever the tracking store.

A rank on an EC2 node cannot write into a ``sqlite:///`` file on the driver's disk. When
the driver's tracking URI is a local file (sqlite, ``file:``, a path) and the job runs
remotely, ranks get ``MLFLOW_TRACKING_URI=sgpu-relay:`` instead: an MLflow tracking
store (registered under the ``mlflow.tracking_store`` entry point) that appends each
metric, param and tag to ``metrics/rank-N.jsonl`` in the node's job folder. The node
ships those files with the logs; the driver's :class:`MetricRelay` replays new lines into
the real run with ``MlflowClient.log_batch`` while the job runs and once more at its end.
A tracking server (``http(s)://``, ``databricks``) is passed to ranks unchanged.

The files cross the job store, so whoever can write the store could write them too. Each
line is therefore a record sealed (:func:`prefect_sgpu.protocol.jobfolder.seal`, kind ``metrics``) with
the job's relay key (derived from the job key, in the rank's environment only), bound to the
run and the rank, and numbered per writing process: the driver replays a record only when its
seal is this job's and this rank's and its number is new, so a record that is forged, moved
from another rank's file or job, or written a second time is refused. Ranks may not set
``mlflow.*`` or ``sgpu.*`` tags through the relay (the sweeper acts on ``sgpu.run_id``): the
rank's store drops them, and the driver refuses a record that holds one. A refused record
is refused alone, with one log line naming the rank and why; the rest of its file is replayed.

Artifacts logged by remote ranks need a tracking server or an ``s3://`` artifact
location; the relay carries metrics, params and tags only.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

logger = logging.getLogger("prefect_sgpu.observe.mlflow_relay")

SCHEME = "sgpu-relay"
METRICS = "metrics"  # the job-folder key (jobfolder.METRICS)
LOCAL_SCHEMES = ("sqlite", "file", "")
#: the rank's relay key (hex): set by the rank's own process from the job key, never stored
KEY_ENV = "SGPU_RELAY_KEY"
#: tags only the driver sets: MLflow's own, and the ones the sweeper and the driver act on
RESERVED_TAGS = ("mlflow.", "sgpu.")
#: a line longer than this is not a record the relay store writes (1000 metrics or 100 params
#: of MLflow's largest values fit many times over): refused, not held in memory
MAX_LINE = 4 << 20
#: the most bytes of one relay file read per poll (the rest on the next)
READ_CAP = 8 << 20
#: refusals logged per rank; later ones are counted (``MetricRelay.refused``)
MAX_LOGGED_REFUSALS = 20
#: metrics + params + tags per ``log_batch`` of the driver (MLflow splits further as it needs)
BATCH = 1000


def relays(tracking_uri: str) -> bool:
    """Does a remote rank need the relay to reach ``tracking_uri``? (a file on the driver's disk)"""
    from urllib.parse import urlparse

    if tracking_uri.split(":", 1)[0].lower() == "databricks":
        return False
    return urlparse(tracking_uri).scheme.lower() in LOCAL_SCHEMES


def metrics_key(rank: int) -> str:
    return f"{METRICS}/rank-{rank:05d}.jsonl"


def relay_key(job_key: str) -> str:
    """The key relay records are sealed with: derived from the job key, so it opens nothing else
    (a rank's subprocess that holds it can relay metrics, not seal a result or a stop)."""
    from prefect_sgpu.protocol.jobfolder import derive_key

    return derive_key(job_key, b"prefect-sgpu mlflow relay records")


def arm(job_key: str) -> None:
    """In a rank, before user code runs: give the relay store (this process and its children) the key."""
    if os.environ.get("MLFLOW_TRACKING_URI", "").startswith(f"{SCHEME}:"):
        os.environ[KEY_ENV] = relay_key(job_key)


def reserved(key: str) -> bool:
    return key.lower().startswith(RESERVED_TAGS)


class Record(BaseModel):
    """One relayed ``log_batch`` of a rank: ``w`` names the writing process, ``n`` numbers its records."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    w: str
    n: int
    metrics: list[tuple[str, float, int, int]] = []
    params: list[tuple[str, str]] = []
    tags: list[tuple[str, str]] = []

    @property
    def size(self) -> int:
        return len(self.metrics) + len(self.params) + len(self.tags)


class RecordRefused(Exception):
    """A relay line that is not a record of this job's rank: why, for the log."""


def seal_record(key: str, run_id: str, rank: int, record: Record) -> bytes:
    """One line of a rank's relay file (base64 of the sealed record, then a newline)."""
    from prefect_sgpu.protocol.jobfolder import seal

    body = json.dumps(record.model_dump(), separators=(",", ":")).encode()  # NaN and inf kept as such
    blob = seal(key, "metrics", run_id, body, rank=rank)
    return base64.b64encode(blob) + b"\n"


def open_record(line: bytes, key: str, run_id: str, rank: int) -> Record:
    """The record of one line, or RecordRefused: not sealed with this job's relay key for this
    run and this rank, not a record, or setting a tag only the driver sets."""
    from prefect_sgpu.errors import DocumentRefused
    from prefect_sgpu.protocol.jobfolder import unseal

    try:
        blob = base64.b64decode(line.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise RecordRefused("not a sealed record (unsigned or damaged)") from None
    try:
        body = unseal(blob, key, "metrics", run_id, rank=rank, what=f"MLflow record of rank {rank}")
    except DocumentRefused as exc:
        raise RecordRefused(str(exc)) from None
    try:
        record = Record.model_validate(json.loads(body))
    except (ValueError, ValidationError) as exc:
        raise RecordRefused(f"sealed but not a record ({type(exc).__name__})") from None
    bad = sorted({k for k, _ in record.tags if reserved(k)})
    if bad:
        raise RecordRefused(f"sets tag(s) {', '.join(ascii(k) for k in bad)} that only the driver sets")
    return record


class _Writer:
    """This process's name and record counter: records are numbered in the order they are appended,
    and a forked child (a data loader worker) takes a new name, so no two processes share one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = -1
        self.name = ""
        self.count = 0

    def next(self) -> tuple[str, int]:
        if self.pid != os.getpid():
            self.pid, self.name, self.count = os.getpid(), secrets.token_hex(8), 0
        self.count += 1
        return self.name, self.count


_WRITER = _Writer()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: setattr(_WRITER, "lock", threading.Lock()))


def _store_class() -> Any:
    from mlflow.entities import Run, RunData, RunInfo, RunStatus
    from mlflow.entities.lifecycle_stage import LifecycleStage
    from mlflow.store.tracking.abstract_store import AbstractStore

    class RelayStore(AbstractStore):
        """Appends what a rank logs to its file, each batch one sealed record; reports the driver's run
        as running."""

        def __init__(self, store_uri: str | None = None, artifact_uri: str | None = None) -> None:
            super().__init__()
            job_dir = Path(os.environ.get("SGPU_JOB_DIR", "."))
            self.run_id = Path(os.path.abspath(job_dir)).name  # as the rank's JobFolder names it
            self.rank = int(os.environ.get("RANK", "0"))
            self.key = os.environ.get(KEY_ENV, "")
            self.path = job_dir / metrics_key(self.rank)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._warned: set[str] = set()

        def _warn_once(self, what: str, message: str) -> None:
            if what not in self._warned:
                self._warned.add(what)
                print(f"prefect-sgpu: {message}", file=sys.stderr, flush=True)

        def _append(self, metrics: list[Any], params: list[Any], tags: list[Any]) -> None:
            if not self.key:
                self._warn_once("key", f"{SCHEME}: this process has no relay key ({KEY_ENV}); what it "
                                       "logs to MLflow is dropped")
                return
            with _WRITER.lock:
                name, number = _WRITER.next()
                line = seal_record(self.key, self.run_id, self.rank,
                                   Record(w=name, n=number, metrics=metrics, params=params, tags=tags))
                with open(self.path, "ab") as fh:
                    fh.write(line)

        def get_run(self, run_id: str) -> Any:
            info = RunInfo(run_id=run_id, experiment_id=os.environ.get("MLFLOW_EXPERIMENT_ID", "0"),
                           user_id="", status=RunStatus.to_string(RunStatus.RUNNING),
                           start_time=int(time.time() * 1000), end_time=None,
                           lifecycle_stage=LifecycleStage.ACTIVE, artifact_uri=None)
            return Run(run_info=info, run_data=RunData())

        def update_run_info(self, run_id: str, run_status: Any, end_time: Any, run_name: Any) -> Any:
            return self.get_run(run_id).info  # the driver ends its run; ranks do not

        def log_batch(self, run_id: str, metrics: Any, params: Any, tags: Any) -> None:
            kept = [t for t in tags or () if not reserved(t.key)]
            if len(kept) != len(tags or ()):
                self._warn_once("tags", f"{SCHEME}: ranks may not set mlflow.* or sgpu.* tags; dropped "
                                        f"{', '.join(sorted(ascii(t.key) for t in tags if reserved(t.key)))}")
            if metrics or params or kept:
                self._append([(m.key, m.value, m.timestamp, m.step) for m in metrics or ()],
                             [(p.key, p.value) for p in params or ()], [(t.key, t.value) for t in kept])

        def log_metric(self, run_id: str, metric: Any) -> None:
            self.log_batch(run_id, [metric], [], [])

        def log_param(self, run_id: str, param: Any) -> None:
            self.log_batch(run_id, [], [param], [])

        def set_tag(self, run_id: str, tag: Any) -> None:
            self.log_batch(run_id, [], [], [tag])

        def log_inputs(self, run_id: str, datasets: Any = None, models: Any = None) -> None:
            return None

        def _unsupported(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"{SCHEME}: a remote rank can log metrics, params and tags only")

        create_experiment = get_experiment = delete_experiment = restore_experiment = _unsupported
        rename_experiment = create_run = delete_run = restore_run = get_metric_history = _unsupported
        search_experiments = _search_runs = _unsupported

    return RelayStore


def store_builder(store_uri: str | None = None, artifact_uri: str | None = None) -> Any:
    """The ``mlflow.tracking_store`` entry point for ``sgpu-relay:``."""
    return _store_class()(store_uri, artifact_uri)


def _rank_of(key: str) -> int | None:
    """The rank a relay file is named for (``metrics/rank-00003.jsonl``), None for any other name."""
    name = key.rsplit("/", 1)[-1]
    digits = name[len("rank-"):-len(".jsonl")]
    if name.startswith("rank-") and name.endswith(".jsonl") and digits.isdigit() and digits.isascii():
        return int(digits)
    return None


class MetricRelay:
    """Replays the sealed relay records of a job's ranks into its MLflow run, each record once."""

    def __init__(self, store: Any, run_id: str, tracking_uri: str, mlflow_run_id: str, job_key: str) -> None:
        self.store = store
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.mlflow_run_id = mlflow_run_id
        self._key = relay_key(job_key)
        self._offsets: dict[str, int] = {}
        self._partial: dict[str, bytes] = {}
        self._lines: dict[str, int] = {}
        #: the last record number replayed of each writer of each rank; kept across gangs, so an
        #: earlier gang's records written back after a relaunch are refused as replays
        self._last: dict[tuple[int, str], int] = {}
        self._refusals: dict[int, int] = {}
        self._polled = 0.0
        self.replayed = 0
        self.refused = 0

    def poll(self, every: float = 0.0) -> None:
        """Replay what is new (at most once per ``every`` seconds); never raises."""
        now = time.monotonic()
        if now - self._polled < every:
            return
        self._polled = now
        try:
            while self._poll() and not every:  # a last poll reads every file to its end, a bounded read at a time
                pass
        except Exception:  # noqa: BLE001 - metrics must not fail the job; the files stay in the store
            logger.warning("could not relay rank metrics of job %s", self.run_id, exc_info=True)

    def _poll(self) -> bool:
        """One pass over the relay files; True when some file holds more than was read."""
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.tracking_uri)
        more = False
        for key, listed in sorted(self.store.listing(self.run_id, METRICS).items()):
            rank = _rank_of(key)
            if rank is None:
                if key not in self._offsets:
                    self._offsets[key] = 0
                    self._refuse(-1, f"{ascii(key)} is not a rank's relay file: not read")
                continue
            # one listing for every rank's file, then a bounded ranged read of what grew
            if listed.size <= self._offsets.get(key, 0):
                continue
            data = self.store.read_range(self.run_id, listed, self._offsets.get(key, 0), READ_CAP)
            if not data:
                continue
            self._offsets[key] = self._offsets.get(key, 0) + len(data)
            more |= listed.size > self._offsets[key]
            *lines, rest = (self._partial.get(key, b"") + data).split(b"\n")
            if len(rest) > MAX_LINE:
                self._refuse(rank, f"a line of {len(rest)} bytes with no end: dropped")
                rest = b""
            self._partial[key] = rest
            records = []
            for raw in lines:
                self._lines[key] = number = self._lines.get(key, 0) + 1
                if not raw.strip():
                    continue
                try:
                    records.append(self._accept(raw, rank))
                except RecordRefused as exc:
                    self._refuse(rank, f"line {number}: {exc}")
            self._replay(client, rank, records)
        return more

    def _accept(self, raw: bytes, rank: int) -> Record:
        if len(raw) > MAX_LINE:
            raise RecordRefused(f"{len(raw)} bytes, more than any record")
        record = open_record(raw, self._key, self.run_id, rank)
        last = self._last.get((rank, record.w), 0)
        if record.n <= last:
            raise RecordRefused(f"record {record.n} of its writer was already replayed (written again)")
        self._last[(rank, record.w)] = record.n
        return record

    def _replay(self, client: Any, rank: int, records: list[Record]) -> None:
        batch: list[Record] = []
        for record in records:
            if batch and sum(r.size for r in batch) + record.size > BATCH:
                self._log(client, rank, batch)
                batch = []
            batch.append(record)
        if batch:
            self._log(client, rank, batch)

    def _log(self, client: Any, rank: int, batch: list[Record]) -> None:
        """One ``log_batch``; when MLflow refuses it, each record on its own, so one bad record
        (a key MLflow rejects, a param changed) is refused alone."""
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.exceptions import MlflowException

        try:
            client.log_batch(self.mlflow_run_id, metrics=[Metric(*m) for r in batch for m in r.metrics],
                             params=[Param(*p) for r in batch for p in r.params],
                             tags=[RunTag(*t) for r in batch for t in r.tags])
        except MlflowException as exc:
            if len(batch) > 1:
                for record in batch:
                    self._log(client, rank, [record])
                return
            message = str(getattr(exc, "message", exc))[:300]
            self._refuse(rank, f"record {batch[0].n} of its writer: MLflow refused it: {ascii(message)}")
            return
        self.replayed += sum(len(r.metrics) for r in batch)

    def _refuse(self, rank: int, why: str) -> None:
        self.refused += 1
        count = self._refusals[rank] = self._refusals.get(rank, 0) + 1
        who = f"rank {rank}" if rank >= 0 else "a file"
        if count <= MAX_LOGGED_REFUSALS:
            logger.warning("MLflow relay of job %s: a record of %s was refused: %s", self.run_id, who, why)
        if count == MAX_LOGGED_REFUSALS:
            logger.warning("MLflow relay of job %s: further refusals of %s are counted, not logged",
                           self.run_id, who)

    def restart(self) -> None:
        """A new gang writes new files under the same names: read them from their start."""
        self.poll()
        self._offsets.clear()
        self._partial.clear()
        self._lines.clear()
