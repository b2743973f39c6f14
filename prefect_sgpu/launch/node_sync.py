"""What a node ships to the store while its job runs, and its outcome when the job ends.

A mixin of :class:`prefect_sgpu.launch.node_bootstrap.NodeBootstrap`. Rank logs, metric files and
the agent's output grow while the job runs: each tick ships only what they gained since the last
(``Store.append``: re-uploading a growing log whole ships its size on every tick), and each is
written whole once at the end. Result envelopes (sealed by their ranks) are uploaded once, after
their logs; the ranks' step files feed the driver's progress report and straggler watch. Last, the
agent's status is re-sealed bound to this instance: the driver reads results once it sees it.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

from prefect_sgpu.protocol import node_requests
from prefect_sgpu.protocol.jobfolder import HEARTBEAT_STOP, LOGS, RESULTS, NodeStatus, agent_output_key
from prefect_sgpu.observe.mlflow_relay import METRICS
from prefect_sgpu import retry
from prefect_sgpu.runtime import PREEMPT_FILE, PROGRESS_DIR

#: seconds between uploads of the other ranks' steps (rank 0's follows every sync): what the driver's
#: straggler watch reads; the ranks' own times are in the files, so a late upload skews no rate
PROGRESS_UPLOAD_S = 3.0
#: a rank log's new bytes ship when this many seconds passed since its last piece ...
LOG_COALESCE_S = 5.0
#: ... or when this many bytes wait, and always at the end: a rank printing a line a second costs
#: a PUT (and the driver a GET) every few seconds, not every second
LOG_COALESCE_BYTES = 32 * 1024


class NodeSync:
    """Uploads of a running job's output, and the node's final status."""

    store: Any
    run_id: str
    index: int
    identity: Any
    job_dir: Path
    interval: float
    folder: Any
    local: Any
    _uploaded: dict[str, tuple[int, int]]
    _appended: dict[str, tuple[Path, int]]
    _log_shipped: dict[str, float]
    _progress_sent: float
    unfit: str | None
    _alive_lock: Any
    _alive_quiet: bool
    _store_error: Any
    quiet: Any
    watch_notices: Any
    publish_notice: Any
    heartbeat_stale: Any
    key: Any
    gang: int
    #: the store's request counts when this node entered the job's folder (a lease's node serves many jobs)
    _requests_base: dict[str, int] = {}
    #: the first stage's own requests (environment fetched before this process existed): the first job's
    _stage_requests: dict[str, int] = {}

    def _upload_if_changed(self, path: Path, key: str) -> None:
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        mark = (st.st_size, st.st_mtime_ns)
        if self._uploaded.get(key) == mark:
            return
        self.store.put(self.run_id, key, path.read_bytes())
        self._uploaded[key] = mark

    def _append_new_bytes(self, path: Path, key: str, coalesce: bool = False) -> None:
        """Ship what ``path`` (a file that only grows) gained since the last call, as one appended piece.
        ``coalesce``: wait until :data:`LOG_COALESCE_S` passed since the last piece or
        :data:`LOG_COALESCE_BYTES` wait (a log's first bytes go at once)."""
        _, sent = self._appended.get(key, (path, 0))
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return
        if size < sent:  # replaced by a shorter file: start it again
            self.store.delete(self.run_id, key)
            sent = 0
        if size == sent:
            self._appended[key] = (path, sent)
            return
        now = retry.CLOCK.monotonic()
        if (coalesce and sent and size - sent < LOG_COALESCE_BYTES
                and now - self._log_shipped.get(key, 0.0) < LOG_COALESCE_S):
            self._appended[key] = (path, sent)
            return
        with open(path, "rb") as fh:
            fh.seek(sent)
            data = fh.read(size - sent)
        self.store.append(self.run_id, key, sent, data)
        self._appended[key] = (path, sent + len(data))
        self._log_shipped[key] = now

    def seal_appended(self) -> None:
        """Every growing file written whole, once, and its pieces dropped: at most twice its size shipped."""
        for key, (path, _sent) in sorted(self._appended.items()):
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            self.store.seal_appended(self.run_id, key, data)
            self._appended[key] = (path, len(data))

    def sync_up(self, final: bool = False) -> None:
        """Logs first, then envelopes (sealed by their ranks): a reader that sees an envelope sees its log.

        Logs, metrics and the agent's output grow while the job runs: each sync ships only their
        new bytes (:meth:`Store.append`); results are written once, whole."""
        # a node told it will be reclaimed ships every line at once: it may not get another sync
        coalesce = not final and not (self.job_dir / PREEMPT_FILE).exists()
        for kind, pattern in ((LOGS, "rank-*.log"), (METRICS, "rank-*.jsonl")):
            folder = self.job_dir / kind
            if folder.is_dir():
                for path in sorted(folder.glob(pattern)):
                    self._append_new_bytes(path, f"{kind}/{path.name}", coalesce=coalesce and kind == LOGS)
        folder = self.job_dir / RESULTS
        if folder.is_dir():
            for path in sorted(folder.glob("rank-*.bin")):
                self._upload_if_changed(path, f"{RESULTS}/{path.name}")
        self._append_new_bytes(self.job_dir / agent_output_key(self.index), agent_output_key(self.index))
        # each rank's step (a few bytes): rank 0's is what the driver's progress report follows,
        # every rank's what its straggler watch reads
        folder = self.job_dir / PROGRESS_DIR
        every_rank = time.monotonic() - self._progress_sent >= PROGRESS_UPLOAD_S or final
        if every_rank:
            self._progress_sent = time.monotonic()
        if folder.is_dir():
            for path in sorted(folder.glob("rank-*")):
                if path.name == "rank-0" or (every_rank and path.name[len("rank-"):].isdigit()):
                    self._upload_if_changed(path, f"{PROGRESS_DIR}/{path.name}")

    def finish(self, code: int | None, reason: str | None = None) -> None:
        """Final sync, then the node's status, re-sealed bound to this instance (last: the driver
        reads results once it sees it)."""
        assert self.folder is not None and self.local is not None
        self.sync_up(final=True)
        self.seal_appended()
        status = self.local.status(self.index) if (self.job_dir / "nodes").is_dir() else None
        if status is None:
            status = NodeStatus(node=self.index, host=socket.gethostname(), exit_code=code or 1,
                                error=reason or f"node agent exited with code {code} and no status")
        if reason and reason.startswith(HEARTBEAT_STOP) and not (status.stopped or "").startswith(HEARTBEAT_STOP):
            status = status.model_copy(update={"stopped": reason})  # why this node stopped its agent
        if self.unfit:  # the driver gives no later job to this machine
            status = status.model_copy(update={"unfit": self.unfit})
        self.quiet()  # after its status a node writes nothing more to the folder
        self.put_requests()
        try:
            self.folder.put_status(self.index, status, instance_id=self.identity.instance_id)
        except BaseException:
            with self._alive_lock:  # not written: the node still lives, and says so, while it retries
                self._alive_quiet = False
            raise

    def put_requests(self) -> None:
        """This node's requests to the job store during the job, by kind, for the job's cost
        (:mod:`prefect_sgpu.protocol.node_requests`), written just before its status, with what its ranks'
        own stores and (for the first job of a boot) its first stage sent. A store that counts none (a
        folder) writes nothing; a failed write leaves the figure not reported."""
        base = self._requests_base
        mine = {k: n - base.get(k, 0) for k, n in self.store.request_counts().items() if n > base.get(k, 0)}
        if not mine:
            return
        mine["PUT"] = mine.get("PUT", 0) + 2  # this document and the status that follows it
        # the ranks' own stores (checkpoints, shard sets) and, for the first job of this boot, the stage's
        mine = node_requests.added(mine, node_requests.read_ranks(self.job_dir), self._stage_requests)
        self._stage_requests = {}
        try:
            node_requests.write(self.store, self.run_id, self.key, self.index, mine,
                                instance_id=self.identity.instance_id, gang=self.gang)
        except Exception as exc:  # noqa: BLE001 - a cost figure missing, the job's outcome unchanged
            self._store_error("uploading the node's request counts", exc)

    def sync_quietly(self) -> None:
        """One tick's uploads (logs, envelopes); a failure waits for the next tick. The alive
        documents go on meanwhile (:meth:`start_alive`): a slow upload delays only this loop."""
        self.watch_notices()
        self.publish_notice()
        try:
            self.sync_up()
        except Exception as exc:  # noqa: BLE001
            self._store_error("uploading logs and results", exc)

    def finish_reliably(self, code: int | None, reason: str | None = None) -> bool:
        """The node's outcome must reach the driver: retry until it does or the driver is gone."""
        while True:
            try:
                self.finish(code, reason)
                return True
            except Exception as exc:  # noqa: BLE001
                self._store_error("uploading the node's outcome", exc)
            if self.heartbeat_stale():
                return False
            time.sleep(self.interval)
