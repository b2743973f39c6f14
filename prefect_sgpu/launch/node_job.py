"""One job on a node: wait for its verified launch, prepare its folder, run its agent, and see it end.

A mixin of :class:`prefect_sgpu.launch.node_bootstrap.NodeBootstrap`. Only a launch document sealed
with the job key *and bound to this node index and this instance id* is run; anything else is refused
with a log line and waited past. The payload is copied into a local job folder (the ranks verify it)
and the node agent runs against it with the job key in its environment, in a cgroup of the job's own
where the machine allows, with a private temp and cache folder deleted when the job ends. A sealed
``stop`` of this node's gang stops it; after the job the node waits, silent, for the driver to end the
machine, or to keep it for the job's next gang (a verified rejoin document).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prefect_sgpu.errors import DocumentRefused
from prefect_sgpu.protocol.jobfolder import HEARTBEAT_STOP, PAYLOAD, LaunchDocument, Rejoin, agent_output_key, ssm_secrets_parameter
from prefect_sgpu.launch import nccl_env
from prefect_sgpu.launch.job_cgroup import JobCgroup
from prefect_sgpu.launch.lease_node import ForkedAgent
from prefect_sgpu.procs.processes import kill_and_reap, node_log as _log

#: the job key in the environment of the job's agent and ranks
KEY_ENV = "SGPU_PAYLOAD_KEY"


class JobServing:
    """The job's agent from its launch to its reported end (see the module docstring)."""

    store: Any
    host: Any
    identity: Any
    index: int
    run_id: str
    gang: int
    lease: bool
    job_dir: Path
    key: str | None
    folder: Any
    phase: str
    interval: float
    grace: float
    heartbeat_ttl: float
    scratch: Path | None
    cgroup: JobCgroup | None
    temp_root: str
    _agent: Any
    _cgroup_refused: bool
    unfit: str | None
    _alive_lock: Any
    _enter: Any
    _refused: Any
    _store_error: Any
    read_doc: Any
    quiet: Any
    publish_alive: Any
    heartbeat_stale: Any
    stop_requested: Any
    sync_quietly: Any
    finish: Any
    finish_reliably: Any
    terminate_self: Any
    fork_agent: Any

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
        env.update(nccl_env.agent_env(env))  # an EFA node: the NCCL plugin's folder on the loader's path
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
            self.unfit = self.unfit or (f"the cgroup {cgroup.path} of job {self.run_id} could not be emptied "
                                        f"and removed ({len(cgroup.pids())} process(es) left in it)")
            _log(f"{self.unfit}: this machine serves no later job")

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
        from prefect_sgpu.launch.node_env import INDEX_SECRET

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
