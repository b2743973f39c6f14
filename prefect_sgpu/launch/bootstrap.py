"""What a remote node runs at boot: the bridge between the store and the node agent.

Everything here is the protocol over the store; what it asks of the cloud (who am I, read
a secret, is a reclaim notice out, end this machine) goes through a node host
(:mod:`prefect_sgpu.launch.node_host`). On EC2 (:mod:`prefect_sgpu.launch.ec2_host`) the
instance's user-data is a few lines of shell that start this program; it holds
no credentials (the instance profile grants S3, SSM and ``ec2:TerminateInstances``
on itself) and no key. The program:

1. learns who it is from its node host (on EC2, IMDSv2: instance id, AMI launch index =
   node index, private IP);
2. reads the job key from the secret whose name it derives from its own ``--run-id``
   (:func:`prefect_sgpu.jobfolder.ssm_key_parameter`; never from a document), waiting for it
   at most ``--heartbeat-ttl`` seconds;
3. announces itself (a sealed ``nodes/node-<i>.alive``, refreshed while it lives by a thread of
   its own, so that no upload, however slow, holds it back past the driver's ``node_silence_s``;
   silent in a folder once it wrote its status there) and waits for its launch document,
   written by the driver once every node is up. Only a document sealed with the job key
   *and bound to this node index and this instance id* is run; anything else (unsigned,
   another job's, node 1's copied to node 0's key, bound to no instance) is refused with a
   log line and waited past: whoever can write the store can delay a node, never run code on it;
4. copies the payload into a local job folder (the ranks verify it) and runs the
   node agent against that folder, with the job key in its environment;
5. in a loop, ships what rank logs, metric files and its agent's output gained since the
   last tick as appended pieces (``Store.append``: re-uploading a growing log whole ships its
   size on every tick), writes each whole once at the end, uploads sealed result envelopes, copies the driver's sealed heartbeat
   down verbatim (the agent verifies it too), and finally re-seals the agent's status
   bound to this instance;
6. watches the host for a reclaim notice (on EC2 a spot interruption or a rebalance
   recommendation): it tells the ranks (the ``preempt`` file ``runtime.preemption_requested()``
   reads; a ``Checkpointer`` saves at once) and the driver (a sealed ``nodes/node-<i>.notice``),
   which relaunches the job on new capacity once this node is gone;
7. obeys a sealed ``stop`` from the driver for its own gang (``--gang``: the relaunch it
   belongs to; a lost gang's stop written back after a relaunch is refused), and when no *new*
   heartbeat (a higher sequence number under a valid seal) has arrived for ``--heartbeat-ttl``
   seconds (the driver died) stops the agent and terminates its own instance, so a dead driver
   cannot leak paid VMs. Staleness is measured on this node's monotonic clock: clock skew
   does not matter, and a forged or replayed heartbeat keeps nothing alive.

With ``--lease`` the machine serves a warm lease's jobs one after another
(:mod:`prefect_sgpu.launch.lease_node`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from prefect_sgpu.errors import DocumentRefused
from prefect_sgpu.jobfolder import (HEARTBEAT, HEARTBEAT_STOP, LOGS, PAYLOAD, RESULTS, Alive, JobFolder,
                                    LaunchDocument, NodeStatus, Notice, Rejoin, agent_output_key, ssm_key_parameter,
                                    ssm_secrets_parameter, unseal)
from prefect_sgpu.launch.job_cgroup import JobCgroup
from prefect_sgpu.launch.node_host import NodeHost, NodeIdentity
from prefect_sgpu.launch.lease_node import ForkedAgent, LeaseServing
from prefect_sgpu.launch.processes import kill_and_reap, node_log as _log
from prefect_sgpu.mlflow_relay import METRICS
from prefect_sgpu.runtime import PROGRESS_DIR
from prefect_sgpu.versions import runtime_versions

NODE_DIR_ENV = "PREFECT_SGPU_NODE_DIR"
KEY_ENV = "SGPU_PAYLOAD_KEY"
#: seconds between uploads of the other ranks' steps (rank 0's follows every sync): what the driver's
#: straggler watch reads; the ranks' own times are in the files, so a late upload skews no rate
PROGRESS_UPLOAD_S = 3.0


# --- the node ------------------------------------------------------------------------


class NodeBootstrap(LeaseServing):
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
        """``host``: the cloud as this node sees it (default: EC2, :mod:`prefect_sgpu.launch.ec2_host`,
        with ``region`` and ``endpoint_url``). ``gang``: which gang of its job a cold node serves (its
        boot arguments say; a lease's node learns each job's from its assignment). ``node_index``: the
        node it replaces, for a machine launched alone in place of a lost one (else its launch index)."""
        if host is None:
            from prefect_sgpu.launch.ec2_host import EC2NodeHost

            host = EC2NodeHost(region, endpoint_url)
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
        self.key: str | None = None
        self.folder: JobFolder | None = None
        self.local: JobFolder | None = None
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._progress_sent = 0.0
        #: growing files shipped as appended pieces: key -> (local path, bytes shipped so far)
        self._appended: dict[str, tuple[Path, int]] = {}
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
        #: where those folders are made: this process's temp folder, never a job's
        self.temp_root = tempfile.gettempdir()
        self._error_logged = 0.0
        self._refusals: set[str] = set()
        self.notice: str | None = None
        self._notice_published = False
        self.terminated = False
        if key is not None:
            self.use_key(key)

    # -- the key and the folders ------------------------------------------------------

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
        self._uploaded, self._appended = {}, {}
        self._agent = None
        self._notice_published = False

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

    # -- store helpers ----------------------------------------------------------

    @property
    def alive_period(self) -> float:
        """Seconds between alive documents."""
        return max(self.interval * 2, 1.0)

    def publish_alive(self, force: bool = False) -> None:
        with self._alive_lock:
            assert self.folder is not None
            now = time.monotonic()
            if not force and now - self._alive_at < self.alive_period:
                return
            self._alive_at = now
            self._alive_seq += 1
            doc = Alive(phase=self.phase, seq=self._alive_seq, time=time.time(), host=socket.gethostname(),
                        versions=runtime_versions())
            self.folder.put_alive(self.index, doc, instance_id=self.identity.instance_id)

    def start_alive(self) -> None:
        """The alive documents from now on, every :attr:`alive_period`, on a thread of their own: the
        loop's uploads (logs, results, the final sync) may take as long as the store makes them,
        and a node that keeps beating is never taken for lost because of them."""
        if self._alive_thread is None:
            self._alive_thread = threading.Thread(target=self._beat_alive, name="sgpu-node-alive", daemon=True)
            self._alive_thread.start()

    def _beat_alive(self) -> None:
        while True:
            time.sleep(min(self.alive_period, 1.0) / 2)
            with self._alive_lock:
                if self._alive_quiet or self.folder is None:
                    continue
                try:
                    self.publish_alive()
                except Exception as exc:  # noqa: BLE001 - the next beat tries again
                    self._store_error("publishing the node's alive document", exc)

    def quiet(self) -> None:
        """No more alive documents in this folder (the node's status is going there, or the job is
        over): once an alive being written is done, none follows."""
        with self._alive_lock:
            self._alive_quiet = True

    def _store_error(self, what: str, exc: Exception) -> None:
        """Store calls in the loop may fail for a while (botocore already retried): try again next
        tick. The heartbeat TTL bounds how long: a driver unreachable that long counts as gone."""
        now = time.monotonic()
        if now - self._error_logged > 30.0:
            self._error_logged = now
            _log(f"{what} failed, retrying: {type(exc).__name__}: {exc}")

    def heartbeat_stale(self) -> bool:
        """Has no new sealed driver heartbeat arrived for ``heartbeat_ttl`` seconds (node clock)?

        A new one (higher sequence number, valid seal) is copied down verbatim, so the
        agent's own watch verifies the very same document.
        """
        from prefect_sgpu.jobfolder import Heartbeat
        from prefect_sgpu.store import atomic_write

        assert self.key is not None
        blob = None
        try:
            blob = self.store.get(self.run_id, HEARTBEAT)
        except Exception as exc:  # noqa: BLE001 - no news is not a change
            self._store_error("reading the driver's heartbeat", exc)
        now = time.monotonic()
        if blob is not None:
            try:
                beat = Heartbeat.model_validate_json(unseal(blob, self.key, "heartbeat", self.run_id, what=HEARTBEAT))
            except (DocumentRefused, ValueError) as exc:
                self._refused(exc)
                beat = None
            if beat is not None and beat.seq > self._beat_seq:
                self._beat_seq, self._beat_seen = beat.seq, now
                atomic_write(self.job_dir / HEARTBEAT, blob)
        return self.heartbeat_ttl > 0 and now - self._beat_seen > self.heartbeat_ttl

    def stop_requested(self) -> bool:
        assert self.folder is not None
        try:
            return self.folder.stop() is not None
        except Exception as exc:  # noqa: BLE001
            self._store_error("reading the stop document", exc)
            return False

    # -- phases -----------------------------------------------------------------

    def wait_for_launch(self) -> LaunchDocument | None:
        """This node's verified launch document, or None when the driver stopped the job or went away."""
        assert self.folder is not None
        while True:
            doc = self.read_doc("the launch document",
                                lambda: self.folder.launch(self.index, instance_id=self.identity.instance_id))
            if doc is not None and doc.gang != self.gang:
                self._refused(DocumentRefused(f"launch document of gang {doc.gang} of job {self.run_id}: this "
                                              f"node serves gang {self.gang}: refused"))
            elif doc is not None:
                return doc
            if self.stop_requested():
                return None
            if self.heartbeat_stale():
                return None
            time.sleep(self.interval)

    def prepare(self, doc: LaunchDocument) -> tuple[list[str], dict[str, str]]:
        """Local job folder with the payload; the agent's argv and env pointed at it, the key added."""
        from prefect_sgpu.store import atomic_write

        assert self.key is not None
        self.job_dir.mkdir(parents=True, exist_ok=True)
        blob = self.store.get(self.run_id, PAYLOAD)
        if blob is None:
            raise RuntimeError(f"{PAYLOAD} of job {self.run_id} is not in the store")
        atomic_write(self.job_dir / PAYLOAD, blob)  # sealed: the ranks verify it
        self.heartbeat_stale()
        argv = [f"--job-dir={self.job_dir}" if a.startswith("--job-dir=") else a for a in doc.argv]
        if len(argv) > 2 and argv[1] == "-m":  # the driver's interpreter path means nothing here
            argv[0] = sys.executable
        env = {**os.environ, **self.job_scratch(), **{k: v for k, v in doc.env.items() if k != KEY_ENV},
               **self.read_secrets(doc),
               "SGPU_JOB_DIR": str(self.job_dir), "SGPU_RUN_ID": self.run_id, KEY_ENV: self.key,
               "SGPU_INSTANCE_ID": self.identity.instance_id}
        return argv, env

    def job_scratch(self) -> dict[str, str]:
        """A folder of the job's own for its temp files and the caches that default to the user's
        cache folder or to the temp folder, as the environment of the job's agent and ranks.

        ``TMPDIR`` (``TMP``, ``TEMP``) is the folder itself: Python's ``tempfile``, torch's
        compile caches (``/tmp/torchinductor_<user>``), a Mosaic Streaming cache. ``XDG_CACHE_HOME``
        is ``.cache`` in it: Hugging Face's and torch hub's downloads, built torch extensions.
        ``TRITON_CACHE_DIR`` (Triton's compiled kernels, else in ``~/.triton``) is in it too.
        It is private (0700) and short (unix sockets go under temp folders, their paths are
        limited to 107 bytes), and deleted when the job ends (:meth:`drop_scratch`): on a
        warm lease the next job finds nothing the last one put there, neither a file nor a
        compiled kernel or a model it would load. The job's own ``env=`` wins over each value.
        """
        self.drop_scratch()
        self.scratch = Path(tempfile.mkdtemp(prefix="sgpu-", dir=self.temp_root))
        cache = self.scratch / ".cache"
        cache.mkdir(mode=0o700)
        tmp = str(self.scratch)
        return {"TMPDIR": tmp, "TMP": tmp, "TEMP": tmp, "XDG_CACHE_HOME": str(cache),
                "TRITON_CACHE_DIR": str(cache / "triton")}

    def open_cgroup(self) -> None:
        """A cgroup for the job about to start (every process it starts is born in it)."""
        self.close_cgroup()
        self.cgroup, why = JobCgroup.create(f"sgpu-{self.identity.instance_id}-{self.run_id}-g{self.gang}")
        if self.cgroup is None and not self._cgroup_refused:
            self._cgroup_refused = True
            _log(f"jobs run without a cgroup of their own ({why}): what a job leaves is killed by pid")

    def close_cgroup(self) -> None:
        """Kill every process left in the job's cgroup and remove it (the job's agent has ended)."""
        cgroup, self.cgroup = self.cgroup, None
        if cgroup is None:
            return
        killed = cgroup.kill()
        if killed:
            _log(f"killed {killed} process(es) job {self.run_id} left in its cgroup")
        if cgroup.path.exists():
            _log(f"the cgroup {cgroup.path} of job {self.run_id} could not be emptied and removed")

    def drop_scratch(self) -> None:
        """Delete the job's temp and cache folder (once its processes are gone)."""
        import shutil

        scratch, self.scratch = self.scratch, None
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    def read_secrets(self, doc: LaunchDocument) -> dict[str, str]:
        """The job's ``secrets=`` from their SecureString, when the (sealed) launch document says it has some."""
        if not doc.secrets:
            return {}
        from prefect_sgpu.environment_ship import INDEX_SECRET

        values = json.loads(self.host.read_secret(ssm_secrets_parameter(self.run_id, self.store.scope)))
        # the index credentials beside them are the environment stage's, not the ranks'
        return {str(k): str(v) for k, v in values.items() if k != INDEX_SECRET}

    def start_agent(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """The job's node agent as a process of its own (on a lease: with a /dev/shm of its own)."""
        out = self.job_dir / agent_output_key(self.index)
        out.parent.mkdir(parents=True, exist_ok=True)
        if self.lease:
            from prefect_sgpu.launch.lease_node import private_shm_command

            argv = private_shm_command(argv)
        if self.cgroup is not None:
            argv = self.cgroup.command(argv)
        with open(out, "ab") as fh:
            return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    # -- syncing ----------------------------------------------------------------

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

    def _append_new_bytes(self, path: Path, key: str) -> None:
        """Ship what ``path`` (a file that only grows) gained since the last call, as one appended piece."""
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
        with open(path, "rb") as fh:
            fh.seek(sent)
            data = fh.read(size - sent)
        self.store.append(self.run_id, key, sent, data)
        self._appended[key] = (path, sent + len(data))

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
        for kind, pattern in ((LOGS, "rank-*.log"), (METRICS, "rank-*.jsonl")):
            folder = self.job_dir / kind
            if folder.is_dir():
                for path in sorted(folder.glob(pattern)):
                    self._append_new_bytes(path, f"{kind}/{path.name}")
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
        self.quiet()  # after its status a node writes nothing more to the folder
        try:
            self.folder.put_status(self.index, status, instance_id=self.identity.instance_id)
        except BaseException:
            with self._alive_lock:  # not written: the node still lives, and says so, while it retries
                self._alive_quiet = False
            raise

    def watch_notices(self) -> None:
        """A reclaim notice from the host (IMDS on EC2): tell the ranks (the ``preempt`` file) and the driver (a notice document)."""
        from prefect_sgpu.runtime import PREEMPT_FILE
        from prefect_sgpu.store import atomic_write

        if self.notice is not None:
            return
        notice = self.host.reclaim_notice()
        if notice is None:
            return
        self.notice = notice
        _log(f"reclaim notice: {notice}; the ranks are told to checkpoint")
        atomic_write(self.job_dir / PREEMPT_FILE, notice.encode())
        self.publish_notice()

    def publish_notice(self) -> None:
        """The notice document (once; retried on the next tick until the store took it)."""
        if self.notice is None or self._notice_published:
            return
        try:
            self.folder.put_notice(self.index, Notice(text=self.notice, time=time.time()),
                                   instance_id=self.identity.instance_id)
            self._notice_published = True
        except Exception as exc:  # noqa: BLE001 - the next tick publishes it again
            self._store_error("publishing the reclaim notice", exc)

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

    def stop_agent(self, proc: Any) -> None:
        """SIGTERM the agent (it stops its ranks), ``grace`` seconds, then SIGKILL what is left."""
        import psutil

        if proc.poll() is not None:
            return
        if isinstance(proc, ForkedAgent):
            proc.stop(self.grace)
            return
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        proc.terminate()
        _, alive = psutil.wait_procs(tree, timeout=self.grace)
        kill_and_reap(alive)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def terminate_self(self, reason: str) -> int:
        """The driver is gone: node 0 deletes the job's key parameter; every node terminates its instance."""
        _log(f"{reason}: terminating instance {self.identity.instance_id}")
        self.phase = "terminating"
        if self.folder is not None:
            try:
                self.publish_alive(force=True)
            except Exception:  # noqa: BLE001 - termination matters more than the notice
                pass
        if self.key is not None and self.index == 0:
            runs = dict.fromkeys(r for r in (self.run_id, self.lease_id) if r)
            for name in [n for r in runs for n in (ssm_key_parameter(r, self.store.scope),
                                                                    ssm_secrets_parameter(r, self.store.scope))]:
                try:
                    self.host.delete_secret(name)
                except Exception:  # noqa: BLE001 - the parameter may already be gone, or never was
                    pass
        self.host.terminate(self.identity)
        self.terminated = True
        return 0

    def crashed(self, exc: BaseException) -> int:
        """This program failed: tell the driver (the job fails now, not at its timeout), power off."""
        import traceback

        _log(f"bootstrap failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        if self._agent is not None:
            self.stop_agent(self._agent)
        self.close_cgroup()
        if self.folder is not None:  # without the key nothing this node writes would be believed
            self.quiet()
            try:
                status = NodeStatus(node=self.index, host=socket.gethostname(), exit_code=2,
                                    error=f"node bootstrap failed: {type(exc).__name__}: {exc}")
                self.folder.put_status(self.index, status, instance_id=self.identity.instance_id)
            except Exception:  # noqa: BLE001 - the store may be what failed
                pass
        try:
            return self.terminate_self("node bootstrap failed") or 2
        except Exception:  # noqa: BLE001 - the driver's release terminates the instance
            return 2

    # -- the whole life ---------------------------------------------------------

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

    def serve_job(self) -> int | None:
        """One job in the current folder, from waiting for its launch to its reported end.

        None when the job ended (finished, or stopped by the driver); the exit code of
        :meth:`terminate_self` when the driver's heartbeat went stale."""
        self.phase = "waiting"
        self.publish_alive(force=True)
        doc = self.wait_for_launch()
        if doc is None:
            if self.stop_requested():
                _log("the driver stopped the job before this node was started")
                return None
            return self.terminate_self(f"no new driver heartbeat for {self.heartbeat_ttl:g}s")
        argv, env = self.prepare(doc)
        self.phase = "running"
        self.open_cgroup()
        proc = self._agent = self.fork_agent(argv, env) or self.start_agent(argv, env)
        _log(f"node agent started (pid {proc.pid})")
        self.publish_alive(force=True)
        while True:
            code = proc.poll()
            if code is not None:
                _log(f"node agent exited with code {code}")
                self.close_cgroup()  # what its ranks left: their output is complete before the last sync
                if not self.finish_reliably(code):
                    return self.terminate_self(f"no new driver heartbeat for {self.heartbeat_ttl:g}s")
                self.phase = "finished"
                return None
            self.sync_quietly()
            if self.stop_requested():
                _log("stop requested by the driver")
                self.stop_agent(proc)
                self.close_cgroup()
                if not self.finish_reliably(proc.poll(), "stopped by the driver"):
                    return self.terminate_self(f"no new driver heartbeat for {self.heartbeat_ttl:g}s")
                self.phase = "stopped"
                return None
            if self.heartbeat_stale():
                self.stop_agent(proc)
                self.close_cgroup()
                try:  # what the ranks left, for whoever looks later
                    self.finish(proc.poll(), f"{HEARTBEAT_STOP} for {self.heartbeat_ttl:g}s (the node's TTL)")
                except Exception as exc:  # noqa: BLE001
                    self._store_error("uploading the node's outcome", exc)
                return self.terminate_self(f"no new driver heartbeat for {self.heartbeat_ttl:g}s")
            time.sleep(self.interval)

    def watch_until_gone(self) -> "int | Rejoin":
        """The work is done; the driver terminates this instance. If it never does, do it.

        Silent: after its status a node writes nothing more to the store, so the driver's
        deletion of the job's control files (right after it terminates the instances) is final.
        Unless the driver keeps this node for the job's next gang, after another node was lost:
        a verified rejoin document for a higher gang than this node served is returned.
        """
        self.quiet()
        assert self.folder is not None
        while True:
            if self.heartbeat_stale():
                return self.terminate_self(f"no new driver heartbeat for {self.heartbeat_ttl:g}s")
            doc = self.read_doc("the rejoin document",
                                lambda: self.folder.rejoin(self.index, instance_id=self.identity.instance_id))
            if doc is not None and doc.gang > self.gang:
                return doc
            if doc is not None and doc.gang < self.gang:
                self._refused(DocumentRefused(f"rejoin for gang {doc.gang} of job {self.run_id} is older than "
                                              f"gang {self.gang}, already served (replayed): refused"))
            time.sleep(self.interval)

    def rejoin(self, doc: "Rejoin") -> None:
        """Serve gang ``doc.gang`` of the same job: nothing of the gang before stays (its local folder,
        processes and uploads), and the node announces itself in the job's folder again."""
        import shutil

        _log(f"kept for gang {doc.gang} of job {self.run_id}")
        if self._agent is not None and self._agent.poll() is None:
            self.stop_agent(self._agent)
        self.close_cgroup()
        assert self.key is not None
        with self._alive_lock:
            shutil.rmtree(self.job_dir, ignore_errors=True)
            self._enter(self.run_id, self.key, doc.gang)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefect-sgpu-bootstrap")
    p.add_argument("--store", required=True, help="s3://bucket/prefix of the job store")
    p.add_argument("--run-id", required=True)
    p.add_argument("--region", required=True)
    p.add_argument("--endpoint-url", default=None)
    p.add_argument("--store-kms-key", default=None, help="KMS key of the store's objects (SSE-KMS)")
    p.add_argument("--bucket-owner", default=None, help="account id that must own the store's bucket")
    p.add_argument("--heartbeat-ttl", type=float, default=900.0)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--lease", action="store_true",
                   help="the instance belongs to a warm lease (--run-id is the lease's id): serve its assigned jobs")
    p.add_argument("--gang", type=int, default=0,
                   help="which gang of the job the instance serves (a relaunch: 1, 2, ...); only its stop is obeyed")
    p.add_argument("--node-index", type=int, default=None,
                   help="the node this instance replaces (launched alone after a loss); default: its launch index")
    p.add_argument("--backstop-marker", default=None,
                   help="created once this program has taken over from the user-data's backstop")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from prefect_sgpu.store import default_home
    from prefect_sgpu.store_s3 import S3Store

    from prefect_sgpu.launch.ec2_host import EC2NodeHost

    args = parse_args(argv)
    host = EC2NodeHost(args.region, args.endpoint_url)
    node: NodeBootstrap | None = None
    try:
        identity = host.identity()
        store = S3Store(args.store, region=args.region, endpoint_url=args.endpoint_url,
                        kms_key_id=args.store_kms_key, bucket_owner=args.bucket_owner)
        node_dir = Path(os.environ.get(NODE_DIR_ENV) or default_home() / "node-jobs")
        node = NodeBootstrap(store, args.run_id, identity, node_dir, args.heartbeat_ttl, interval=args.interval,
                             lease=args.lease, host=host, gang=args.gang,
                             node_index=args.node_index)
        if args.backstop_marker:
            Path(args.backstop_marker).touch()  # from here on this program watches the node
        return node.run()
    except Exception as exc:  # noqa: BLE001 - without this program nobody watches the node
        if node is None:
            import traceback

            _log(f"bootstrap failed before it knew its instance: {type(exc).__name__}: {exc}\n"
                 f"{traceback.format_exc()}")
            return host.power_off("no identity, no way to terminate through the API")
        code = node.crashed(exc)
        if not node.terminated:  # crashed() could not terminate the instance through the API
            return host.power_off("termination through the API failed")
        return code


if __name__ == "__main__":
    sys.exit(main())
