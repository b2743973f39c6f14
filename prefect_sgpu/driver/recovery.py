"""The driver's recovery from infrastructure loss: between one gang's end and the next gang's start.

A gang ends; :class:`GangEnd` holds what each node reported. When the end was the
infrastructure's doing (a node lost, reclaimed after a notice, or found at fault by the gang
check on some of a remote gang's nodes), :func:`recover` stops what runs, reads how far the
checkpoints got, replaces only the lost nodes where the compute can (else the whole gang)
and records a :class:`Recovery`; the driver's loop (:meth:`prefect_sgpu.driver.job.Job.run`)
then starts the next gang. Past ``max_recoveries`` the loss is the job's error
(:class:`~prefect_sgpu.errors.InfrastructureLost`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefect_sgpu.compute.base import Allocation, Request
from prefect_sgpu.errors import (EnvironmentMismatch, GangCheckFailed, InfrastructureLost, LaunchTimeout,
                                 ProvisioningError)
from prefect_sgpu.protocol.jobfolder import HEARTBEAT_STOP, NodeStatus

if TYPE_CHECKING:
    from prefect_sgpu.observe.logs import LogTailer

logger = logging.getLogger("prefect_sgpu.driver.job")


@dataclass
class Recovery:
    """One relaunch after infrastructure loss: what was lost, from where the new gang resumed."""

    gang: int
    nodes: dict[int, str]
    reason: str
    #: the newest complete checkpoint step the new gang found (None: it started from scratch)
    resumed_from_step: int | None
    #: seconds from the loss being noticed to the new gang's launch (stop, release, provisioning)
    reprovision_s: float
    #: seconds of the lost gang's run after its last complete checkpoint (work redone)
    lost_work_s: float | None
    #: "nodes": only the lost nodes were replaced, the others kept; "gang": the whole gang was
    replaced: str = "gang"
    #: the nodes kept (index -> instance or host) when only the lost ones were replaced
    kept: dict[int, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"gang": self.gang, "nodes": {str(k): v for k, v in self.nodes.items()}, "reason": self.reason,
                "resumed_from_step": self.resumed_from_step, "reprovision_s": round(self.reprovision_s, 1),
                "lost_work_s": None if self.lost_work_s is None else round(self.lost_work_s, 1),
                "replaced": self.replaced, "kept": {str(k): v for k, v in self.kept.items()}}


@dataclass
class GangEnd:
    """How one gang ended: each node's exit code and sealed status, the nodes lost and the notices seen."""

    codes: dict[int, int]
    statuses: dict[int, NodeStatus]
    lost: dict[int, str]
    notices: dict[int, str]

    @property
    def ok(self) -> bool:
        return not any(self.codes.values())

    def infrastructure(self) -> dict[int, str]:
        """Nodes whose end was the infrastructure's doing (lost, or reclaimed after a notice)."""
        found = dict(self.lost)
        for node, notice in self.notices.items():
            found.setdefault(node, f"reclaim notice: {notice}")
        for node, status in self.statuses.items():
            if status.notice and node not in found:
                found[node] = f"reclaim notice: {status.notice}"
        return found


def stopped_for_heartbeat(statuses: dict[int, NodeStatus]) -> dict[int, NodeStatus]:
    """The nodes that stopped themselves because no new driver heartbeat reached them."""
    return {i: s for i, s in sorted(statuses.items()) if (s.stopped or "").startswith(HEARTBEAT_STOP)}


def recover(job: Any, allocation: Allocation, end: GangEnd, request: Request, deadline: float,
            gang_started: float, tailer: "LogTailer") -> tuple[Allocation | None, Request] | None:
    """After a gang's end: None when the end is the job's own (success, a rank's error, a node that
    stopped itself for a stale heartbeat); else the lost nodes replaced (only them where the compute
    can, else the whole gang), the recovery recorded on ``job``, and what the next gang starts on:
    the allocation with new nodes in place, or None (acquire a new one), and ``replan``'s request.
    Raises ``InfrastructureLost`` once ``max_recoveries`` were made."""
    lost = end.infrastructure() if not end.ok else {}
    unfit = failed_gang_check(job, allocation) if not end.ok and not lost else {}
    if unfit and len(job.recoveries) >= job.spec.max_recoveries:
        return None  # the gang check's own error is the job's
    lost = lost or unfit
    if not lost or stopped_for_heartbeat(end.statuses):
        return None  # a node that stopped itself for a stale heartbeat was not lost: it is the error
    hosts = {n.index: n.instance_id or n.host for n in allocation.nodes}
    reason = "; ".join(f"node {i} ({hosts.get(i, '?')}): {why}" for i, why in sorted(lost.items()))
    if len(job.recoveries) >= job.spec.max_recoveries:
        job.compute.stop(allocation)
        node = min(lost)
        raise InfrastructureLost(
            None, hosts.get(node), end.codes.get(node), None,
            f"infrastructure lost: {reason}; {len(job.recoveries)} recovery(ies) made, "
            f"max_recoveries={job.spec.max_recoveries}", node=node,
            recoveries=[r.as_dict() for r in job.recoveries])
    noticed, noticed_at = time.monotonic(), time.time()
    gang = len(job.recoveries) + 1
    job.sink.warning(f"{job.call.name}: {reason}; replacing it (recovery {gang} of at most "
                     f"{job.spec.max_recoveries})")
    try:
        job.compute.stop(allocation)
    except BaseException:
        job.given_back.append(job.compute.release(allocation))
        job.allocation = None
        raise
    # read once the lost gang is gone: a save it was sealing when the loss was seen may have
    # completed since, and the next gang resumes from that one
    step, lost_work = checkpoint_progress(job, noticed - gang_started, noticed_at)
    for node, why in sorted(lost.items()):
        job.timeline.mark("recovery", node, noticed_at, why[:200])
    if step is not None and lost_work is not None:
        job.timeline.mark("checkpoint", None, noticed_at - lost_work, f"step {step}, resumed from")
    job.timeline.gang = gang  # what the next gang's nodes do from here on is its own
    if job.relay is not None:
        job.relay.restart()
    folder = job.folder
    assert folder is not None
    tailer.restart(lambda g=gang: folder.reset_for_relaunch(g))
    request = job.compute.replan(request, gang)
    replaced = replace_lost(job, allocation, set(lost), request, deadline)
    recovery = Recovery(gang=gang, nodes={i: hosts.get(i, "?") for i in lost}, reason=reason,
                        resumed_from_step=step, reprovision_s=0.0, lost_work_s=lost_work,
                        replaced="nodes" if replaced else "gang",
                        kept={n.index: n.instance_id or n.host for n in allocation.nodes
                              if n.index not in lost} if replaced else {})
    next_allocation: Allocation | None = allocation
    if not replaced:
        try:
            job.given_back.append(job.compute.release(allocation))
        finally:
            job.allocation = next_allocation = None
        folder.reset_nodes()  # what the nodes of a replacement given up wrote
    job.recoveries.append(recovery)
    job.reprovision_started = noticed
    return next_allocation, request


def failed_gang_check(job: Any, allocation: Allocation) -> dict[int, str]:
    """The nodes the gang check found at fault, when they are some of a remote gang's nodes (not all:
    a fault every node shares is the job's, not a machine's): replaced like lost ones, what each saw."""
    if not job.compute.remote or len(allocation.nodes) < 2:
        return {}
    for envelope in sorted((e for e in job.envelopes().values() if not e.ok), key=lambda e: e.finished):
        exc = envelope.exception(bool(getattr(job.spec, "trusted_results", False)))
        if not isinstance(exc, GangCheckFailed):
            continue
        nodes = exc.nodes
        if not 0 < len(nodes) < len(allocation.nodes):
            return {}
        own = {r: info for r, info in exc.failed.items() if not info.get("collateral")}
        return {node: "failed the gang check: " + "; ".join(
                    f"rank {r}: {info.get('error', '?')}" for r, info in sorted(own.items())
                    if info.get("node") == node) for node in nodes}
    return {}


def replace_lost(job: Any, allocation: Allocation, lost: set[int], request: Request, deadline: float) -> bool:
    """Only the lost nodes replaced, the others kept (True); False when the compute cannot, the nodes it
    would keep are unfit, or the new nodes could not be had (the whole gang is replaced then)."""
    try:
        released = job.compute.replace_nodes(allocation, lost, request, deadline, job.cancel_event)
    except (ProvisioningError, LaunchTimeout, EnvironmentMismatch) as exc:
        if job.cancel_event.is_set() or time.monotonic() >= deadline:
            raise
        job.sink.warning(f"{job.call.name}: the lost node(s) could not be replaced alone ({exc}); "
                         "relaunching the whole gang on new capacity")
        return False
    if released is None:
        return False
    job.given_back.append(released)
    job.sink.info(f"{job.call.name}: node(s) {sorted(lost)} replaced by new capacity, "
                  f"{len(allocation.nodes) - len(lost)} node(s) kept")
    return True


def checkpoint_progress(job: Any, gang_ran_s: float, noticed_at: float) -> tuple[int | None, float | None]:
    """The newest complete checkpoint step and the seconds of work the lost gang did after it, until
    its loss was noticed (``noticed_at``, wall clock; ``gang_ran_s``: how long it had run then)."""
    from prefect_sgpu.checkpoints import DIR_ENV, URI_ENV, Location, step_dir_name

    env = {**job.checkpoint_env(), **job.spec.env}
    uri = env.get(URI_ENV) or env.get(DIR_ENV)
    if not uri:
        return None, None
    try:
        location = Location(uri)
        steps = location.complete_steps()
        if not steps:
            return None, gang_ran_s
        manifest = location.manifest(step_dir_name(steps[-1]))
        written = manifest.info.get("written_at") if manifest is not None else None
        return steps[-1], (max(0.0, noticed_at - written) if written else None)
    except Exception:  # noqa: BLE001 - a report, not a reason to fail the relaunch
        logger.debug("could not read the checkpoints of job %s", job.run_id, exc_info=True)
        return None, None
