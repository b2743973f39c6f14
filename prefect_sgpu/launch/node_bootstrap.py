"""One remote node's life over the store: the bridge between the store and the node agent.

:class:`NodeBootstrap` is the protocol over the store; what it asks of the cloud (who am I, read a
secret, is a reclaim notice out, end this machine) goes through a node host
(:mod:`prefect_sgpu.launch.node_host`). Its parts, each a mixin of its own:

- this module: the job key (read from the secret whose name the node derives from its run id, never
  from a document), the folders it serves, and the whole life (:meth:`NodeBootstrap.run`);
- :mod:`prefect_sgpu.launch.node_job`: one job, from its verified launch to its reported end;
- :mod:`prefect_sgpu.launch.node_sync`: what the node ships to the store while the job runs;
- :mod:`prefect_sgpu.launch.node_liveness`: the alive documents, the driver's heartbeat, reclaim
  notices and the node's own end (the heartbeat rule);
- :mod:`prefect_sgpu.launch.lease_node`: a warm lease's jobs, one after another.

The command line that starts it on a machine is :mod:`prefect_sgpu.launch.bootstrap`.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from prefect_sgpu.errors import DocumentRefused
from prefect_sgpu.protocol import node_requests
from prefect_sgpu.protocol.jobfolder import JobFolder, ssm_key_parameter
from prefect_sgpu.launch.job_cgroup import JobCgroup
from prefect_sgpu.launch.lease_node import LeaseServing
from prefect_sgpu.launch.node_env import READY_AT_ENV
from prefect_sgpu.launch.node_host import DEFAULT_HOST, NodeHost, NodeIdentity, open_host
from prefect_sgpu.launch.node_job import JobServing
from prefect_sgpu.launch.node_liveness import NodeLiveness
from prefect_sgpu.launch.node_sync import NodeSync
from prefect_sgpu.procs.processes import node_log as _log


class NodeBootstrap(JobServing, NodeSync, NodeLiveness, LeaseServing):
    """One node's life: read the key, announce, wait for a verified launch, run the agent, sync, clean up."""

    def __init__(
        self,
        store: Any,
        run_id: str,
        identity: NodeIdentity,
        node_dir: Path,
        heartbeat_ttl: float,
        region: str | None = None,
        endpoint_url: str | None = None,
        interval: float = 1.0,
        grace: float = 10.0,
        key: str | None = None,
        lease: bool = False,
        key_wait: float = 60.0,
        host: NodeHost | None = None,
        gang: int = 0,
        node_index: int | None = None,
    ) -> None:
        """``host``: the cloud as this node sees it (default: the node host named
        :data:`~prefect_sgpu.launch.node_host.DEFAULT_HOST`, opened with ``region`` and ``endpoint_url``). ``gang``: which gang of its job a cold node serves (its
        boot arguments say; a lease's node learns each job's from its assignment). ``node_index``: the
        node it replaces, for a machine launched alone in place of a lost one (else its launch index)."""
        if host is None:
            host = open_host(DEFAULT_HOST, region=region, endpoint_url=endpoint_url)
        self.host = host
        self.store = store
        self.run_id = run_id
        self.identity = identity
        self.index = identity.launch_index if node_index is None else node_index
        self.node_dir = node_dir
        self.job_dir = node_dir / run_id
        #: this instance serves a warm lease (``run_id`` is the lease's id until a job is assigned)
        self.lease = lease
        self.lease_id: str | None = run_id if lease else None
        #: the gang of the job this node serves: the only one whose stop it obeys (a lease's own folder: 0)
        self.gang = 0 if lease else gang
        #: how long an assigned job's key may take to appear in SSM (the driver writes it first)
        self.key_wait = key_wait
        self._assigned = -1
        self._beat_seqs: dict[str, int] = {}
        self._resident: set[int] = set()
        #: a lease's warm node process (torch imported), from which each job's agent is forked
        self.warm: Any = None
        self.heartbeat_ttl = heartbeat_ttl
        self.interval = interval
        self.grace = grace
        self.phase = "waiting"
        #: when this machine's environment was ready: the stage's end, else now (the alive documents say it)
        self.ready_at = float(os.environ.pop(READY_AT_ENV, "") or 0) or time.time()
        #: what the first stage sent to S3 before this process existed, reported with the first job's requests
        self._stage_requests = node_requests.parse_counts(os.environ.pop(node_requests.STAGE_ENV, ""))
        self.key: str | None = None
        self.folder: JobFolder | None = None
        self.local: JobFolder | None = None
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._progress_sent = 0.0
        #: growing files shipped as appended pieces: key -> (local path, bytes shipped so far)
        self._appended: dict[str, tuple[Path, int]] = {}
        #: when each rank log last shipped a piece (monotonic seconds): log appends are coalesced
        self._log_shipped: dict[str, float] = {}
        self._beat_seq = -1
        self._beat_seen = time.monotonic()
        self._alive_seq = 0
        self._alive_at = 0.0
        #: held while an alive document is written and while the folder it goes to changes
        self._alive_lock = threading.RLock()
        #: this folder got the node's status: no alive document goes there any more
        self._alive_quiet = False
        self._alive_thread: threading.Thread | None = None
        #: the job's node agent: a process of its own, or a ForkedAgent of the lease's warm node
        self._agent: Any = None
        #: the running job's own temp and cache folder (:meth:`job_scratch`), deleted when the job ends
        self.scratch: Path | None = None
        #: the running job's cgroup (:mod:`prefect_sgpu.launch.job_cgroup`); None where the node cannot make one
        self.cgroup: JobCgroup | None = None
        self._cgroup_refused = False
        #: why this machine may serve no later job (a job's cgroup it could not empty): said in every
        #: status it writes from then on; a lease's node takes no further assignment
        self.unfit: str | None = None
        #: where those folders are made: this process's temp folder, never a job's
        self.temp_root = tempfile.gettempdir()
        self._error_logged = 0.0
        self._refusals: set[str] = set()
        self.notice: str | None = None
        self._notice_published = False
        #: the host's rebalance recommendation, once it gave one (a warning, not a reclaim)
        self.rebalance: str | None = None
        self._rebalance_published = False
        self.terminated = False
        if key is not None:
            self.use_key(key)

    def use_key(self, key: str) -> None:
        """From now on every document is read and written sealed with ``key`` (the stop: for :attr:`gang`)."""
        with self._alive_lock:
            self.key = key
            self.folder = JobFolder(self.store, self.run_id, key)
            self.folder.gang = self.gang
            self.local = JobFolder.local(self.job_dir, key)
            self._alive_quiet = False

    def enter(self, run_id: str, key: str, gang: int = 0) -> None:
        """Serve ``run_id``'s folder (gang ``gang`` of that job) from now on (a warm lease's node moving
        between the lease and a job): nothing of the folder it leaves carries over but each folder's
        heartbeat sequence."""
        with self._alive_lock:  # the alive thread writes to the folder left or to the new one, never between
            self._enter(run_id, key, gang)

    def _enter(self, run_id: str, key: str, gang: int) -> None:
        self._beat_seqs[self.run_id] = self._beat_seq
        self.run_id = run_id
        self.gang = gang
        self.job_dir = self.node_dir / run_id
        self.job_dir.mkdir(parents=True, exist_ok=True)
        self.use_key(key)
        self._beat_seq = self._beat_seqs.get(run_id, -1)
        self._beat_seen = time.monotonic()
        self._uploaded, self._appended, self._log_shipped = {}, {}, {}
        self._requests_base = self.store.request_counts()
        self._agent = None
        self._notice_published = False
        self._rebalance_published = False

    def read_key(self, run_id: str | None = None, wait: float | None = None) -> str | None:
        """The job key from its secret (SSM on EC2), under the name this node derives from a run id (its own, or an
        assigned job's): never from a document.

        The driver writes it before launching, so it is normally there at once; a read
        that keeps failing for a whole heartbeat TTL means the driver is gone (None).
        """
        name = ssm_key_parameter(run_id or self.run_id, self.store.scope)
        if wait is None:
            wait = self.heartbeat_ttl if self.heartbeat_ttl > 0 else 900.0
        deadline = time.monotonic() + wait
        while True:
            try:
                return self.host.read_secret(name)
            except Exception as exc:  # noqa: BLE001 - not there yet, or unreachable for a while
                if time.monotonic() > deadline:
                    _log(f"no job key in secret {name} after {self.heartbeat_ttl:g}s: {self.host.error_text(exc)}")
                    return None
                self._store_error(f"reading the job key from secret {name}", exc)
            time.sleep(self.interval)

    def read_doc(self, what: str, read: Any) -> Any:
        """``read()``: a document the driver wrote, or None; one that is not the driver's is refused (logged
        once) and a store error logged, both read as None: the caller's loop asks again."""
        try:
            return read()
        except DocumentRefused as exc:
            self._refused(exc)
        except Exception as exc:  # noqa: BLE001
            self._store_error(f"reading {what}", exc)
        return None

    def _refused(self, exc: Exception) -> None:
        """A document that is not the driver's: say so once, act as if it were absent."""
        text = str(exc)
        if text not in self._refusals:
            self._refusals.add(text)
            _log(f"ignoring a document that is not this job's driver's, still waiting: {text}")

    def _store_error(self, what: str, exc: Exception) -> None:
        """Store calls in the loop may fail for a while (botocore already retried): try again next
        tick. The heartbeat TTL bounds how long: a driver unreachable that long counts as gone."""
        now = time.monotonic()
        if now - self._error_logged > 30.0:
            self._error_logged = now
            _log(f"{what} failed, retrying: {type(exc).__name__}: {exc}")

    def run(self) -> int:
        me = self.identity
        what = "lease" if self.lease else "job"
        _log(f"node {self.index} ({me.instance_id}, {me.private_ip}) of {what} {self.run_id}")
        if self.key is None:
            key = self.read_key()
            if key is None:
                return self.terminate_self(f"the {what} key never appeared")
            self.use_key(key)
        self.job_dir.mkdir(parents=True, exist_ok=True)
        self.start_alive()
        if self.lease:
            return self.serve_lease()
        while True:
            try:
                code = self.serve_job()
            finally:
                self.drop_scratch()
            if code is not None:
                return code
            rejoin = self.watch_until_gone()
            if isinstance(rejoin, int):
                return rejoin
            self.rejoin(rejoin)
