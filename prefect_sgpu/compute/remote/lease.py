"""Warm leases: machines (EC2 instances) kept between jobs of one shape, for the next job to run on.

A cold EC2 job pays for its instances' boot (minutes on a GPU AMI) and terminates them when
it ends. With ``keep_warm`` the compute instead launches the instances for a *lease*: their
user-data names the lease's id (``--lease``), and their bootstrap serves one job after
another (:meth:`prefect_sgpu.launch.bootstrap.NodeBootstrap.serve_lease`). Between jobs the
lease waits in this process's warm pool (:mod:`prefect_sgpu.compute.warm_pool`), so consecutive
GPU tasks of a flow and repeated ``.distributed()`` calls of one driver pay the boot once.

**Trust stays per job.** The lease has a folder and a key of its own (an SSM SecureString
named for the lease, deleted when the lease ends). What it tells a node is only which job to
serve next: an assignment sealed with the lease key, bound to the node and its instance, with
a sequence number that only grows. The job itself keeps its own folder and key; the node reads
that key from SSM by the assigned run id, exactly as a cold node reads its own. Whoever can
write the store can delay an assignment, never make a node run a job the driver did not
assign, nor serve an old one again.

**Nothing leaks.** The lease ends, its instances terminated and its key and groups deleted,

- when the compute that used it last is closed (the task runner closes its compute when the
  flow ends), or on demand (:func:`prefect_sgpu.release_warm`);
- after ``keep_warm`` seconds without a job;
- when a job on it lost a node, failed to start on it, or did not end cleanly on every node,
  or when a node's status says its machine is unfit (the job's cgroup could not be emptied, so
  what the job left may still run there: :func:`note_status`): such a lease is never reused;
- when this interpreter exits; and if the driver dies outright, because the nodes stop
  seeing the lease's heartbeat and terminate themselves after the heartbeat TTL (the
  sweeper removes what they cannot).

While it waits, the lease is watched: one DescribeInstances and one listing of its folder's
``nodes/`` every few seconds; an instance that is no longer running, a reclaim notice or a
node that stopped announcing itself makes the lease unfit, and the next job provisions anew.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from prefect_sgpu.compute.warm_pool import Pooled
from prefect_sgpu.protocol.jobfolder import Assign, alive_key, notice_key

if TYPE_CHECKING:
    from prefect_sgpu.compute.remote.provider import Machine, Provider
    from prefect_sgpu.protocol.jobfolder import JobFolder, NodeStatus

logger = logging.getLogger("prefect_sgpu.compute.remote.lease")

#: seconds between the lease's own heartbeats (as a job driver's)
BEAT_INTERVAL_S = 2.0
#: seconds between health checks of an idle lease (instance states, notices, alive documents)
CHECK_INTERVAL_S = 5.0


def lease_id(run_id: str, gang: int = 0) -> str:
    """The id of the lease a job launches when no warm one fits: its folder, SSM key, tags and tokens."""
    return f"{run_id}-lease{gang}"


@dataclass(kw_only=True)
class WarmLease(Pooled):
    """One lease: its folder (with the lease key), its instances, and the thread that beats for it."""

    folder: "JobFolder"
    instances: list["Machine"]
    #: the provider of the compute that launched it: machine states, termination, the key
    provisioner: "Provider"
    #: seconds a node of an idle lease may go without announcing itself
    node_silence_s: float
    #: the last assignment's sequence number
    seq: int = 0
    #: why this lease may not serve another job (None: fit)
    unfit: str | None = None
    #: the lease's key parameter, once written (deleted on close)
    key_parameter: str | None = None
    #: the lease's SecureString of index credentials its machines build with, once written (deleted on close)
    secrets_parameter: str | None = None
    #: what removes the lease's other cloud resources (an IAM role), run after its machines ended;
    #: each returns what it removed and never raises
    on_close: list[Callable[[], list[str]]] = field(default_factory=list)
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _alive: dict[int, tuple[str | None, float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def lease_id(self) -> str:
        return self.folder.run_id

    def start_beating(self) -> None:
        """The lease's heartbeat, from before its instances exist until it closes."""
        self.folder.beat()
        self._thread = threading.Thread(target=self._beat, name=f"sgpu-ec2-lease-{self.lease_id}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        checked = time.monotonic()
        while not self._done.wait(BEAT_INTERVAL_S):
            try:
                self.folder.beat()
            except Exception:  # noqa: BLE001 - the next beat may succeed; the nodes' TTL is minutes
                logger.debug("lease %s: heartbeat failed", self.lease_id, exc_info=True)
            if not self.in_use and self.instances and time.monotonic() - checked >= CHECK_INTERVAL_S:
                checked = time.monotonic()
                try:
                    self.check()
                except Exception:  # noqa: BLE001 - an unreadable check is not a verdict
                    logger.debug("lease %s: health check failed", self.lease_id, exc_info=True)

    def check(self) -> None:
        """An idle lease's health: every instance running, no reclaim notice, every node announcing
        itself in the lease's folder (one DescribeInstances, one listing)."""
        states = self.provisioner.instance_states([i.id for i in self.instances])
        dead = {i: s for i, s in states.items() if s in self.provisioner.dead_states}
        if dead:
            self.mark_unfit(f"instance(s) {dead} are no longer running")
            return
        listed = self.folder.node_documents()
        now = time.monotonic()
        for index in range(len(self.instances)):
            if notice_key(index) in listed:
                self.mark_unfit(f"node {index} received a reclaim notice")
                return
            version = listed.get(alive_key(index))
            seen, since = self._alive.get(index, (None, now))
            if version != seen or index not in self._alive:
                self._alive[index] = (version, now)
            elif now - since > self.node_silence_s and now - self.idle_since > self.node_silence_s:
                self.mark_unfit(f"node {index} has not announced itself for {self.node_silence_s:g}s")
                return

    def mark_unfit(self, why: str) -> None:
        if self.unfit is None:
            self.unfit = why
            logger.info("warm lease %s can serve no more jobs: %s", self.lease_id, why)

    def healthy(self) -> bool:
        return not self.closed and self.unfit is None

    def assign(self, run_id: str, gang: int = 0) -> int:
        """Tell every node to serve gang ``gang`` of job ``run_id`` next (one write, each entry sealed
        and bound)."""
        with self._lock:
            self.seq += 1
            self.folder.put_assignments({i: (Assign(run_id=run_id, seq=self.seq, gang=gang), inst.id)
                                         for i, inst in enumerate(self.instances)})
            return self.seq

    def close(self) -> None:
        """Terminate the lease's instances, delete its groups, key and control files; idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        gone: list[str] = []
        try:
            try:
                self.folder.put_stop(0.0, reason="the warm lease was closed")
            except Exception:  # noqa: BLE001 - termination below is what matters
                logger.debug("lease %s: could not write its stop", self.lease_id, exc_info=True)
            gone += self.provisioner.terminate(self.lease_id)
        finally:
            self._done.set()
            for name in (self.key_parameter, self.secrets_parameter):
                if name and self.provisioner.delete_secret(name):
                    gone.append(f"SSM parameter {name}")
            for cleanup in self.on_close:
                gone += cleanup()
            try:
                self.folder.delete_control_files()
            except Exception:  # noqa: BLE001 - the sweeper removes them later
                logger.warning("lease %s: could not delete its control files", self.lease_id, exc_info=True)
        logger.info("warm lease %s closed after %d job(s): %s", self.lease_id, self.jobs, ", ".join(gone) or "-")

    def describe(self) -> dict[str, Any]:
        return {"lease": self.lease_id, "instances": [i.id for i in self.instances], "jobs": self.jobs,
                "unfit": self.unfit}


def note_status(lease: "WarmLease | None", node: int, status: "NodeStatus | None") -> "NodeStatus | None":
    """A node's status as the driver reads it (returned unchanged). One that says its machine is unfit
    (what its job left could not be ended) marks the job's lease unfit: it is not offered to the next
    job, and its machines end when the job gives it back."""
    if lease is not None and status is not None and status.unfit:
        lease.mark_unfit(f"node {node}: {status.unfit}")
    return status
