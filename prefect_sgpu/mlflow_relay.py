"""MLflow from remote ranks into the driver's run, whatever the tracking store.

A rank on an EC2 node cannot write into a ``sqlite:///`` file on the driver's disk. When
the driver's tracking URI is a local file (sqlite, ``file:``, a path) and the job runs
remotely, ranks get ``MLFLOW_TRACKING_URI=sgpu-relay:`` instead: an MLflow tracking
store (registered under the ``mlflow.tracking_store`` entry point) that appends each
metric, param and tag to ``metrics/rank-N.jsonl`` in the node's job folder. The node
ships those files with the logs; the driver's :class:`MetricRelay` replays new lines into
the real run with ``MlflowClient.log_batch`` while the job runs and once more at its end.
A tracking server (``http(s)://``, ``databricks``) is passed to ranks unchanged.

Artifacts logged by remote ranks need a tracking server or an ``s3://`` artifact
location; the relay carries metrics, params and tags only.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("prefect_sgpu.mlflow_relay")

SCHEME = "sgpu-relay"
METRICS = "metrics"  # the job-folder key (jobfolder.METRICS)
LOCAL_SCHEMES = ("sqlite", "file", "")


def relays(tracking_uri: str) -> bool:
    """Does a remote rank need the relay to reach ``tracking_uri``? (a file on the driver's disk)"""
    from urllib.parse import urlparse

    if tracking_uri.split(":", 1)[0].lower() == "databricks":
        return False
    return urlparse(tracking_uri).scheme.lower() in LOCAL_SCHEMES


def metrics_key(rank: int) -> str:
    return f"{METRICS}/rank-{rank:05d}.jsonl"


def _store_class() -> Any:
    from mlflow.entities import Run, RunData, RunInfo, RunStatus
    from mlflow.entities.lifecycle_stage import LifecycleStage
    from mlflow.store.tracking.abstract_store import AbstractStore

    class RelayStore(AbstractStore):
        """Appends what a rank logs to its JSONL file; reports the driver's run as running."""

        def __init__(self, store_uri: str | None = None, artifact_uri: str | None = None) -> None:
            super().__init__()
            job_dir = Path(os.environ.get("SGPU_JOB_DIR", "."))
            rank = int(os.environ.get("RANK", "0"))
            self.path = job_dir / metrics_key(rank)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock = threading.Lock()

        def _append(self, record: dict[str, Any]) -> None:
            line = json.dumps(record, separators=(",", ":")) + "\n"
            with self._lock, open(self.path, "a", encoding="utf-8") as fh:
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
            record: dict[str, Any] = {}
            if metrics:
                record["metrics"] = [[m.key, m.value, m.timestamp, m.step] for m in metrics]
            if params:
                record["params"] = [[p.key, p.value] for p in params]
            if tags:
                record["tags"] = [[t.key, t.value] for t in tags]
            if record:
                self._append(record)

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


class MetricRelay:
    """Replays the relay files of a job's ranks into its MLflow run, each line once."""

    def __init__(self, store: Any, run_id: str, tracking_uri: str, mlflow_run_id: str) -> None:
        self.store = store
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.mlflow_run_id = mlflow_run_id
        self._offsets: dict[str, int] = {}
        self._partial: dict[str, bytes] = {}
        self._polled = 0.0
        self.replayed = 0

    def poll(self, every: float = 0.0) -> None:
        """Replay what is new (at most once per ``every`` seconds); never raises."""
        now = time.monotonic()
        if now - self._polled < every:
            return
        self._polled = now
        try:
            self._poll()
        except Exception:  # noqa: BLE001 - metrics must not fail the job; the files stay in the store
            logger.warning("could not relay rank metrics of job %s", self.run_id, exc_info=True)

    def _poll(self) -> None:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.tracking_uri)
        for key in self.store.list(self.run_id, METRICS):
            data = self.store.read_from(self.run_id, key, self._offsets.get(key, 0))
            if not data:
                continue
            self._offsets[key] = self._offsets.get(key, 0) + len(data)
            *lines, rest = (self._partial.get(key, b"") + data).split(b"\n")
            self._partial[key] = rest
            metrics, params, tags = [], [], []
            for raw in lines:
                record = json.loads(raw)
                metrics += [Metric(k, v, t, s) for k, v, t, s in record.get("metrics", [])]
                params += [Param(k, v) for k, v in record.get("params", [])]
                tags += [RunTag(k, v) for k, v in record.get("tags", [])]
            for start in range(0, max(len(metrics), len(params), len(tags)), 100):
                client.log_batch(self.mlflow_run_id, metrics=metrics[start:start + 100],
                                 params=params[start:start + 100], tags=tags[start:start + 100])
            self.replayed += len(metrics)

    def restart(self) -> None:
        """A new gang writes new files under the same names: read them from their start."""
        self.poll()
        self._offsets.clear()
        self._partial.clear()
