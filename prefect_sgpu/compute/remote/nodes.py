"""The driver half of the remote-node protocol: machines of their own, reached only through the store.

A remote-node compute never needs an inbound port on the driver: everything between it and the nodes goes
through the job's store folder as sealed documents (:mod:`prefect_sgpu.protocol.jobfolder`). The machines
boot the node half (:mod:`prefect_sgpu.launch.bootstrap` over a :mod:`~prefect_sgpu.launch.node_host`); each
node announces itself (a sealed ``alive`` document), the driver writes every node's sealed launch document
(one object) once all are up, and the nodes run the ordinary node agent against a local mirror of the job
folder.

:class:`RemoteNodeCompute` is that protocol, whatever the cloud: the job key and ``secrets=``
put where nodes read them, the waits for nodes, launch documents, polling (statuses, notices,
silence, machine states), stop, release, warm leases (:mod:`~prefect_sgpu.compute.remote.lease`)
and their assignments. A cloud brings a :class:`Provider` (machines and secrets) and a
subclass that plans its requests and launches its machines (:meth:`_provision`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from prefect_sgpu.compute.base import (MASKED_ENV, AllocatedNode, Allocation, Compute, Event, JobLaunch, NodeExited,
                                       NodeLost, NodeNotice, NodeUp, Released, Request)
from prefect_sgpu.compute.remote.allocation import RemoteAllocation, RemoteRequest, cost_text
from prefect_sgpu.compute.remote.lease import WarmLease, note_status
from prefect_sgpu.compute.remote.provider import Machine, Provider
from prefect_sgpu.errors import EnvironmentMismatch, JobCancelled, LaunchTimeout, ProvisioningError
from prefect_sgpu.protocol.jobfolder import (JobFolder, LaunchDocument, alive_key, new_key, notice_key, ssm_key_parameter,
                                    ssm_secrets_parameter, status_key)
from prefect_sgpu.compute.warm_pool import POOL, check_keep_warm
from prefect_sgpu.observe import timeline
from prefect_sgpu.protocol.versions import differences, runtime_versions

if TYPE_CHECKING:
    from prefect_sgpu.store import Store

logger = logging.getLogger("prefect_sgpu.compute.remote.nodes")

#: seconds the nodes of a warm lease get to take up a job before the lease is given up for new machines
WARM_TAKEUP_S = 120.0


class Progress:
    """requested -> running -> agent up -> rendezvous, as log lines of the library: on the terminal,
    in the Prefect run's logs and on the job's live status line (:mod:`prefect_sgpu.observe.live`)."""

    def __init__(self, label: str, run_id: str) -> None:
        self.label, self.run_id = label, run_id

    def __call__(self, phase: str, detail: str = "", node: int | None = None) -> None:
        logger.info(f"[{self.label} {self.run_id}] {phase}" + (f": {detail}" if detail else ""))
        if phase in timeline.PROGRESS:  # the job's timeline, where this process drives it
            timeline.record(self.run_id, timeline.PROGRESS[phase], node, detail=detail[:200])


class RemoteNodeCompute(Compute):
    """The remote-node protocol over a store; a cloud subclasses it (see the module docstring).

    A subclass implements ``plan`` (a :class:`RemoteRequest`), :meth:`_provision` and
    :meth:`_lease_key`; the other hooks have defaults.
    """

    remote = True
    runs_node_agents = True
    #: machine states are read every 5 s: a peer's failure waits that long for the loss behind it
    loss_grace_s = 8.0

    def __init__(self, provisioner: Provider, store: "Store", *, agent_timeout_s: float = 900.0,
                 rendezvous_port: int = 29400, poll_interval_s: float = 1.0, node_silence_s: float = 120.0,
                 keep_warm: float = 0.0, kms_key_id: str | None = None) -> None:
        """``keep_warm``: seconds a job's machines wait for the next job of the same shape (a warm
        lease, :mod:`~prefect_sgpu.compute.remote.lease`); 0 ends them after every job.
        ``node_silence_s``: a node that announces nothing for that long is lost."""
        self.provisioner, self.store = provisioner, store
        self.agent_timeout_s, self.node_silence_s = agent_timeout_s, node_silence_s
        self.rendezvous_port, self.poll_interval_s = rendezvous_port, poll_interval_s
        self.keep_warm = check_keep_warm("keep_warm", keep_warm, "every job ends its machines")
        self.kms_key_id = kms_key_id
        self._lock = threading.RLock()

    # -- what a cloud provides --------------------------------------------------------

    def _provision(self, allocation: RemoteAllocation, launch_id: str, deadline: float,
                   cancel: threading.Event) -> list[Machine]:
        """The request's machines, launched for ``launch_id`` (the run id, or its lease's) and
        running, in node order; a deadline reached while they start is ``LaunchTimeout``; once
        ``cancel`` is set, ``JobCancelled``. What it launched is ended by ``provisioner.terminate``."""
        raise NotImplementedError

    def _lease_key(self, request: RemoteRequest) -> tuple[Any, ...]:
        """Jobs whose keys are equal may share a warm lease."""
        raise NotImplementedError

    def _sweep(self, request: RemoteRequest) -> None:
        """Remove what dead drivers of this store left, before launching; never fails the job."""

    def _prepare(self, allocation: RemoteAllocation) -> None:
        """A cold job's own cloud resources besides machines (say, an identity), before they launch;
        recorded on the allocation first, so that :meth:`_cleanup` removes even a half-made one."""

    def _cleanup(self, allocation: RemoteAllocation) -> list[str]:
        """Remove what :meth:`_prepare` made, after the machines; never raises. What it removed."""
        return []

    def _prepare_lease(self, allocation: RemoteAllocation, lease: WarmLease) -> None:
        """A new lease's own cloud resources besides machines, before they launch; what removes them is
        added to ``lease.on_close`` first (it runs after the lease's machines ended), so a half-made
        one goes too."""

    def _grant(self, allocation: RemoteAllocation, lease: WarmLease) -> None:
        """Before a lease's nodes are assigned this job: let them reach it (say, its files and key)."""

    def _revoke(self, allocation: RemoteAllocation, lease: WarmLease) -> None:
        """The job gives the lease back: take back what :meth:`_grant` gave. Raising discards the lease."""

    def _launch_env(self, allocation: RemoteAllocation) -> dict[str, str]:
        """Environment every rank gets on this cloud besides the job's (how ranks reach the store)."""
        return {}

    def _describe(self, machine: Any) -> str:
        return f"{machine.id} ({machine.private_ip})"

    def _console_output(self, machine_id: str) -> str:
        """What the machine printed while it booted (its setup, the node half's first lines), as far
        as the cloud keeps it; "" when there is nothing. Never raises."""
        return ""

    def _console_tail(self, machine_id: str, lines: int = 15, limit: int = 4000) -> str:
        try:
            text = self._console_output(machine_id)[-limit:].strip()
        except Exception:  # noqa: BLE001 - the error is raised without it
            logger.debug("no console output of %s", machine_id, exc_info=True)
            return ""
        if not text:
            return ""
        return f"; the end of {machine_id}'s console output:\n" + "\n".join(text.splitlines()[-lines:])

    # -- spending -------------------------------------------------------------------

    def acquire(self, request: Request, folder: "JobFolder", deadline: float,
                cancel: threading.Event) -> RemoteAllocation:
        """The job's machines: with ``keep_warm``, an idle warm lease of the job's shape, else new machines
        for a new lease that outlives the job; without, new machines of the job's own. Returns once every
        node announced itself in the job's folder; on any exception what was taken is given back."""
        assert isinstance(request, RemoteRequest)
        allocation = self._new_allocation(request, folder)
        allocation.progress("requested", self._requested_text(request))
        warm = request.keep_warm > 0
        try:
            self._put_key(allocation)  # before any node reads it: nodes verify from their first read
            if warm and self._take_warm(allocation, deadline, cancel):
                return allocation
            self._sweep(request)
            lease = self._new_lease(allocation) if warm else None
            launch_id = lease.lease_id if lease is not None else allocation.run_id
            # read by the environment stage at boot
            self._put_index_secret(lease if lease is not None else allocation, launch_id, request)
            if lease is None:
                self._prepare(allocation)
            self._ship_environment(allocation)
            machines = self._provision(allocation, launch_id, deadline, cancel)
            allocation.progress("running", (f"lease {launch_id}: " if lease is not None else "")
                                + ", ".join(self._describe(m) for m in machines))
            if lease is None:
                allocation.instances = machines
                self._wait_for_agents(allocation, deadline, cancel)
            else:
                lease.instances = machines
                self._assign(allocation, deadline, cancel)
            key = lease.folder.key if lease is not None else allocation.folder.key
            self._take_pack_offers(allocation, launch_id, key, machines)
        except BaseException:
            self._give_back(allocation)
            raise
        return allocation

    #: what acquire tracks a job's machines in (a cloud may add fields)
    allocation_type: type[RemoteAllocation] = RemoteAllocation

    def _new_allocation(self, request: RemoteRequest, folder: "JobFolder") -> RemoteAllocation:
        return self.allocation_type(request=request, folder=folder, nodes=[], started=time.time(),
                                    progress=Progress(self.name, request.run_id))

    def _requested_text(self, request: RemoteRequest) -> str:
        return f"{request.plan.nodes} node(s)"

    #: whether node 0 packs the packages it installed into the store for later boots (EC2: a setting)
    packs_environments = False

    def _ship_environment(self, allocation: RemoteAllocation) -> None:
        """The files and manifest of the job's environment, in the store before any machine boots
        (content-addressed: what an earlier job shipped is not uploaded again)."""
        from prefect_sgpu.environment import ship as environment_ship

        environment = allocation.request.spec.environment
        if not (self.ships_environment and environment_ship.builds_on_node(environment)):
            return
        started = time.monotonic()
        shipped = environment_ship.ship(self.store, environment)
        allocation.progress("environment", f"{environment.digest[:16]}: {shipped['uploaded']} file(s) uploaded "
                            f"({shipped['bytes']} bytes), {shipped['skipped']} already in the store, "
                            f"{time.monotonic() - started:.1f}s")

    def _take_pack_offers(self, allocation: RemoteAllocation, folder_id: str, key: str, machines: list) -> None:
        """Record the environment packs the new machines' stages offered (node 0, building cold), now:
        every agent is up and no rank has run (ranks hold the key that seals an offer)."""
        from prefect_sgpu.environment import ship as environment_ship

        environment = allocation.request.spec.environment
        if not (self.ships_environment and self.packs_environments and environment_ship.builds_on_node(environment)):
            return
        try:
            recorded = environment_ship.take_offers(self.store, environment, folder_id, key, [m.id for m in machines])
        except Exception as exc:  # noqa: BLE001 - a pack only saves later boots time
            logger.warning("job %s: environment packs were not recorded (%s: %s)", allocation.run_id,
                           type(exc).__name__, exc)
            return
        if recorded:
            allocation.progress("environment", f"{environment.digest[:16]}: recorded the pack "
                                f"{', '.join(recorded)} for later boots")

    def _setup_output(self, allocation: RemoteAllocation, machine_id: str, limit: int = 4000) -> str:
        """What the node's environment stage wrote when it failed (``setup/<machine>.log`` in the folder the
        user-data named), as text for the error; "" when nothing. Written by the node: shown, never acted on."""
        folder = allocation.lease.lease_id if allocation.lease is not None else allocation.run_id
        try:
            data = self.store.get(folder, f"setup/{machine_id}.log")
        except Exception:  # noqa: BLE001 - the error is raised without it
            logger.debug("no setup output of %s", machine_id, exc_info=True)
            return ""
        if not data:
            return ""
        return f"; {machine_id}'s environment setup said:\n" + data[-limit:].decode("utf-8", "replace").strip()

    # -- warm leases ------------------------------------------------------------------

    def _take_warm(self, allocation: RemoteAllocation, deadline: float, cancel: threading.Event) -> bool:
        """An idle warm lease of the job's shape, its nodes assigned the job and up in its folder (True);
        False when there is none, or when its nodes did not take the job up in time (it is given up)."""
        lease = POOL.take(self._lease_key(allocation.request), owner=id(self))
        if lease is None:
            return False
        allocation.lease = lease
        allocation.progress("warm", f"lease {lease.lease_id}: {len(lease.instances)} machine(s) kept from "
                            f"an earlier job ({lease.jobs} so far)")
        try:
            self._assign(allocation, deadline, cancel, timeout=min(self.agent_timeout_s, WARM_TAKEUP_S))
            return True
        except (LaunchTimeout, ProvisioningError) as exc:
            if cancel.is_set() or time.monotonic() >= deadline:
                raise
            logger.warning("job %s: warm lease %s did not take the job up (%s); launching new "
                           "machines", allocation.run_id, lease.lease_id, exc)
            allocation.lease = None
            POOL.discard(lease)
            return False

    def _new_lease(self, allocation: RemoteAllocation) -> WarmLease:
        """A new lease for the job's machines, in the pool, its key written and its heartbeat beating
        before any machine exists."""
        request = allocation.request
        assert isinstance(request, RemoteRequest)
        lease = WarmLease(key=self._lease_key(request), folder=JobFolder(self.store, request.lease_id, new_key()),
                          instances=[], provisioner=self.provisioner, node_silence_s=self.node_silence_s)
        allocation.lease = lease
        POOL.add(lease, owner=id(self))
        self._prepare_lease(allocation, lease)
        self._put_secret(lease, ssm_key_parameter(lease.lease_id, self.store.scope), lease.folder.key,
                         "prefect-sgpu key of one warm lease (deleted when the lease ends)", "key_parameter")
        lease.start_beating()
        return lease

    def _assign(self, allocation: RemoteAllocation, deadline: float, cancel: threading.Event,
                timeout: float | None = None) -> None:
        """The lease's nodes serve this job next: one sealed assignment each, then their alive documents
        in the job's folder."""
        lease = allocation.lease
        assert lease is not None
        allocation.instances = list(lease.instances)
        self._grant(allocation, lease)
        seq = lease.assign(allocation.run_id, gang=allocation.folder.gang)  # the job's stop is bound to it
        logger.debug("job %s: assignment %d of lease %s written", allocation.run_id, seq, lease.lease_id)
        self._wait_for_agents(allocation, deadline, cancel, timeout)

    def close(self) -> None:
        """End the idle warm leases this compute used last (a task runner does at flow end);
        ones in a job end when it gives them back."""
        POOL.close(owner=id(self))

    # -- nodes up -----------------------------------------------------------------------

    def _agent_timeout(self, allocation: RemoteAllocation) -> float:
        """Seconds the agents of ``allocation``'s machines get to come up once they run (a cloud may
        scale it with the machine type)."""
        return self.agent_timeout_s

    def _wait_for_agents(self, allocation: RemoteAllocation, deadline: float, cancel: threading.Event,
                         timeout: float | None = None) -> None:
        """Every node's bootstrap has announced itself (a sealed alive document of its machine).

        Ends at the job's deadline or after ``agent_timeout_s``, whichever is first
        (``LaunchTimeout``, phase "agent start"). An alive document that is not sealed
        by this job for this node and machine is refused (logged) and waited past. A node whose
        versions cannot run the driver's calls ends the wait at once (``EnvironmentMismatch``).
        """
        run_id, instances = allocation.run_id, allocation.instances
        if not allocation.plan.min_nodes <= len(instances) <= allocation.plan.nodes:  # elastic: min to max
            raise ProvisioningError(f"job {run_id}: asked for {allocation.plan.nodes} machine(s), got {len(instances)}")
        own_timeout = self._agent_timeout(allocation) if timeout is None else timeout
        own_limit = time.monotonic() + own_timeout  # from "running": provisioning returned running machines
        limit = min(deadline, own_limit)
        up: set[int] = set()
        last_state_check = 0.0
        while True:
            listed = allocation.folder.node_documents()  # one listing a pass; a read only for what appeared
            for index, inst in enumerate(instances):
                if index in up or alive_key(index) not in listed:
                    continue
                alive = allocation.folder.alive(index, instance_id=inst.id)
                if alive is None:
                    continue
                differ = differences(runtime_versions(), alive.versions)
                if differ:  # before any rank starts: the job fails now, with both sides named
                    raise EnvironmentMismatch(run_id, index, inst.id, differ)
                up.add(index)
                if alive.ready >= allocation.started:  # booted for this job (a warm lease's nodes were not)
                    timeline.record(run_id, "environment ready", index, alive.ready, inst.id)
                allocation.progress("agent up", f"node {index} on {inst.id} ({len(up)}/{len(instances)})", index)
            if len(up) == len(instances):
                break
            if cancel.is_set():
                raise JobCancelled(f"job {run_id} was cancelled while its nodes booted; they are terminated")
            now = time.monotonic()
            if now > limit:
                missing = [instances[i].id for i in range(len(instances)) if i not in up]
                waited = allocation.request.spec.timeout if deadline <= own_limit else own_timeout
                logger.error("job %s: no node agent on %s after %gs", run_id, missing, waited)
                raise LaunchTimeout(run_id, waited, phase="agent start")
            if now - last_state_check > 5.0:
                last_state_check = now
                dead = {k: v for k, v in self.provisioner.instance_states([i.id for i in instances]).items()
                        if v in self.provisioner.dead_states}
                if dead:
                    first = sorted(dead)[0]
                    raise ProvisioningError(f"job {run_id}: machine(s) {dead} went away while booting"
                                            + self._setup_output(allocation, first) + self._console_tail(first))
            cancel.wait(0.5)
        # addresses from the cloud's API (the provisioner), never from what a node wrote
        allocation.nodes = [AllocatedNode(index=i, address=inst.private_ip, host=inst.id, instance_id=inst.id)
                            for i, inst in enumerate(instances)]

    def rendezvous_endpoint(self, allocation: Allocation) -> str:
        """Node 0's private address (from the cloud) and the configured port: no port can be probed remotely."""
        endpoint = f"{allocation.nodes[0].address}:{self.rendezvous_port}"
        if isinstance(allocation, RemoteAllocation) and allocation.progress:
            allocation.progress("rendezvous", f"c10d on node 0 at {endpoint}")
        return endpoint

    # -- replacing a lost node -----------------------------------------------------------

    #: whether this cloud can launch one machine in place of a lost node (:meth:`_provision_node`)
    replaces_nodes = False

    def _provision_node(self, allocation: RemoteAllocation, node: int, deadline: float,
                        cancel: threading.Event) -> Machine:
        """One machine launched alone for node ``node`` of gang ``allocation.folder.gang`` of the job (on a
        warm lease: for the lease, ``allocation.lease``), running. Errors as :meth:`_provision`'s."""
        raise NotImplementedError

    def replace_nodes(self, allocation: Allocation, lost: set[int], request: Request, deadline: float,
                      cancel: threading.Event) -> Released | None:
        """The lost machines are ended and a new one launched for each (same node index); the others are
        kept: each reported its end and its machine runs. A cold job's kept nodes are told, by a sealed
        rejoin document bound to node and machine, to serve the next gang in the same folder (the
        driver reset it: ``JobFolder.reset_for_relaunch``); on a warm lease the new machine joins the
        lease and every node of the lease is assigned the next gang. Every node announces itself again.
        A job whose kept nodes did not all report or whose machines are gone is not replaced node by
        node (None)."""
        from prefect_sgpu.protocol.jobfolder import Rejoin

        assert isinstance(allocation, RemoteAllocation) and isinstance(request, RemoteRequest)
        kept = [n for n in allocation.nodes if n.index not in lost]
        if not self.replaces_nodes or not kept or not lost:
            return None
        states = self.provisioner.instance_states([n.instance_id or "" for n in kept])
        unfit = [n.index for n in kept if n.index not in allocation.reported
                 or states.get(n.instance_id or "") in (None, *self.provisioner.dead_states)]
        if unfit:
            logger.info("job %s: node(s) %s did not end cleanly: the whole gang is replaced", allocation.run_id, unfit)
            return None
        retired = [allocation.instances[i] for i in sorted(lost)]
        gone = self.provisioner.terminate_machines([m.id for m in retired])
        cost = None
        try:
            cost = allocation.cost(self.provisioner, retired, time.time())
        except Exception:  # noqa: BLE001 - a missing price must not stop the recovery
            logger.warning("could not estimate the cost of job %s's lost machines", allocation.run_id, exc_info=True)
        allocation.retired += retired
        allocation.request = request
        for index in sorted(lost):
            launched = time.time()
            machine = self._provision_node(allocation, index, deadline, cancel)
            allocation.instances[index], allocation.joined[machine.id] = machine, launched
            if allocation.lease is not None:
                allocation.lease.instances[index] = machine
            allocation.progress("running", f"node {index} on {self._describe(machine)}, in place of {retired[0].id}"
                                if len(retired) == 1 else f"node {index} on {self._describe(machine)}", index)
        allocation.announced, allocation.reported, allocation.noticed = set(), set(), set()  # of the gang before
        allocation.notice_version = {}
        allocation.alive_version, allocation.alive_changed, allocation.states = {}, {}, {}
        allocation.launched, allocation.lost, allocation.polled, allocation.states_checked = False, False, 0.0, 0.0
        if allocation.lease is not None:
            self._assign(allocation, deadline, cancel)  # the kept nodes went back to the lease's folder
        else:
            allocation.folder.put_rejoins({n.index: (Rejoin(gang=allocation.folder.gang), n.instance_id)
                                           for n in kept})
            self._wait_for_agents(allocation, deadline, cancel)
        return Released(gone=gone, cost=cost)

    # -- running ------------------------------------------------------------------------

    def start(self, allocation: Allocation, launch: JobLaunch) -> None:
        """One sealed launch document per node, bound to its index and its machine, all in one write."""
        assert isinstance(allocation, RemoteAllocation)
        env = {k: v for k, v in launch.env.items() if k not in MASKED_ENV}  # the key travels as a secret only
        env.update(self._launch_env(allocation))
        if launch.secrets:  # encrypted beside the key; the documents only say they exist
            self._put_secret(allocation, ssm_secrets_parameter(allocation.run_id, self.store.scope), json.dumps(launch.secrets),
                             "prefect-sgpu secrets= of one job (deleted when the job ends)", "secrets_parameter")
        allocation.folder.put_launches({
            command.node: (LaunchDocument(argv=list(command.argv), env=env, secrets=bool(launch.secrets),
                                          gang=allocation.folder.gang),
                           allocation.instance_id(command.node))
            for command in launch.commands})
        allocation.launched = True

    def _put_index_secret(self, owner: Any, launch_id: str, request: RemoteRequest) -> None:
        """The environment's index URLs with their credentials, in the SecureString the machines of
        ``launch_id`` read at boot (before the job's ``secrets=`` exist: ``start`` writes both later)."""
        from prefect_sgpu.environment import ship as environment_ship

        if not self.ships_environment:
            return
        values = environment_ship.index_secret(request.spec.environment)
        if values:
            self._put_secret(owner, ssm_secrets_parameter(launch_id, self.store.scope), json.dumps(values),
                             "prefect-sgpu secrets= of one job (deleted when the job ends)", "secrets_parameter")

    def _put_key(self, allocation: RemoteAllocation) -> None:
        self._put_secret(allocation, ssm_key_parameter(allocation.run_id, self.store.scope), allocation.folder.key,
                         "prefect-sgpu job key of one job (deleted when the job ends)", "key_parameter")

    def _put_secret(self, owner: Any, name: str, value: str, description: str, field: str) -> None:
        """A secret, recorded on its owner (the allocation, or a lease) *before* the put, so that
        even a failed put is cleaned up by release or close."""
        setattr(owner, field, name)
        self.provisioner.put_secret(name, value, description, self.kms_key_id)

    def poll(self, allocation: Allocation) -> list[Event]:
        """Sealed node statuses; a node whose machine died or went silent is lost."""
        assert isinstance(allocation, RemoteAllocation)
        now = time.monotonic()
        events: list[Event] = []
        for node in allocation.nodes:
            if node.index not in allocation.announced:
                allocation.announced.add(node.index)
                events.append(NodeUp(node.index, f"{node.instance_id} ({node.address})"))
        if now - allocation.polled < self.poll_interval_s:
            return events
        allocation.polled = now
        pending = [n for n in allocation.nodes if n.index not in allocation.reported]
        if now - allocation.states_checked > max(5.0, self.poll_interval_s):
            allocation.states_checked = now
            allocation.states = self.provisioner.instance_states([n.instance_id or "" for n in allocation.nodes])
        # one listing a pass for every node: statuses and notices are read only once they appear,
        # and a node is alive while its alive document's version keeps changing (no read at all)
        listed = allocation.folder.node_documents() if pending else {}
        for node in pending:
            iid = node.instance_id or ""
            status = note_status(allocation.lease, node.index, allocation.folder.status(node.index, instance_id=iid)
                                 if status_key(node.index) in listed else None)
            if status is not None:
                allocation.reported.add(node.index)
                events.append(NodeExited(node.index, status.exit_code, status))
                continue
            state = allocation.states.get(iid)
            if state in self.provisioner.dead_states:
                allocation.reported.add(node.index)
                allocation.lost = True
                events.append(NodeLost(node.index, f"instance {iid} is {state} (lost or reclaimed) before "
                                                   "its ranks finished"))
                continue
            key = notice_key(node.index)
            if (node.index not in allocation.noticed and key in listed
                    and (node.index not in allocation.notice_version
                         or listed[key] != allocation.notice_version[node.index])):
                allocation.notice_version[node.index] = listed[key]
                notice = allocation.folder.notice(node.index, instance_id=iid)
                if notice is not None and notice.reclaim:
                    allocation.noticed.add(node.index)
                    allocation.lost = True
                    events.append(NodeNotice(node.index, f"{iid}: {notice.text}"))
                elif notice is not None:  # a rebalance recommendation: a warning, the node is not lost
                    events.append(NodeNotice(node.index, f"{iid}: {notice.text}", reclaim=False))
            version = listed.get(alive_key(node.index))
            if version != allocation.alive_version.get(node.index) or node.index not in allocation.alive_changed:
                allocation.alive_version[node.index], allocation.alive_changed[node.index] = version, now
            elif now - allocation.alive_changed[node.index] > self.node_silence_s:
                allocation.reported.add(node.index)
                allocation.lost = True
                events.append(NodeLost(node.index, f"node {node.index} ({iid}) has not reported for "
                                                   f"{self.node_silence_s:g}s"))
        return events

    def stop(self, allocation: Allocation, grace: float = 10.0) -> None:
        """Write the sealed stop document; wait (grace + sync time) for every live node to report."""
        assert isinstance(allocation, RemoteAllocation)
        folder = allocation.folder

        def pending(nodes: list[AllocatedNode]) -> list[AllocatedNode]:  # one listing, reads for what appeared
            listed = folder.node_documents()
            return [n for n in nodes if status_key(n.index) not in listed
                    or note_status(allocation.lease, n.index, folder.status(n.index, instance_id=n.instance_id)) is None]

        if not allocation.launched:
            return
        left = pending(allocation.nodes)
        if not left:
            allocation.reported |= {n.index for n in allocation.nodes}
            return
        folder.put_stop(grace, reason="stopped by the driver")
        deadline = time.monotonic() + grace + 10.0
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            states = self.provisioner.instance_states([n.instance_id or "" for n in left])
            dead = {n.index for n in left if states.get(n.instance_id or "") in self.provisioner.dead_states}
            allocation.lost = allocation.lost or bool(dead)
            left = [n for n in pending(left) if n.index not in dead]
        # every node that reported (a warm lease needs all of them to serve another job)
        allocation.reported |= {n.index for n in allocation.nodes} - {n.index for n in left}

    def running_cost(self, allocation: Allocation) -> dict[str, Any] | None:  # launch until now
        return allocation.cost(self.provisioner, allocation.instances, time.time())  # type: ignore[attr-defined]

    # -- giving back --------------------------------------------------------------------

    def release(self, allocation: Allocation) -> Released:
        """End the machines and delete the job's secrets; the second call returns the first's result."""
        assert isinstance(allocation, RemoteAllocation)
        with self._lock:
            if allocation.outcome is not None:
                return allocation.outcome
            allocation.released = True
        released = self._give_back(allocation)
        cost = None
        try:
            cost = allocation.cost(self.provisioner, allocation.instances, time.time())
        except Exception:  # noqa: BLE001 - a missing price must not hide the job's outcome
            logger.warning("could not estimate the cost of job %s", allocation.run_id, exc_info=True)
        released.cost = cost
        if allocation.progress:
            allocation.progress("kept warm" if allocation.kept else "terminated", cost_text(cost))
        allocation.outcome = released
        return released

    def _give_back(self, allocation: RemoteAllocation) -> Released:
        """Everything acquire took (machines, the job's secrets, what ``_prepare`` made), on every
        path. A warm lease goes back to the pool only after a job every node of which reported its end."""
        gone: list[str] = []
        try:
            lease, allocation.lease = allocation.lease, None
            if lease is None:
                gone += self.provisioner.terminate(allocation.run_id)
            elif (allocation.launched and not allocation.lost and lease.healthy()
                  and allocation.reported >= {n.index for n in allocation.nodes} and self._revoked(allocation, lease)):
                POOL.give_back(lease, self.keep_warm)
                allocation.kept = True
            else:
                lease.mark_unfit("its last job did not end cleanly on every node")
                POOL.discard(lease)
                gone += [i.id for i in lease.instances]
        finally:
            for name in (allocation.key_parameter, allocation.secrets_parameter):
                if name and self.provisioner.delete_secret(name):
                    gone.append(f"SSM parameter {name}")
            gone += self._cleanup(allocation)  # after the machines: their nodes use it until they end
        return Released(gone=gone)

    def _revoked(self, allocation: RemoteAllocation, lease: WarmLease) -> bool:
        """:meth:`_revoke`; a lease whose job could not be taken back serves no other job."""
        try:
            self._revoke(allocation, lease)
            return True
        except Exception as exc:  # noqa: BLE001 - the lease ends instead
            lease.mark_unfit(f"job {allocation.run_id}'s access could not be taken back ({type(exc).__name__}: {exc})")
            return False
