"""A remote node of a warm lease: one job after another on the same machine.

With ``--lease`` the instance belongs to a warm lease (``--run-id`` is the lease's id) and
serves one job after another. Between jobs it waits in the lease's folder, announcing itself
there and watching the lease's heartbeat and stop, for its *assignment*: a document sealed
with the lease key, bound to this node and instance, naming the next job's run id with a
sequence number higher than the last one it took. It then reads that job's key from SSM (the
name derives from the run id, never from a document) and runs steps 3-7 in the job's folder.
A lease's node also keeps a warm node process (:mod:`prefect_sgpu.launch.warm_node`, torch
imported, never running user code): each job's node agent is forked from it, and its ranks in
turn, so a job on a warm lease imports nothing (the lease's first job waits for the preload,
at most 30 s, and otherwise starts its agent as a cold node does). When the job ends (finished or stopped) every process it left
is killed (all of them at once through the job's cgroup, :mod:`prefect_sgpu.launch.job_cgroup`;
and the warm node and this program are child subreapers, so orphans come back to them),
the job's local folder is deleted and the node goes back to waiting. A stale heartbeat of the job or of
the lease still terminates the instance, and a ``stop`` in the lease's folder (the lease is
closed) leaves it to the driver's termination, watched by the same heartbeat rule.
"""

from __future__ import annotations

import os
import time
from typing import Any

from prefect_sgpu.errors import DocumentRefused
from prefect_sgpu.protocol.jobfolder import Assign, agent_output_key
from prefect_sgpu.procs.processes import kill_and_reap
from prefect_sgpu.procs.processes import node_log as _log

#: seconds a job waits for the lease's warm node to finish preloading before its agent starts cold
WARM_PRELOAD_WAIT_S = 30.0


class LeaseServing:
    """What :class:`prefect_sgpu.launch.bootstrap.NodeBootstrap` does on a lease's machine: its
    methods run on the bootstrap itself (its folder, key, heartbeat rule and agent handling)."""

    folder: Any
    key: str | None
    lease_id: str | None
    warm: Any
    drop_scratch: Any
    cgroup: Any
    close_cgroup: Any
    unfit: str | None

    def serve_lease(self) -> int:
        """Jobs one after another, each as the lease assigns it; between them, wait in the lease's folder."""
        import psutil

        from prefect_sgpu.procs.processes import become_subreaper

        assert self.lease_id is not None and self.key is not None
        become_subreaper()
        self._resident = {p.pid for p in psutil.Process().children(recursive=True)}
        self.start_warm_node()
        lease_id, lease_key = self.lease_id, self.key
        while True:
            self.phase = "idle"
            self.publish_alive(force=True)
            self.publish_notice()  # a reclaim notice seen during a job: the lease must know too
            assigned = self.wait_for_assignment()
            if assigned is None:
                if self.stop_requested():
                    _log(f"lease {lease_id} was closed")
                    return self.watch_until_gone()
                return self.terminate_self(f"no new lease heartbeat for {self.heartbeat_ttl:g}s")
            _log(f"assigned job {assigned.run_id} (assignment {assigned.seq})")
            key = self.read_key(assigned.run_id, wait=self.key_wait)
            if key is None:  # the driver gave the job up before it wrote the key: back to waiting
                continue
            self.enter(assigned.run_id, key, assigned.gang)
            try:
                code = self.serve_job()
            finally:
                self.clear_job()
                self.enter(lease_id, lease_key)
            if code is not None:
                return code
            if self.unfit:  # what a job left may still run here: no later job is served beside it
                _log(f"lease {lease_id}: this node takes no more assignments ({self.unfit})")
                return self.watch_until_gone()

    def wait_for_assignment(self) -> Assign | None:
        """The lease's next verified assignment for this node (a sequence number above the last
        one taken), or None when the lease was closed or its driver went away."""
        assert self.folder is not None
        while True:
            self.read_doc("the host's reclaim notice", self.watch_notices)
            doc = self.read_doc("the lease's assignment",
                                lambda: self.folder.assignment(self.index, instance_id=self.identity.instance_id))
            if doc is not None and doc.seq > self._assigned:
                self._assigned = doc.seq
                return doc
            if doc is not None and doc.seq < self._assigned:
                self._refused(DocumentRefused(f"assignment {doc.seq} of lease {self.run_id} is older than "
                                              f"assignment {self._assigned}, already served (replayed): refused"))
            if self.stop_requested():
                return None
            if self.heartbeat_stale():
                return None
            time.sleep(self.interval)

    def start_warm_node(self) -> None:
        """The lease's warm node: it preloads while the node waits for its first assignment."""
        from prefect_sgpu.procs.warm_channel import WarmNodeProcess, warm_node_argv

        private = private_shm_argv()
        argv = private + warm_node_argv(self.index, LEASE_SHM_SIZE if private else "")
        try:
            self.warm = WarmNodeProcess(self.index, argv, dict(os.environ), self.node_dir / "warm-node.log", [])
        except OSError as exc:  # every job then starts its agent cold
            _log(f"no warm node: {exc}")
            self.warm = None

    def fork_agent(self, argv: list[str], env: dict[str, str]) -> "ForkedAgent | None":
        """The job's node agent forked from the warm node, when there is one, it has preloaded and
        the argv is the node agent's; else None (the caller starts the agent cold)."""
        from prefect_sgpu.procs.warm_channel import AGENT_MODULE

        warm = self.warm
        if warm is None or argv[1:3] != ["-m", AGENT_MODULE]:
            return None
        # still preloading (the lease's first job): worth the wait, a cold agent imports the same and more
        if not warm.preloaded(wait=WARM_PRELOAD_WAIT_S):
            if not warm.alive():
                _log(f"the warm node is gone ({warm.broken or 'exited'}): jobs start cold from now on")
                self.warm = None
            return None
        out = self.job_dir / agent_output_key(self.index)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            warm.launch(argv[3:], env, os.getcwd(), out,
                        cgroup=str(self.cgroup.procs) if self.cgroup is not None else None)
        except Exception as exc:  # noqa: BLE001 - the job still runs, cold
            _log(f"the warm node could not start the job's agent ({exc}): starting it cold")
            warm.close()
            self.warm = None
            return None
        return ForkedAgent(warm)

    def clear_job(self) -> None:
        """Nothing of a finished job stays for the next: every process left in its agent's session
        (a rank's daemon child) is killed, and its local folder and its temp and cache folder
        (:meth:`~prefect_sgpu.launch.bootstrap.NodeBootstrap.job_scratch`) are deleted."""
        import shutil

        import psutil

        if self._agent is not None and self._agent.poll() is None:
            self.stop_agent(self._agent)
        self.close_cgroup()
        # orphans come back here (a subreaper); what ran before the first job (the user-data's backstop) and
        # the warm node (which kills what a job forked from it left before it reports the job ended) stay
        keep = set(self._resident)
        if self.warm is not None and self.warm.alive():
            keep.add(self.warm.pid)
            try:
                keep |= {p.pid for p in psutil.Process(self.warm.pid).children(recursive=True)}
            except psutil.Error:
                pass
        left = [p for p in psutil.Process().children(recursive=True) if p.pid not in keep]
        if left:
            _log(f"killing {len(left)} process(es) job {self.run_id} left behind")
            kill_and_reap(left)
        shutil.rmtree(self.job_dir, ignore_errors=True)
        self.drop_scratch()


def private_shm_argv() -> list[str]:
    """What puts the lease's warm node in a mount namespace of its own, where it mounts a
    ``/dev/shm`` of its own (``--shm-size``) and empties it before each job: the jobs forked from
    it share one ``/dev/shm`` among their ranks (NCCL, DataLoader workers) and find nothing a
    job before them left there. Root and util-linux ``unshare`` only (every EC2 node's
    bootstrap runs as root); without them, ``[]`` and the machine's ``/dev/shm``."""
    import shutil

    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or not unshare:
        return []
    return [unshare, "--mount", "--propagation", "private", "--"]


#: the size of a lease's private /dev/shm: what Linux gives the machine's own
LEASE_SHM_SIZE = "50%"


def private_shm_command(argv: list[str]) -> list[str]:
    """``argv`` run in a mount namespace of its own with a ``/dev/shm`` of its own: a job's agent
    that starts cold on a lease (no warm node to fork it from). The namespace, and the tmpfs
    with everything the job put in it, go when the job's last process does. Unchanged without
    root or ``unshare``, or for a command other than the node agent."""
    from prefect_sgpu.procs.warm_channel import AGENT_MODULE

    prefix = private_shm_argv()
    if not prefix or argv[1:3] != ["-m", AGENT_MODULE]:
        return argv
    return [*prefix, *argv, f"--shm-size={LEASE_SHM_SIZE}"]  # the node agent mounts it, as a local node's does


class ForkedAgent:
    """A job's node agent forked by the lease's warm node, seen as the bootstrap's loop sees a
    ``Popen``: ``pid``, ``poll()`` (its exit code once the warm node killed what it left)."""

    def __init__(self, warm: Any) -> None:
        self.warm = warm
        self.pid = int(warm.agent_pid)

    def poll(self) -> int | None:
        code = self.warm.poll()
        if code is None and not self.warm.alive():
            return -9  # the warm node died, and the agent with it
        return code

    def stop(self, grace: float) -> None:
        """SIGTERM to the agent's process group, everything of the job SIGKILLed after ``grace``;
        a warm node that does not report the job ended is closed (later jobs start cold)."""
        self.warm.stop(grace)
        if not self.warm.wait_job(grace + 10.0):
            _log(f"the warm node did not end agent {self.pid}: closing it")
            self.warm.close()
