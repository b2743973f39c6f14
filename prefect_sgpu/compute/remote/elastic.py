"""Elastic jobs on machines of their own: start at min nodes, grow as the cloud's capacity arrives.

GPU capacity comes in pieces: a launch for max machines often gets some of them now and the rest
minutes or hours later. An elastic job (``nodes=(min, max)``) asks for max; its first launch
succeeds with min or more (the cloud's own "as many as you can, at least min"), and the job starts
once those nodes announced themselves. For each node it still lacks, :class:`Growth`, on a thread
of its own, launches one machine alone (the compute's ``_provision_node``: the same user-data,
environment stage and node agent as the others, the cloud's failover over subnets and markets),
retrying with :func:`prefect_sgpu.retry.retrying` while the cloud says it has no capacity, for the
compute's ``elastic_seek_s`` or until the job ends. A machine that runs and announced itself
joins the job: it becomes the allocation's next node, gets its launch document (the driver's
``JobLaunch.node_command``), and its node agent joins the torch elastic rendezvous, whose running
nodes restart their ranks in the larger world at the next round. The wait for the rest before the
first round is the rendezvous' own last call (``PREFECT_SGPU_ELASTIC_WAIT_S``): a node that joins
meanwhile is in the first round.

Nodes are sought one at a time, in index order, so a job's machines stay in node order. Every
machine the search launched is ended with the job (release stops the search first, then ends
everything launched for the run), and its cost counts from its own launch. A replacement of lost
nodes stops the search and starts it again for the new gang. :class:`ElasticNodes` is the part a
remote-node compute mixes in; the cloud says which launch failures mean "no capacity yet"
(``_capacity_short``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from prefect_sgpu import retry
from prefect_sgpu.compute.base import AllocatedNode, Allocation, JobLaunch, NodeCommand, Released, Request
from prefect_sgpu.compute.remote.allocation import RemoteAllocation
from prefect_sgpu.protocol.jobfolder import alive_key
from prefect_sgpu.protocol.versions import differences, runtime_versions

if TYPE_CHECKING:
    from prefect_sgpu.compute.remote.provider import Machine
    from prefect_sgpu.protocol.jobfolder import JobFolder

logger = logging.getLogger("prefect_sgpu.compute.remote.elastic")

#: backoff between launches of a missing node while the cloud has no capacity: AWS's advice for
#: InsufficientInstanceCapacity is to wait a few minutes and try again (EC2 User Guide,
#: "Troubleshoot instance launch issues: Insufficient instance capacity")
SEEK_BASE_S = 30.0
SEEK_CAP_S = 300.0
SEEK_FLOOR_S = 30.0
#: seconds a stop of the search may wait for its thread (an in-flight launch ends what it started)
STOP_WAIT_S = 120.0


class _StopAware(retry.Clock):
    """:data:`retry.CLOCK`, read at every call, whose sleeps end early once ``stop`` is set."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop

    def monotonic(self) -> float:
        return retry.CLOCK.monotonic()

    def sleep(self, seconds: float) -> None:
        end = retry.CLOCK.monotonic() + seconds
        while not self.stop.is_set():
            left = end - retry.CLOCK.monotonic()
            if left <= 0:
                return
            retry.CLOCK.sleep(min(left, 1.0))


class Growth:
    """The search for an elastic job's missing nodes ``missing`` (see the module docstring)."""

    def __init__(self, compute: "ElasticNodes", allocation: RemoteAllocation, missing: list[int],
                 deadline: float, in_place: bool = False) -> None:
        self.compute, self.allocation, self.missing, self.deadline = compute, allocation, missing, deadline
        #: the nodes sought are lost nodes of a running job: a machine that comes takes its node's place
        self.in_place = in_place
        self.stop = threading.Event()
        #: set once the allocation's first nodes are up (acquire, or a replacement, returned): from then
        #: on a machine that announced itself joins the job
        self.open = threading.Event()
        #: the job's launch (``start``): what a joining node's launch document is made from
        self.launch: JobLaunch | None = None
        #: the machine launched for the next node, not yet the allocation's
        self.pending: "Machine | None" = None
        self.joined: list[int] = []
        #: how the search ended ("" while it runs)
        self.outcome = ""
        #: the cost of machines the search launched and ended itself, not yet in a release's
        self.spent: dict[str, Any] | None = None
        self._until = retry.CLOCK.monotonic() + compute.elastic_seek_s
        self.thread = threading.Thread(target=self._run, name=f"sgpu-grow-{allocation.run_id}", daemon=True)

    def start(self) -> "Growth":
        self.thread.start()
        return self

    def close(self) -> None:
        """Stop the search and wait for its thread (a launch in flight ends what it started)."""
        self.stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(STOP_WAIT_S)
            if self.thread.is_alive():
                logger.warning("job %s: the search for more nodes did not stop within %gs",
                               self.allocation.run_id, STOP_WAIT_S)
        self.outcome = self.outcome or "stopped with the job"

    def _say(self, phase: str, text: str, node: int | None = None) -> None:
        if self.allocation.progress:
            self.allocation.progress(phase, text, node)

    def _run(self) -> None:
        try:
            for node in self.missing:
                machine = self._seek(node)
                if machine is None or not self._announced(node, machine):
                    return
                while not self.open.wait(0.5):
                    if self.stop.is_set():
                        return
                if not self.compute._join_node(self.allocation, node, machine, self):
                    return
                self.joined.append(node)
            self.outcome = f"every node up ({len(self.allocation.nodes)})"
        except Exception as exc:  # noqa: BLE001 - the job goes on with the nodes it has
            self.outcome = f"failed: {type(exc).__name__}: {exc}"
            logger.exception("job %s: the search for more nodes failed", self.allocation.run_id)

    def _seek(self, node: int) -> "Machine | None":
        """A running machine for ``node``, launched alone; None when the search stops or gives up."""
        run_id = self.allocation.run_id

        def launch() -> "Machine":
            launched = time.time()
            machine = self.compute._provision_node(self.allocation, node, self.deadline, self.stop)
            self.allocation.joined[machine.id] = launched  # its cost counts from its own launch
            self.pending = machine
            return machine

        def transient(exc: BaseException) -> bool:
            return not self.stop.is_set() and self.compute._capacity_short(exc)

        budget = self._until - retry.CLOCK.monotonic()
        try:
            if budget <= 0:
                raise TimeoutError(f"elastic_seek_s={self.compute.elastic_seek_s:g} passed")
            machine = retry.retrying(launch, transient=transient, budget_s=budget, base_s=SEEK_BASE_S,
                                     cap_s=SEEK_CAP_S, floor_s=SEEK_FLOOR_S, clock=_StopAware(self.stop),
                                     what=f"job {run_id}: capacity for node {node}", log=logger.info)
        except BaseException as exc:  # noqa: BLE001 - the job goes on with the nodes it has
            if self.stop.is_set():
                return None
            self.outcome = f"gave up on node {node}: {type(exc).__name__}: {exc}"
            logger.warning("job %s: no machine for node %d (%s); the job goes on with %d node(s)", run_id, node,
                           self.outcome, len(self.allocation.nodes) or node)
            self._say("provisioning", f"node {node}: {self.outcome}")
            return None
        self._say("running", f"node {node} on {self.compute._describe(machine)}: joins the elastic job", node)
        return machine

    def _announced(self, node: int, machine: "Machine") -> bool:
        """The machine's node announced itself in the job's folder (a sealed alive document of its own),
        with versions that can run the driver's calls; else it is ended and the search stops."""
        folder: "JobFolder" = self.allocation.folder
        limit = time.monotonic() + self.compute._agent_timeout(self.allocation)
        why = ""
        checked = 0.0
        while not self.stop.is_set():
            alive = None
            try:
                if alive_key(node) in folder.node_documents():
                    alive = folder.alive(node, instance_id=machine.id)
            except Exception as exc:  # noqa: BLE001 - a refused or unreadable document is waited past
                logger.debug("job %s: node %d's alive document: %s", self.allocation.run_id, node, exc)
            if alive is not None:
                differ = differences(runtime_versions(), alive.versions)
                if not differ:
                    self._say("agent up", f"node {node} on {machine.id} (joins at the next round)", node)
                    return True
                why = f"its versions differ from the driver's: {differ}"
                break
            now = time.monotonic()
            if now > limit:
                why = f"no node agent after {self.compute._agent_timeout(self.allocation):g}s"
                break
            if now - checked > 5.0:
                checked = now
                state = self.compute.provisioner.instance_states([machine.id]).get(machine.id)
                if state in self.compute.provisioner.dead_states:
                    why = f"it is {state}"
                    break
            self.stop.wait(1.0)
        if self.stop.is_set():
            return False
        self.outcome = f"node {node} on {machine.id} did not join: {why}"
        logger.warning("job %s: %s; it is ended and the job goes on without it", self.allocation.run_id, self.outcome)
        self.compute._end_pending(self.allocation, self)
        return False


class ElasticNodes:
    """What a :class:`~prefect_sgpu.compute.remote.nodes.RemoteNodeCompute` mixes in (listed before it) to
    run elastic jobs: a :class:`Growth` for the nodes the first launch did not get, joined as they come.

    The cloud provides ``_provision_node`` (one machine for one node, running) and says which of its
    failures mean "no capacity yet" (:meth:`_capacity_short`); ``elastic_seek_s`` bounds the search."""

    #: seconds an elastic job's search for its missing nodes goes on (at most until the job ends)
    elastic_seek_s: float = 0.0

    def _capacity_short(self, exc: BaseException) -> bool:
        """Whether a failed launch of one machine means the cloud has no capacity now (worth a later try)."""
        return False

    def _wait_for_agents(self, allocation: RemoteAllocation, deadline: float, cancel: threading.Event,
                         timeout: float | None = None) -> None:
        """As the wing waits for its nodes; an elastic job that has fewer than max machines starts
        seeking the rest first, while these boot."""
        plan = allocation.plan
        if plan.elastic and allocation.lease is None and len(allocation.instances) < plan.nodes \
                and self.elastic_seek_s > 0:
            missing = list(range(len(allocation.instances), plan.nodes))
            previous = allocation.growth
            allocation.growth = Growth(self, allocation, missing, deadline)
            allocation.growth.spent = previous.spent if previous is not None else None
            allocation.progress("provisioning", f"{len(allocation.instances)} of {plan.nodes} node(s) launched; "
                                f"seeking node(s) {missing} for up to {self.elastic_seek_s:g}s")
            allocation.growth.start()
        super()._wait_for_agents(allocation, deadline, cancel, timeout)  # type: ignore[misc]

    def acquire(self, request: Request, folder: "JobFolder", deadline: float,
                cancel: threading.Event) -> RemoteAllocation:
        allocation = super().acquire(request, folder, deadline, cancel)  # type: ignore[misc]
        if allocation.growth is not None:
            allocation.growth.open.set()
        return allocation

    def start(self, allocation: Allocation, launch: JobLaunch) -> None:
        """As the wing starts its nodes; an elastic job's launch is kept for the nodes that join later,
        and nodes that joined since the driver made it get theirs too."""
        assert isinstance(allocation, RemoteAllocation)
        with self._lock:  # type: ignore[attr-defined]
            growth = allocation.growth
            if growth is not None:
                growth.launch = launch
                launch = self._every_node(allocation, launch)
            launch = self._on_new_machines(allocation, launch)
            super().start(allocation, launch)  # type: ignore[misc]
            for command in launch.commands:  # a put-back node's agent is up anew once its machine announces it
                if command.node in allocation.put_back and allocation.launched:
                    allocation.announced.discard(command.node)

    @staticmethod
    def _on_new_machines(allocation: RemoteAllocation, launch: JobLaunch) -> JobLaunch:
        """The commands of nodes put back on a new machine, made for its address (the driver's were
        made for the lost machine's)."""
        if not allocation.put_back or launch.node_command is None:
            return launch
        address = {n.index: n.address for n in allocation.nodes}
        return replace(launch, commands=[launch.node_command(c.node, address[c.node])
                                         if c.node in allocation.put_back else c for c in launch.commands])

    @staticmethod
    def _every_node(allocation: RemoteAllocation, launch: JobLaunch) -> JobLaunch:
        have = {c.node for c in launch.commands}
        extra: list[NodeCommand] = []
        for node in allocation.nodes:
            if node.index not in have and launch.node_command is not None:
                extra.append(launch.node_command(node.index, node.address))
        return replace(launch, commands=[*launch.commands, *extra]) if extra else launch

    def _join_node(self, allocation: RemoteAllocation, node: int, machine: "Machine", growth: Growth) -> bool:
        """``machine`` becomes node ``node`` of the allocation; with the job started, every node's launch
        document is written again with the new one's (the running nodes read theirs once)."""
        if growth.in_place:
            return self._put_back(allocation, node, machine, growth)
        with self._lock:  # type: ignore[attr-defined]
            if growth.stop.is_set() or allocation.released or len(allocation.instances) != node:
                return False
            allocation.instances.append(machine)
            allocation.nodes = [*allocation.nodes, AllocatedNode(index=node, address=machine.private_ip,
                                                                 host=machine.id, instance_id=machine.id)]
            growth.pending = None
            if allocation.launched and growth.launch is not None:
                if growth.launch.node_command is None:
                    logger.warning("job %s: its launch cannot start a node that joins late", allocation.run_id)
                    return False
                super().start(allocation, self._every_node(allocation, growth.launch))  # type: ignore[misc]
        logger.info("job %s: node %d (%s) joined; %d node(s) now", allocation.run_id, node, machine.id,
                    len(allocation.nodes))
        return True

    def _put_back(self, allocation: RemoteAllocation, node: int, machine: "Machine", growth: Growth) -> bool:
        """``machine`` takes lost node ``node``'s place; what polling saw of the lost one is forgotten."""
        with self._lock:  # type: ignore[attr-defined]
            if growth.stop.is_set() or allocation.released or not 0 < node < len(allocation.nodes):
                return False
            allocation.instances[node] = machine
            allocation.nodes = [AllocatedNode(index=node, address=machine.private_ip, host=machine.id,
                                              instance_id=machine.id) if n.index == node else n
                                for n in allocation.nodes]
            growth.pending = None
            allocation.put_back.add(node)
            allocation.reported.discard(node)
            allocation.noticed.discard(node)
            for seen in (allocation.notice_version, allocation.alive_version, allocation.alive_changed):
                seen.pop(node, None)
        logger.info("job %s: node %d is back on %s", allocation.run_id, node, machine.id)
        return True

    def replace_elastic_node(self, allocation: Allocation, node: int, request: Request, deadline: float,
                             cancel: threading.Event) -> Released | None:
        """The lost node's machine is ended and priced, and one machine is sought for its index by a
        :class:`Growth` of its own (the same user-data, stage and agent, zone, subnets and markets, retried
        while the cloud has no capacity, for ``elastic_seek_s`` or until the job ends). Returns once the new
        machine announced itself and took the node's place; the driver then starts its agent. None on a
        warm lease, with ``elastic_seek_s=0``, or after release; a search that gives up raises
        ``ProvisioningError`` (the job goes on with the nodes it has)."""
        from prefect_sgpu.errors import ProvisioningError

        assert isinstance(allocation, RemoteAllocation)
        with self._lock:  # type: ignore[attr-defined]
            if (allocation.released or allocation.lease is not None or self.elastic_seek_s <= 0
                    or not 0 < node < len(allocation.instances) or node in allocation.replacing):
                return None
            lost = allocation.instances[node]
            search = allocation.replacing[node] = Growth(self, allocation, [node], deadline, in_place=True)
        search.open.set()
        gone = self.provisioner.terminate_machines([lost.id])  # type: ignore[attr-defined]
        cost = None
        try:
            cost = allocation.cost(self.provisioner, [lost], time.time())  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - prices are optional
            logger.warning("could not estimate the cost of %s", lost.id, exc_info=True)
        allocation.progress("provisioning", f"node {node}: {lost.id} lost; seeking its replacement for up to "
                            f"{self.elastic_seek_s:g}s while the job goes on", node)
        search.start()
        while search.thread.is_alive():
            search.thread.join(1.0)
            if cancel.is_set():
                search.close()
        with self._lock:  # type: ignore[attr-defined]
            allocation.replacing.pop(node, None)
            if node not in search.joined:
                if search.pending is not None:  # launched, not taken: ended with the job, costed there
                    allocation.instances.append(search.pending)
                    search.pending = None
                raise ProvisioningError(f"job {allocation.run_id}: node {node}: {search.outcome or 'stopped'}")
            allocation.retired.append(lost)
        return Released(gone=gone, cost=cost)

    def _end_pending(self, allocation: RemoteAllocation, growth: Growth) -> None:
        """End the machine the search launched and the job does not have; its cost is kept for the release."""
        machine, growth.pending = growth.pending, None
        if machine is None:
            return
        self.provisioner.terminate_machines([machine.id])  # type: ignore[attr-defined]
        try:
            cost = allocation.cost(self.provisioner, [machine], time.time())  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - prices are optional
            logger.warning("could not estimate the cost of %s", machine.id, exc_info=True)
            return
        from prefect_sgpu.compute.base import total_cost

        growth.spent = total_cost([growth.spent, cost])

    def _stop_growth(self, allocation: RemoteAllocation) -> Growth | None:
        growth = allocation.growth
        if growth is not None:
            growth.close()
        return growth

    def replace_nodes(self, allocation: Allocation, lost: set[int], request: Request, deadline: float,
                      cancel: threading.Event) -> Released | None:
        """As the wing replaces lost nodes; an elastic job's search stops first (a machine it launched and
        the job does not have yet is ended) and starts again, for the new gang, if nodes are still missing."""
        assert isinstance(allocation, RemoteAllocation)
        growth = self._stop_growth(allocation)
        if growth is not None:
            self._end_pending(allocation, growth)
        replaced = super().replace_nodes(allocation, lost, request, deadline, cancel)  # type: ignore[misc]
        if replaced is not None and allocation.growth is not None:
            allocation.growth.open.set()
        return replaced

    def _give_back(self, allocation: RemoteAllocation) -> Released:
        """The search stops before anything is ended: nothing it launches outlives the job; a machine
        it launched and the job does not have yet is ended with the rest, and costed with them."""
        growth = self._stop_growth(allocation)
        if growth is not None and growth.pending is not None:
            allocation.instances = [*allocation.instances, growth.pending]
            growth.pending = None
        for search in list(allocation.replacing.values()):  # a lost node's replacement being sought
            search.close()
            if search.pending is not None:
                allocation.instances = [*allocation.instances, search.pending]
                search.pending = None
        return super()._give_back(allocation)  # type: ignore[misc]

    def release(self, allocation: Allocation) -> Released:
        released = super().release(allocation)  # type: ignore[misc]
        growth = getattr(allocation, "growth", None)
        if growth is not None and growth.spent:
            from prefect_sgpu.compute.base import total_cost

            spent, growth.spent = growth.spent, None
            released.cost = total_cost([released.cost, spent])
        return released

    def running_cost(self, allocation: Allocation) -> dict[str, Any] | None:
        """Launch until now, a machine the search launched and the job does not have yet included."""
        assert isinstance(allocation, RemoteAllocation)
        pending = allocation.growth.pending if allocation.growth is not None else None
        machines = [*allocation.instances, *([pending] if pending is not None else [])]
        return allocation.cost(self.provisioner, machines, time.time())  # type: ignore[attr-defined]
