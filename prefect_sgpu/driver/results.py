"""What a gang's end makes of the job: its result, or the error that says why it failed.

A gang that ended well gives the job's values, in the launcher's order of result ranks, and a
:class:`RankReport` per rank (:func:`collect`). A failed one is turned into the one exception the
caller sees (:func:`failure`): a hang the watchdog stopped, a node that stopped itself for a stale
driver heartbeat, the first failing rank's own exception with notes saying where it was raised, or
a ``RankFailedError`` naming the node and what it last printed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prefect_sgpu.protocol import payload as payload_mod
from prefect_sgpu.driver.recovery import GangEnd, Recovery, stopped_for_heartbeat
from prefect_sgpu.errors import HeartbeatExpired, JobHung, PayloadImportError, RankFailedError
from prefect_sgpu.driver.heartbeat import HEARTBEAT_INTERVAL_S
from prefect_sgpu.protocol.jobfolder import NodeStatus
from prefect_sgpu.spec import Plan


@dataclass
class RankReport:
    rank: int
    node: int
    host: str
    exit_code: int
    duration_s: float
    #: when the rank began the payload (wall clock, the rank's own; 0: not known)
    started: float = 0.0


@dataclass
class JobResult:
    """What a finished job leaves behind, beyond the values."""

    run_id: str
    values: list[Any]
    plan: Plan
    ranks: list[RankReport] = field(default_factory=list)
    mlflow_run_id: str | None = None
    mlflow_tracking_uri: str | None = None
    logs_uri: str = ""
    duration_s: float = 0.0
    #: what the compute charged for, when it knows (EC2: instance-hours and estimated USD)
    cost: dict[str, Any] | None = None
    #: what release removed (instances, groups, parameters, processes)
    released: list[str] = field(default_factory=list)
    #: relaunches after infrastructure loss (spot reclaim, lost node), oldest first
    recoveries: list[Recovery] = field(default_factory=list)
    #: ranks named as stragglers (:mod:`prefect_sgpu.observe.stragglers`), in the order they were named
    stragglers: list[Any] = field(default_factory=list)
    #: each rank's latest step rate (steps per second) as the straggler watch measured it, where it did
    step_rates: dict[int, float] = field(default_factory=dict)
    #: the gang check's report (:mod:`prefect_sgpu.observe.gang_check`): seconds, each node link's bandwidth,
    #: slow links and nodes, GPU warnings; None where it did not run
    gang_check: dict[str, Any] | None = None
    #: seconds since the warm set this job ran on passed the gang check, where the job skipped it as that
    #: set was unchanged (:attr:`Job.gang_check_reused`); None where the check ran or is off
    gang_check_reused_s: float | None = None
    #: where the job's time went: each phase of each node, in time order (:class:`prefect_sgpu.observe.timeline.Phase`:
    #: phase, node (None: the whole job), wall time, seconds since the job began, gang, detail)
    timeline: list[Any] = field(default_factory=list)
    #: an elastic job's membership: each change, with the nodes that served from it on and the checkpoint
    #: step it resumed from (:class:`prefect_sgpu.driver.membership.MembershipChange`); empty for a fixed gang
    membership: list[Any] = field(default_factory=list)


def collect(job: Any, plan: Plan, end: GangEnd) -> JobResult:
    """The job's values and rank reports from a gang that ended well; else the error it ended with
    (:func:`failure`), raised once every other node is stopped."""
    codes, statuses, lost = end.codes, end.statuses, end.lost
    if any(codes.values()):
        if job.allocation is not None:
            job.compute.stop(job.allocation)  # the other nodes, before reading envelopes
        raise failure(job, codes, statuses, lost)
    envelopes = job.envelopes()
    expected = job.launcher.result_ranks(plan)
    if plan.elastic:
        expected = final_ranks(envelopes, expected)
    missing = [r for r in expected if r not in envelopes]
    if missing:
        raise RankFailedError(missing[0], None, None, None,
                              f"rank(s) {missing} exited without a result")
    # an elastic job's earlier, larger round may have left a failed envelope of a rank beyond its last world
    if any(not e.ok for r, e in envelopes.items() if not plan.elastic or r in expected):
        raise failure(job, codes, statuses, lost)
    trusted = bool(getattr(job.spec, "trusted_results", False))
    values = [envelopes[r].value(trusted) for r in expected]
    ranks = [RankReport(e.rank, e.node, e.host, e.exit_code, e.finished - e.started, e.started)
             for e in (envelopes[r] for r in expected)]
    return JobResult(
        run_id=job.run_id, values=values, plan=plan, ranks=ranks,
        mlflow_run_id=job.tracked.run_id if job.tracked else None,
        mlflow_tracking_uri=job.tracked.tracking_uri if job.tracked else None,
        logs_uri=job.store.uri(job.run_id, "logs"),
        duration_s=time.monotonic() - job.started_at,
        gang_check=next((e.gang_check for e in envelopes.values() if e.gang_check), None),
    )


def final_ranks(envelopes: dict[int, payload_mod.Envelope], expected: list[int]) -> list[int]:
    """An elastic job's result ranks: those of the world its last round ran in, as rank 0 tells it. A
    rank beyond it wrote its envelope in an earlier, larger round; its value is not the job's."""
    first = envelopes.get(0)
    world = first.world_size if first is not None and first.world_size else 0
    return [r for r in expected if r < world] if world else expected


def ended_without_late_nodes(job: Any, end: GangEnd) -> bool:
    """An elastic job whose last round ended well while some of its nodes never joined: node 0 (which
    hosts the rendezvous, and left torch elastic's exit barrier only once every node of the round was
    done) exited 0, every rank of that round left its result, and as many nodes as that round had
    exited. The nodes not joined are stopped and counted as ended well: the job does not wait for them,
    nor fail when they find the rendezvous gone."""
    if job.plan is None or not job.plan.elastic or end.codes.get(0) != 0 or any(end.codes.values()):
        return False
    waiting = [n.index for n in job.allocation.nodes if n.index not in end.codes]
    if not waiting:
        return False
    envelopes = job.envelopes()
    ranks = final_ranks(envelopes, job.launcher.result_ranks(job.plan))
    if not envelopes or any(r not in envelopes for r in ranks):
        return False
    if len(end.codes) < len(ranks) // job.plan.procs_per_node:
        return False  # a node of the last round is still on its way out
    job.compute.stop(job.allocation)
    for index in waiting:
        end.codes[index] = 0
    job.sink.info(f"{job.call.name}: the job ended on {len(ranks)} rank(s); node(s) {waiting} had not joined it")
    return True


def failure(job: Any, codes: dict[int, int], statuses: dict[int, NodeStatus],
            lost: dict[int, str]) -> BaseException:
    """JobHung when a watchdog stopped the job; else the first failing rank's own exception
    (with rank/host notes); else RankFailedError."""
    hung = {int(rank): info.model_dump() for status in statuses.values() for rank, info in status.hung.items()}
    if hung:
        return JobHung(job.run_id, job.spec.hang_timeout or 0.0, hung)
    failed = sorted((e for e in job.envelopes().values() if not e.ok), key=lambda e: e.finished)
    expired = heartbeat_expired(job, statuses, failed)
    if expired is not None:
        return expired
    if failed:
        first = failed[0]
        trusted = bool(getattr(job.spec, "trusted_results", False))
        message = f"{first.exc_type}: {first.exc_message}"
        original = first.exception(trusted)
        refused = first.refused_exception_global() if original is None and not trusted else None
        if original is None:  # the class the driver itself imported, rebuilt from type name and message
            original = payload_mod.rebuild_exception(first.exc_type, first.exc_message)
        if original is None and refused:
            message += (f" (the exception refers to {refused}, which the driver does not load by default; "
                        "trusted_results=True re-raises the rank's own exception: see docs/security.md)")
        info = RankFailedError(first.rank, first.host, first.exit_code, first.traceback, message, node=first.node)
        if original is None or not isinstance(original, Exception):
            return info
        if isinstance(original, PayloadImportError) and not original.explained:
            from prefect_sgpu.environment.modules import explained

            original = explained(original)  # where the driver has the module, and how to ship it
        original.sgpu_failure = info  # type: ignore[attr-defined]
        original.add_note(
            f"[prefect-sgpu] raised in rank {first.rank} (node {first.node}) on {first.host}, "
            f"exit code {first.exit_code}, job {job.run_id}\nRemote traceback:\n"
            + (first.traceback or "").rstrip()
        )
        return original
    hosts = {n.index: n.host for n in (job.allocation.nodes if job.allocation else [])}
    for index, code in sorted(codes.items()):
        if not code:
            continue
        if index in lost:
            return RankFailedError(None, hosts.get(index), code, None, lost[index], node=index)
        status = statuses.get(index) or (job.folder.status(index) if job.folder else None)
        if status is not None and status.failures:
            rank, fail = min(status.failures.items(), key=lambda kv: int(kv[0]))
            how = f"killed by {fail.signal}" if fail.signal else "exited"
            return RankFailedError(int(rank), status.host or hosts.get(index), fail.exit_code, None,
                                   f"{how} without a Python exception (see its log)", node=index)
        why = (status.error if status else None) or (f"node {index}'s agent exited with code {code}"
                                                     + agent_output_tail(job, index))
        return RankFailedError(None, (status.host if status else None) or hosts.get(index), code, None, why,
                               node=index)
    return RankFailedError(None, None, None, None, "the job failed without a report")


def heartbeat_expired(job: Any, statuses: dict[int, NodeStatus],
                      failed: list[payload_mod.Envelope]) -> HeartbeatExpired | None:
    """A node that stopped itself for want of a new driver heartbeat is the cause; the errors its
    peers raised afterwards (a collective whose peer vanished) are collateral, named as such."""
    stale = stopped_for_heartbeat(statuses)
    if not stale:
        return None
    index, status = next(iter(stale.items()))
    nodes = ", ".join(f"node {i}" for i in stale)
    message = (f"{nodes} stopped {'itself' if len(stale) == 1 else 'themselves'}: {status.stopped}, while "
               f"the driver of job {job.run_id} still ran. Its heartbeat (written every "
               f"{HEARTBEAT_INTERVAL_S:g}s) did not reach the node within the TTL: the driver's process was "
               "too busy to write it, or the node could not read the job store. A longer heartbeat TTL "
               "(ttl_minutes on EC2) rides such stalls out.")
    collateral = None
    if failed:
        first = failed[0]
        collateral = f"rank {first.rank} (node {first.node}): {first.exc_type}: {first.exc_message}"
        message += f" What the ranks raised after it is collateral; the first: {collateral}"
    return HeartbeatExpired(None, status.host, status.exit_code, None, message, node=index, collateral=collateral)


def agent_output_tail(job: Any, index: int, lines: int = 12, limit: int = 3000) -> str:
    """The last lines a node agent printed (its import error, its own traceback), for a node
    that ended without a status: the reason is there, and nowhere else."""
    from prefect_sgpu.protocol.jobfolder import agent_output_key

    try:
        data = job.folder.store.get(job.run_id, agent_output_key(index)) if job.folder else None
    except Exception:  # noqa: BLE001 - the error is still raised, without the output
        return ""
    text = (data or b"")[-limit:].decode("utf-8", "replace").strip()
    if not text:
        return ""
    return "; the end of its output:\n" + "\n".join(text.splitlines()[-lines:])
