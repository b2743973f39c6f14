"""The driver's view of every rank's steps: read ``progress/rank-N`` from the job folder, feed the
straggler detector, name what it finds where the job's user looks.

A rank's progress file holds ``pid step total time first`` (:func:`prefect_sgpu.runtime.progress`;
``first``: when it reported its first step, for the job's timeline; older ranks wrote
``pid [step [total [time]]]``, then the driver's own clock stands in for the rank's). On EC2
each node ships its ranks' files with its logs, so the rates follow their own clocks, not the
upload's delay. The watch reads only the line sealed under it with the job's progress key
(:mod:`prefect_sgpu.protocol.rank_progress`): a file that is unsealed, forged, moved from another
rank, job or gang, or older than what it already read of that rank is refused with a warning
(once per rank; later ones are counted), so whoever can write the store cannot get a rank named
a straggler.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from prefect_sgpu.protocol.rank_progress import ProgressRefused, read_line
from prefect_sgpu.store import Store
from prefect_sgpu.observe.stragglers import Straggler, StragglerDetector

logger = logging.getLogger("prefect_sgpu.observe.progress_watch")

#: seconds between reads of the ranks' progress: a local folder, and a remote store (S3)
LOCAL_INTERVAL_S = 1.0
REMOTE_INTERVAL_S = 2.0


def parse_progress(data: bytes | None, read_at: float) -> tuple[int, float] | None:
    """``(step, time)`` from a progress file, or None (no step reported yet, or half a file)."""
    try:
        fields = (data or b"").decode().split()
        if len(fields) < 2:
            return None
        return int(fields[1]), (float(fields[3]) if len(fields) > 3 else read_at)
    except (UnicodeDecodeError, ValueError):
        return None


def first_step_time(data: bytes | None, default: float) -> float:
    """When the rank reported its first step: the file's fifth field (``runtime.progress`` keeps it),
    else ``default`` (a rank that wrote four fields: the time of the step read)."""
    try:
        fields = (data or b"").decode().split()
        return float(fields[4]) if len(fields) > 4 else default
    except (UnicodeDecodeError, ValueError):
        return default


class StragglerWatch:
    """One gang's stragglers: ``poll()`` every loop of the driver; reads at most every ``interval`` s."""

    def __init__(self, store: Store, run_id: str, world_size: int, factor: float, steps: int, *, key: str,
                 gang: int = 0, interval: float = LOCAL_INTERVAL_S,
                 where: Callable[[int], dict[str, Any]] | None = None) -> None:
        self.store = store
        self.run_id = run_id
        self.world_size = world_size
        self.interval = interval
        self.where = where or (lambda rank: {})
        self.detector = StragglerDetector(factor, steps)
        self._key = key  # the job key: the progress key derives from it
        self._gang = gang
        self._last_read = 0.0
        #: each rank's first step as its progress file says (rank -> wall time), for the job's timeline
        self.first_steps: dict[int, float] = {}
        #: the newest time read of each rank: a sealed line older than it was written back
        self._newest: dict[int, float] = {}
        #: progress files refused, per rank (the first is logged)
        self.refused: dict[int, int] = {}
        self._read_at_end = False

    def poll(self, now: float | None = None) -> list[Straggler]:
        """The stragglers named since the last poll (each with its node, host and instance where known)."""
        now = time.monotonic() if now is None else now
        if now - self._last_read < self.interval:
            return []
        self._last_read = now
        found: list[Straggler] = []
        for rank in range(self.world_size):
            try:
                seen = self._read(rank)
            except ProgressRefused as exc:
                self._refuse(rank, str(exc))
                continue
            except Exception:  # noqa: BLE001 - the store will answer next time; the job's outcome matters more
                logger.debug("could not read the progress of rank %d of job %s", rank, self.run_id, exc_info=True)
                continue
            if seen is not None:
                found.extend(self.detector.observe(rank, *seen))
        return [self._placed(s) for s in found]

    def read_at_end(self) -> None:
        """Once, at the gang's end: read each rank whose step was never read (a job that stepped between two
        reads, or ran shorter than ``interval``), so the timeline still has its first step. A rank that
        reported none costs one read; a refused file is left out as in ``poll``."""
        if self._read_at_end:
            return
        self._read_at_end = True
        for rank in range(self.world_size):
            if rank in self._newest:
                continue
            try:
                self._read(rank)
            except ProgressRefused as exc:
                self._refuse(rank, str(exc))
            except Exception:  # noqa: BLE001 - the timeline goes without it
                logger.debug("could not read the progress of rank %d of job %s", rank, self.run_id, exc_info=True)

    def _read(self, rank: int) -> tuple[int, float] | None:
        """The rank's sealed ``(step, time)``, None while it reported none; ProgressRefused."""
        line = read_line(self.store, self.run_id, rank, self._key, self._gang)
        seen = parse_progress(line.encode() if line is not None else None, time.time())
        if seen is None:
            return None
        if seen[1] < self._newest.get(rank, seen[1]):
            raise ProgressRefused(f"step {seen[0]} at {seen[1]:.3f} is older than a step already read (written "
                                  "back)")
        self._newest[rank] = seen[1]
        if rank not in self.first_steps:
            self.first_steps[rank] = first_step_time(line.encode() if line is not None else None, seen[1])
        return seen

    def _refuse(self, rank: int, why: str) -> None:
        count = self.refused[rank] = self.refused.get(rank, 0) + 1
        if count == 1:
            logger.warning("job %s: the progress file of rank %d was refused, and is not acted on (later "
                           "refusals of this rank are counted, not logged): %s", self.run_id, rank, why)

    def _placed(self, straggler: Straggler) -> Straggler:
        from dataclasses import replace

        try:
            where = self.where(straggler.rank)
        except Exception:  # noqa: BLE001 - named without its node rather than not at all
            where = {}
        return replace(straggler, **{k: v for k, v in where.items() if k in ("node", "host", "instance_id")})


def describe(job_name: str, straggler: Straggler, factor: float, steps: int) -> str:
    """The log line that names a straggler."""
    return (f"{job_name}: rank {straggler.rank} ({straggler.where()}) is a straggler: "
            f"{straggler.rate:.3g} steps/s against a median of {straggler.median_rate:.3g} steps/s "
            f"(slower than 1/{factor:g} of it for {steps} step(s), at step {straggler.step})")


def for_job(job: Any) -> StragglerWatch | None:
    """The straggler watch of a job's current gang, or None: turned off (``straggler_factor=None``),
    one rank, or a compute whose ranks report their steps elsewhere (Ray)."""
    plan, allocation, spec = job.plan, job.allocation, job.spec
    if (spec.straggler_factor is None or plan is None or allocation is None or plan.world_size < 2
            or not job.compute.runs_node_agents):
        return None

    def where(rank: int) -> dict[str, Any]:
        index = job.compute.node_of_rank(allocation, rank)
        node = next((n for n in allocation.nodes if n.index == index), None)
        return {"node": index, "host": node.host if node else None,
                "instance_id": node.instance_id if node else None}

    return StragglerWatch(job.store, job.run_id, plan.world_size, spec.straggler_factor, spec.straggler_steps,
                          key=job.folder.key, gang=job.folder.gang,
                          interval=REMOTE_INTERVAL_S if job.compute.remote else LOCAL_INTERVAL_S, where=where)


def name(job: Any, straggler: Straggler) -> None:
    """Name a straggler: kept on the job, a warning in its log (the Prefect run's, in a flow), then
    every listener of the job (the task runner's event and artifact)."""
    job.stragglers.append(straggler)
    job.sink.warning(describe(job.call.name, straggler, job.spec.straggler_factor or 0.0, job.spec.straggler_steps))
    for listener in list(job.straggler_listeners):
        try:
            listener(straggler)
        except Exception:  # noqa: BLE001 - a report, never the job's failure
            logger.warning("could not report straggler rank %d of job %s", straggler.rank, job.run_id, exc_info=True)
