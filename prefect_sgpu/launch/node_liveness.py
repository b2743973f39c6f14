"""The node's heartbeat rule: it says it is alive, watches the driver's heartbeat and ends its own machine.

A mixin of :class:`prefect_sgpu.launch.node_bootstrap.NodeBootstrap` (its methods run on the
bootstrap: its folder, key, host and identity):

- a sealed ``nodes/node-<i>.alive`` refreshed on a thread of its own, so no upload, however slow,
  holds it back past the driver's ``node_silence_s``; silent in a folder once the node's status went there;
- the driver's sealed heartbeat copied down verbatim once it is new (a higher sequence number under a
  valid seal); none new for ``heartbeat_ttl`` seconds on this node's monotonic clock means the driver
  is gone: the node stops its agent and terminates its own machine, so a dead driver cannot leak paid VMs;
- a reclaim notice from the host, told to the ranks (the ``preempt`` file) and the driver;
- the driver's ask for a final checkpoint (its heartbeat's ``checkpoint``: a cost cap), told to the ranks
  (the ``final-checkpoint`` file) as a reclaim notice is;
- a rebalance recommendation from the host: a warning, not a reclaim (the cloud may never take the
  machine): logged, told to the driver (a notice document marked ``reclaim=False``) and to the
  ranks only as the ``rebalance`` file (``runtime.rebalance_recommendation()``), which a
  checkpointer asked to save on it reads; a reclaim notice that follows is handled as any other;
- a crash of this program: reported to the driver, then the machine is ended.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from prefect_sgpu.errors import DocumentRefused
from prefect_sgpu.protocol.jobfolder import HEARTBEAT, Alive, NodeStatus, Notice, ssm_key_parameter, ssm_secrets_parameter, unseal
from prefect_sgpu.procs.processes import node_log as _log
from prefect_sgpu.protocol.versions import runtime_versions


class NodeLiveness:
    """The alive documents, the driver's heartbeat and stop, reclaim notices and the node's own end."""

    store: Any
    host: Any
    identity: Any
    index: int
    run_id: str
    lease_id: str | None
    job_dir: Any
    key: str | None
    folder: Any
    phase: str
    ready_at: float = 0.0  # when the environment was ready (the bootstrap sets it; 0: not said)
    interval: float
    heartbeat_ttl: float
    notice: str | None
    rebalance: str | None
    terminated: bool
    _agent: Any
    _alive_lock: Any
    _store_error: Any
    _refused: Any
    stop_agent: Any
    close_cgroup: Any

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
                        versions=runtime_versions(), ready=self.ready_at)
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

    def heartbeat_stale(self) -> bool:
        """Has no new sealed driver heartbeat arrived for ``heartbeat_ttl`` seconds (node clock)?

        A new one (higher sequence number, valid seal) is copied down verbatim, so the
        agent's own watch verifies the very same document.
        """
        from prefect_sgpu.protocol.jobfolder import Heartbeat
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
                self.tell_final_checkpoint(beat.checkpoint)
        return self.heartbeat_ttl > 0 and now - self._beat_seen > self.heartbeat_ttl

    def tell_final_checkpoint(self, reason: str) -> None:
        """The driver asks for a final checkpoint before it stops the job (a sealed heartbeat says why):
        the ranks are told as on a reclaim notice, through a file of their own (``final-checkpoint``), once
        per job folder. The node is not reclaimed: the driver's stop follows."""
        from prefect_sgpu.runtime import FINAL_CHECKPOINT_FILE
        from prefect_sgpu.store import atomic_write

        path = self.job_dir / FINAL_CHECKPOINT_FILE
        if reason and not path.exists():
            _log(f"the driver asks for a final checkpoint ({reason}); the ranks are told to checkpoint")
            atomic_write(path, reason.encode())

    def stop_requested(self) -> bool:
        assert self.folder is not None
        try:
            return self.folder.stop() is not None
        except Exception as exc:  # noqa: BLE001
            self._store_error("reading the stop document", exc)
            return False

    def watch_notices(self) -> None:
        """A reclaim notice from the host (IMDS on EC2): tell the ranks (the ``preempt`` file) and the driver
        (a notice document). A rebalance recommendation is a warning only: logged, the ranks' ``rebalance``
        file and a notice document marked ``reclaim=False``; the node keeps watching for a reclaim."""
        from prefect_sgpu.runtime import PREEMPT_FILE, REBALANCE_FILE
        from prefect_sgpu.store import atomic_write

        if self.notice is not None:
            return
        notice = self.host.reclaim_notice()
        if self.rebalance is None and notice is None:
            advice = self.host.rebalance_notice()
            if advice is not None:
                self.rebalance = advice
                _log(f"{advice}: a warning, not a reclaim; the job goes on (a reclaim notice may follow, or none)")
                atomic_write(self.job_dir / REBALANCE_FILE, advice.encode())
                self.publish_notice()
        if notice is None:
            return
        self.notice = notice
        _log(f"reclaim notice: {notice}; the ranks are told to checkpoint")
        atomic_write(self.job_dir / PREEMPT_FILE, notice.encode())
        self.publish_notice()

    def publish_notice(self) -> None:
        """The notice document: the reclaim notice once, or while there is none the rebalance
        recommendation once (``reclaim=False``); retried on the next tick until the store took it."""
        if self.notice is not None:
            text, reclaim, done = self.notice, True, self._notice_published
        elif self.rebalance is not None:
            text, reclaim, done = self.rebalance, False, self._rebalance_published
        else:
            return
        if done:
            return
        try:
            self.folder.put_notice(self.index, Notice(text=text, time=time.time(), reclaim=reclaim),
                                   instance_id=self.identity.instance_id)
            if reclaim:
                self._notice_published = True
            else:
                self._rebalance_published = True
        except Exception as exc:  # noqa: BLE001 - the next tick publishes it again
            self._store_error("publishing the reclaim notice" if reclaim else "publishing the rebalance recommendation",
                              exc)

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
