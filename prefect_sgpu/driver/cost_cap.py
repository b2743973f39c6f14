"""A job held to its ``max_cost_usd``: the cost so far, projected one check ahead, and a final checkpoint.

While the job runs, the driver reads what its machines have cost every :data:`CHECK_INTERVAL_S`
seconds: the compute's ``running_cost`` (the provider's prices, from each machine's launch until
now) plus what machines already given back cost (lost nodes, earlier gangs). It projects that one
check ahead at the machines' hourly rate; once the projection passes the cap, waiting for the next
check would spend past it, so the driver stops the job now:

1. it asks every rank for a final checkpoint, as a reclaim notice does: its sealed heartbeat carries
   the ask (:meth:`~prefect_sgpu.driver.heartbeat.DriverHeartbeat.ask_checkpoint`), each node writes
   the ranks' ``final-checkpoint`` file, and a ``Checkpointer`` saves at its next step;
2. it waits up to ``PREFECT_SGPU_FINAL_CHECKPOINT_S`` seconds (120 by default, a spot notice's two
   minutes) for a newer complete checkpoint at the job's checkpoint location, or for a node to end;
3. it raises :class:`~prefect_sgpu.errors.CostCapReached` (the cap, the cost so far, the projection,
   the checkpoint's step); the job's cleanup stops every rank and releases the machines.

The cap is when the driver stops, not a ceiling the bill cannot pass: the final checkpoint's wait,
the stop and the machines' termination are paid too, at the same hourly rate. Only computes with a
price take a cap (``Compute.price_per_hour``: EC2, in the catalog's region and instance types); a
cap on any other (local processes, Ray) is refused before anything is spent.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from prefect_sgpu.compute.base import NodeExited, NodeLost
from prefect_sgpu.driver.env_seconds import env_seconds
from prefect_sgpu.errors import CostCapReached, SGPUConfigError, SGPUError
from prefect_sgpu.retry import retrying

if TYPE_CHECKING:
    from prefect_sgpu.compute.base import Compute, Request
    from prefect_sgpu.spec import JobSpec
    from prefect_sgpu.store import Store

logger = logging.getLogger("prefect_sgpu.driver.job")

__all__ = ["CHECK_INTERVAL_S", "FINAL_CHECKPOINT_ENV", "CostReading", "CostWatch", "check", "final_checkpoint_s",
           "marker_steps", "project"]

#: seconds between two readings of the cost, and how far ahead each projects
CHECK_INTERVAL_S = 10.0
#: seconds the driver waits for the final checkpoint once the cap is reached
FINAL_CHECKPOINT_ENV = "PREFECT_SGPU_FINAL_CHECKPOINT_S"
DEFAULT_FINAL_CHECKPOINT_S = 120.0


def project(spent_usd: float, usd_per_hour: float, ahead_s: float) -> float:
    """What the machines will have cost ``ahead_s`` seconds from now, at ``usd_per_hour``."""
    return spent_usd + usd_per_hour * max(ahead_s, 0.0) / 3600.0


@dataclass(frozen=True)
class CostReading:
    """One reading of a job's cost: spent so far, the machines' hourly rate, the projection one check ahead."""

    spent_usd: float
    usd_per_hour: float
    ahead_s: float
    cap_usd: float | None

    @property
    def projected_usd(self) -> float:
        return project(self.spent_usd, self.usd_per_hour, self.ahead_s)

    @property
    def reached(self) -> bool:
        """The projection passes the cap: by the next check the job would have cost more than it may."""
        return self.cap_usd is not None and self.projected_usd > self.cap_usd

    def describe(self) -> str:
        cap = f" of max_cost_usd={self.cap_usd:g}" if self.cap_usd is not None else ""
        return (f"${self.spent_usd:.4f} spent{cap} at ${self.usd_per_hour:.4f}/h, "
                f"${self.projected_usd:.4f} by the next check in {self.ahead_s:g}s")


def check(spec: "JobSpec", compute: "Compute", request: "Request") -> None:
    """SGPUConfigError when ``spec`` has a cap and ``compute`` no price for ``request``, or the final
    checkpoint's wait (``PREFECT_SGPU_FINAL_CHECKPOINT_S``) is not a number of seconds. Spends nothing."""
    if spec.max_cost_usd is None:
        return
    final_checkpoint_s()
    if compute.price_per_hour(request) is not None:
        return
    raise SGPUConfigError("max_cost_usd", spec.max_cost_usd,
                          f"None on compute {compute.name!r}: it has no price for this job, so no cost to cap "
                          "(a cost cap applies to priced computes: EC2 instance types the catalog prices)")


def final_checkpoint_s() -> float:
    """``PREFECT_SGPU_FINAL_CHECKPOINT_S``, checked: seconds >= 0 (120 by default; 0: stop at once)."""
    return env_seconds(FINAL_CHECKPOINT_ENV, DEFAULT_FINAL_CHECKPOINT_S, "seconds (a number >= 0) the driver waits "
                       "for the final checkpoint once a job's cost cap is reached; 0 stops it at once")


def marker_steps(store: "Store", uri: str) -> list[int]:
    """Steps with a ``COMPLETE`` marker at the checkpoint location ``uri`` (sealed or not: the driver only
    waits on them, it restores nothing). A location in the job's store is listed through that store."""
    from prefect_sgpu.checkpoints import MARKER, STEP_DIR, Location, is_remote

    root = store.root_uri.rstrip("/") + "/"
    if not (is_remote(uri) and uri.startswith(root)):
        return Location(uri).marker_steps()
    under = uri[len(root):].strip("/")
    steps = set()
    for key in store.objects().keys(under):
        folder, _, name = key[len(under) + 1:].partition("/")
        match = STEP_DIR.match(folder)
        if match and name == MARKER:
            steps.add(int(match.group(1)))
    return sorted(steps)


class _NotYet(Exception):
    """No newer complete checkpoint yet."""


class CostWatch:
    """Reads ``job``'s cost every ``every`` seconds while it runs; tells ``job.cost_listeners`` each
    reading (the task run's progress artifact); at the cap, the final checkpoint and the stop. (``job``
    is a :class:`~prefect_sgpu.driver.job.Job`, typed loosely: that module imports this one.)"""

    def __init__(self, job: Any, every: float = CHECK_INTERVAL_S) -> None:
        self.job = job
        self.every = every
        self.cap = job.spec.max_cost_usd
        self.last: CostReading | None = None
        self._read_at: float | None = None
        self._warned = False

    def poll(self, now: float | None = None) -> CostReading | None:
        """A new reading when ``every`` has passed since the last (the first at once); raises
        CostCapReached, after the final checkpoint, when it passes the cap."""
        now = time.monotonic() if now is None else now
        if self._read_at is not None and now - self._read_at < self.every:
            return None
        self._read_at = now
        reading = self.read()
        if reading is None:
            return None
        self.last = reading
        for listener in list(self.job.cost_listeners):
            try:
                listener(reading)
            except Exception:  # noqa: BLE001 - a report, never the job's failure
                logger.debug("a cost listener of job %s failed", self.job.run_id, exc_info=True)
        if reading.reached:
            self.stop(reading)
        return reading

    def read(self) -> CostReading | None:
        """The job's cost now, or None when the compute cannot say (logged once; the next check tries again)."""
        job = self.job
        try:
            running = job.compute.running_cost(job.allocation) if job.allocation is not None else None
        except Exception as exc:  # noqa: BLE001 - a price that cannot be read now must not end the job
            running = None
            if not self._warned:
                self._warned = True
                job.sink.warning(f"{job.call.name}: the cost of job {job.run_id} cannot be read now "
                                 f"({type(exc).__name__}: {exc}); max_cost_usd is checked again in {self.every:g}s")
        if running is None:
            return None
        given_back = sum(float((r.cost or {}).get("usd") or 0.0) for r in job.given_back)
        return CostReading(spent_usd=given_back + float(running.get("usd") or 0.0),
                           usd_per_hour=float(running.get("usd_per_hour") or 0.0), ahead_s=self.every,
                           cap_usd=self.cap)

    def stop(self, reading: CostReading) -> NoReturn:
        """Ask every rank for a final checkpoint, wait for it (bounded), raise CostCapReached."""
        job = self.job
        budget = final_checkpoint_s()
        job.sink.warning(f"{job.call.name}: cost cap reached ({reading.describe()}): asking every rank for a "
                         f"final checkpoint (waiting up to {budget:g}s), then stopping job {job.run_id}")
        step = self.final_checkpoint(f"cost cap: ${reading.projected_usd:.4f} projected, max_cost_usd="
                                     f"{reading.cap_usd:g}", budget) if budget > 0 else None
        assert reading.cap_usd is not None
        raise CostCapReached(job.run_id, reading.cap_usd, reading.spent_usd, reading.projected_usd, step)

    def final_checkpoint(self, reason: str, budget_s: float) -> int | None:
        """The step of a checkpoint completed after the ask, or None when none was within ``budget_s``
        seconds, a node ended meanwhile, or the job was cancelled."""
        from prefect_sgpu.checkpoints import DIR_ENV, URI_ENV

        job = self.job
        env = {**job.checkpoint_env(), **job.spec.env}
        uri = env.get(URI_ENV) or env.get(DIR_ENV)
        if not uri or job.heartbeat is None or job.allocation is None:
            return None
        try:
            before = max(marker_steps(job.store, uri), default=-1)
        except Exception:  # noqa: BLE001 - unknown: any checkpoint that appears counts
            before = -1
        job.heartbeat.ask_checkpoint(reason)
        ended: list[Any] = []

        def newer() -> int | None:
            steps = [s for s in marker_steps(job.store, uri) if s > before]
            if steps:
                return max(steps)
            ended.extend(e for e in job.compute.poll(job.allocation) if isinstance(e, (NodeExited, NodeLost)))
            if ended or job.cancel_event.is_set():
                return None
            raise _NotYet(f"no checkpoint after step {before} at {uri} yet")

        transient: Callable[[BaseException], bool] = (
            lambda exc: isinstance(exc, _NotYet) or (isinstance(exc, Exception) and not isinstance(exc, SGPUError)))
        try:
            step = retrying(newer, transient=transient, budget_s=budget_s, base_s=1.0, cap_s=5.0,
                            what=f"the final checkpoint of job {job.run_id}", log=logger.info)
        except Exception as exc:  # noqa: BLE001 - the stop goes on without it, and says so
            logger.warning("job %s: no final checkpoint within %gs (%s)", job.run_id, budget_s, exc)
            return None
        if step is not None:
            job.sink.info(f"{job.call.name}: final checkpoint complete at step {step}")
        return step
