"""An elastic job's membership: which nodes serve it, round by round, and a lost node it goes on without.

An elastic job (``nodes=(min, max)``) that loses a node while the nodes left still meet ``min`` does
not stop: the survivors' torch elastic agents notice the lost agent once its rendezvous keep-alive
lapses (``PREFECT_SGPU_ELASTIC_LOST_AFTER_S``), meet again in the smaller world and start their ranks
again, which resume from the last checkpoint. Meanwhile a replacement is sought in the background
(:meth:`~prefect_sgpu.compute.base.Compute.replace_elastic_node`); it joins the next round when it
comes. The decision is here, in the driver, and knows no compute: a compute that cannot put a node
back (``None``) leaves the job on fewer nodes.

Where going on is not possible, :func:`goes_on` says so and the driver's recovery
(:mod:`prefect_sgpu.driver.recovery`) runs as for a fixed-size job: the nodes left are fewer than
``min``, the lost node is node 0 (its agent hosts the rendezvous: the others have no one to meet
at), or the job went on after ``max_recoveries`` losses already (each survivor's agent may start its
ranks again as many more times as ``max_recoveries`` allows, no more).

Every change is a :class:`MembershipChange`: the driver's listeners (the task run's
``prefect-sgpu.job.membership`` event and ``sgpu-<task>-membership`` table) hear it as it happens,
the job's timeline has it, and the result lists them all (``JobResult.membership``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from prefect_sgpu.compute.base import Allocation, JobLaunch, Request
from prefect_sgpu.driver.env_seconds import env_seconds

logger = logging.getLogger("prefect_sgpu.driver.job")

#: seconds after which the survivors' rendezvous counts a silent node's agent as gone
LOST_AFTER_ENV = "PREFECT_SGPU_ELASTIC_LOST_AFTER_S"
#: torch elastic's own: a keep-alive every 5 s, a node gone after 3 missed
DEFAULT_LOST_AFTER_S = 15


def lost_after_s() -> int:
    """``PREFECT_SGPU_ELASTIC_LOST_AFTER_S``, checked: whole seconds from 3 to 3600 (15 by default, torch's)."""
    return int(env_seconds(LOST_AFTER_ENV, DEFAULT_LOST_AFTER_S, "whole seconds from 3 to 3600 after which an elastic "
                           "job's other nodes count a silent node as gone (three missed keep-alives)",
                           low=3, high=3600, whole=True))


@dataclass
class MembershipChange:
    """One round of an elastic job as the driver sees it: the nodes serving from now on and why.

    ``round`` counts the driver's membership changes (0: the job's start); torch elastic's own round
    numbers (``runtime.membership_round()``) also count rendezvous the driver does not see."""

    round: int
    #: the nodes serving the job from this change on, by index
    nodes: list[int]
    #: ranks in the new world (nodes x ranks per node)
    world_size: int
    joined: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    #: wall time of the change
    at: float = 0.0
    #: the newest complete checkpoint step when the change was seen: where the new world resumes from
    from_step: int | None = None
    #: the step rank 0 last reported (``runtime.progress``) when the change was seen: the rounds before
    #: served the steps up to it
    step: int | None = None
    reason: str = ""

    def as_row(self) -> dict[str, Any]:
        return {"round": self.round, "nodes": ",".join(map(str, self.nodes)), "world_size": self.world_size,
                "joined": ",".join(map(str, self.joined)), "left": ",".join(map(str, self.left)),
                "from_step": self.from_step, "step": self.step, "reason": self.reason[:200],
                "at": time.strftime("%H:%M:%S", time.gmtime(self.at))}


class Membership:
    """One gang's membership, kept by the driver's loop: :meth:`lost` on a ``NodeLost``, :meth:`up` on
    a ``NodeUp``, :meth:`left` while it waits for the gang's end."""

    def __init__(self, job: Any, allocation: Allocation, request: Request, launch: JobLaunch,
                 deadline: float) -> None:
        self.job, self.allocation, self.request, self.launch = job, allocation, request, launch
        self.deadline = deadline
        plan = allocation.plan
        self.elastic = bool(plan.elastic)
        self.min_nodes, self.procs_per_node = plan.min_nodes, plan.procs_per_node
        self.serving: set[int] = {n.index for n in allocation.nodes}
        #: nodes gone that the job went on without, and not back yet
        self.gone: set[int] = set()
        #: replacements started, not yet up
        self.coming: set[int] = set()
        if self.elastic and not job.membership:
            self._record(sorted(self.serving), [], [], "the job's first nodes")

    def left(self) -> set[int]:
        """The nodes the job goes on without (not waited for)."""
        return set(self.gone)

    def lost(self, node: int, reason: str, exited: set[int]) -> bool:
        """Whether the job goes on without the lost ``node`` (recorded, a replacement sought); False:
        the gang's end is the loss, and the driver's recovery runs as for a fixed-size job."""
        if not self.elastic or node == 0:
            return False
        left = self.serving - {node} - exited
        if len(left) < self.min_nodes:
            return False
        went_on = sum(len(c.left) for c in self.job.membership)
        if went_on >= self.job.spec.max_recoveries:
            return False
        self.serving.discard(node)
        self.gone.add(node)
        job = self.job
        job.sink.warning(f"{job.call.name}: node {node} lost ({reason}); the job goes on with {len(self.serving)} "
                         f"node(s) (min {self.min_nodes}) from its last checkpoint while a replacement is sought")
        job.timeline.mark("node left", node, detail=reason[:200])
        self._record(sorted(self.serving), [], [node], reason)
        threading.Thread(target=self._replace, args=(node,), name=f"sgpu-replace-{job.run_id}-{node}",
                         daemon=True).start()
        return True

    def up(self, node: int) -> None:
        """A node's agent runs: a replacement coming back joins the next round."""
        if node not in self.coming:
            return
        self.coming.discard(node)
        self.gone.discard(node)
        self.serving.add(node)
        self.job.timeline.mark("node joined", node, detail="replacement")
        self.job.sink.info(f"{self.job.call.name}: node {node}'s replacement is up; it joins the job's next round "
                           f"({len(self.serving)} node(s))")
        self._record(sorted(self.serving), [node], [], "replacement joined")

    def _replace(self, node: int) -> None:
        """Seek ``node``'s replacement from the compute, and start its agent (it joins the next round)."""
        job = self.job
        try:
            released = job.compute.replace_elastic_node(self.allocation, node, self.request, self.deadline,
                                                        job.cancel_event)
        except Exception as exc:  # noqa: BLE001 - the job goes on without it
            job.sink.warning(f"{job.call.name}: no replacement for node {node} ({type(exc).__name__}: {exc}); "
                             f"the job goes on with {len(self.serving)} node(s)")
            return
        if released is None:
            job.sink.info(f"{job.call.name}: {type(job.compute).__name__} puts no node back while a job runs; "
                          f"the job goes on with {len(self.serving)} node(s)")
            return
        job.given_back.append(released)
        if job.cancel_event.is_set() or self.allocation.released:
            return
        self.coming.add(node)
        job.compute.start(self.allocation, replace(self.launch, commands=[
            c for c in self.launch.commands if c.node == node]))

    def _rank_0_step(self) -> int | None:
        """The step rank 0 last reported, None where it reported none or its file is not readable."""
        from prefect_sgpu.observe.progress_watch import parse_progress
        from prefect_sgpu.protocol.rank_progress import read_line

        folder = getattr(self.job, "folder", None)
        if folder is None:
            return None
        try:
            line = read_line(folder.store, self.job.run_id, 0, folder.key, folder.gang)
        except Exception:  # noqa: BLE001 - a report, never the job's failure
            return None
        seen = parse_progress(line.encode() if line is not None else None, time.time())
        return seen[0] if seen is not None else None

    def _record(self, nodes: list[int], joined: list[int], left: list[int], reason: str) -> None:
        from prefect_sgpu.driver.recovery import checkpoint_progress

        job = self.job
        step = checkpoint_progress(job, 0.0, time.time())[0] if job.membership else None
        change = MembershipChange(round=len(job.membership), nodes=nodes, world_size=len(nodes) * self.procs_per_node,
                                  joined=joined, left=left, at=time.time(), from_step=step,
                                  step=self._rank_0_step() if job.membership else None, reason=reason)
        job.membership.append(change)
        for listener in list(job.membership_listeners):
            try:
                listener(change)
            except Exception:  # noqa: BLE001 - a report, never the job's failure
                logger.debug("a membership listener of job %s failed", job.run_id, exc_info=True)
