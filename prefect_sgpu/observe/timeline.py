"""Where a job's time went: its phases per node, as the driver saw them, with their wall times.

The driver records each phase it sees on its own path (launch requested, acquired, started, each
node's agent up, the ranks' rendezvous and first step, each node's ranks done, a recovery, the
release); a remote-node compute adds what it sees while acquiring (instances running, the
environment shipped, each node's agent up) through :func:`record`, keyed by the job's run id, so
the compute's contract does not change. Recording is an append to a list: no store request, no
lock, nothing that makes a warm call slower.

Times are wall-clock seconds (``time.time()``) where they come from: the driver's clock for what it
did or read, a rank's own clock for what a rank reported (its start, its first step), so on
machines of their own a rank's times carry that machine's clock offset. ``seconds`` is the time
since the job began (the driver's clock when the job started).

What a job's result carries (``result.timeline``) is a list of :class:`Phase`, in time order:
plain data, picklable, ``as_dict()`` for JSON and tables.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["PHASES", "PROGRESS", "Phase", "Timeline", "active", "log_to_mlflow", "note_first_steps", "note_ranks",
           "record"]

#: the phases a job may record, in the order they happen in a gang (a compute records those it has)
PHASES = (
    "launch requested",    # the driver asks the compute for the job's nodes (acquire)
    "warm lease taken",    # a remote compute took an idle warm lease of the job's shape
    "environment shipped",  # the driver put the environment's files in the store (nodes build it)
    "instances running",   # the cloud reports the machines running (node None: all of them at once)
    "environment ready",   # a node's environment stage finished (its own clock)
    "agent up",            # a node announced itself (remote: its alive document; local: its agent runs)
    "acquired",            # acquire returned: every node is up
    "started",             # the driver handed every node its launch (launch documents, forked agents)
    "rendezvous",          # a node's first rank began the payload: the c10d rendezvous was done (rank clock)
    "first step",          # a node's first rank to report a step did so (rank clock; runtime.progress)
    "checkpoint",          # the newest complete checkpoint a recovery found (when it was written)
    "recovery",            # infrastructure loss noticed: the node is replaced
    "ranks done",          # the driver saw the node's agent end
    "release",             # release returned: what the job held is gone or back in its pool
)


@dataclass(frozen=True)
class Phase:
    """One phase of one node (``node`` None: the whole job), at wall time ``at``.

    ``gang`` counts relaunches after infrastructure loss (0: the first gang); ``detail`` says more
    where there is more to say (an instance id, a lease, a checkpoint step)."""

    phase: str
    node: int | None
    at: float
    seconds: float
    gang: int = 0
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def as_row(self) -> dict[str, Any]:
        """A row of the Prefect table artifact: one per phase per node, seconds since the job began."""
        return {"phase": self.phase, "node": "all" if self.node is None else self.node,
                "seconds": round(self.seconds, 3), "gang": self.gang, "detail": self.detail}


class Timeline:
    """One job's phases. :meth:`mark` appends; :meth:`phases` sorts once, when asked."""

    def __init__(self, began: float | None = None) -> None:
        #: the job's start, wall clock
        self.began = time.time() if began is None else began
        #: the gang phases are recorded for (the driver moves it on at each recovery)
        self.gang = 0
        self._marks: list[tuple[str, int | None, float, int, str]] = []
        self._seen: set[tuple[str, int | None, int]] = set()

    def mark(self, phase: str, node: int | None = None, at: float | None = None, detail: str = "") -> None:
        """Record ``phase`` of ``node`` at wall time ``at`` (now when None)."""
        self._marks.append((phase, node, time.time() if at is None else at, self.gang, detail))
        self._seen.add((phase, node, self.gang))

    def once(self, phase: str, node: int | None = None, at: float | None = None, detail: str = "") -> bool:
        """:meth:`mark` unless this gang recorded ``phase`` of ``node`` already; whether it did now."""
        if (phase, node, self.gang) in self._seen:
            return False
        self.mark(phase, node, at, detail)
        return True

    def has(self, phase: str, node: int | None = None) -> bool:
        """Whether this gang recorded ``phase`` of ``node``."""
        return (phase, node, self.gang) in self._seen

    def phases(self) -> list[Phase]:
        """Every phase recorded, in time order (ties keep the order they were recorded in)."""
        ordered = sorted(enumerate(self._marks), key=lambda im: (im[1][2], im[0]))
        return [Phase(phase, node, at, at - self.began, gang, detail)
                for _, (phase, node, at, gang, detail) in ordered]

    def to_json(self) -> str:
        """The timeline as JSON (what the job's MLflow run keeps as ``timeline.json``)."""
        return json.dumps({"began": self.began, "phases": [p.as_dict() for p in self.phases()]}, indent=1)


#: a remote-node compute's progress lines (:class:`prefect_sgpu.compute.remote.nodes.Progress`) -> their phase
PROGRESS = {"warm": "warm lease taken", "environment": "environment shipped", "running": "instances running",
            "agent up": "agent up"}


def note_ranks(timeline: Timeline, ranks: list[Any]) -> None:
    """Each node's rendezvous: when its first rank began the payload (``RankReport.started``, the rank's
    clock); torch elastic starts a node's ranks only once the c10d rendezvous is done."""
    first: dict[int, float] = {}
    for report in ranks:
        started = getattr(report, "started", 0.0)
        if started:
            first[report.node] = min(started, first.get(report.node, started))
    for node, at in sorted(first.items()):
        timeline.once("rendezvous", node, at)


def note_first_steps(timeline: Timeline, first_steps: dict[int, float], node_of: Any) -> None:
    """Each node's first step: the earliest first step its ranks reported (rank -> wall time, as the
    straggler watch read them from the ranks' progress files; ``node_of(rank)`` names the node)."""
    first: dict[int, tuple[float, int]] = {}
    for rank, at in first_steps.items():
        node = node_of(rank)
        if node not in first or at < first[node][0]:
            first[node] = (at, rank)
    for node, (at, rank) in sorted(first.items()):
        timeline.once("first step", node, at, f"rank {rank}")


def log_to_mlflow(timeline: Timeline, tracking_uri: str, run_id: str) -> None:
    """The timeline as ``timeline.json`` in the job's MLflow run; never raises (a report, not the job)."""
    try:
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri).log_text(run_id, timeline.to_json(), "timeline.json")
    except Exception:  # noqa: BLE001 - tracking must not mask the job's own outcome
        import logging

        logging.getLogger("prefect_sgpu.observe.timeline").warning(
            "could not log the timeline to MLflow run %s", run_id, exc_info=True)


#: the timelines of the jobs this process drives, by run id
_ACTIVE: dict[str, Timeline] = {}


def active(run_id: str, timeline: Timeline | None) -> None:
    """Make ``timeline`` the one :func:`record` adds to for ``run_id`` (None: forget it)."""
    if timeline is None:
        _ACTIVE.pop(run_id, None)
    else:
        _ACTIVE[run_id] = timeline


def record(run_id: str, phase: str, node: int | None = None, at: float | None = None, detail: str = "") -> None:
    """Record a phase of job ``run_id`` where this process drives it; nothing otherwise. Never raises."""
    timeline = _ACTIVE.get(run_id)
    if timeline is not None:
        timeline.mark(phase, node, at, detail)
