"""Stragglers: ranks whose step rate falls well behind the job's median.

A pure detector, fed ``(rank, step, time)`` observations (the steps ranks report through
``runtime.progress``, read by the driver): per rank it keeps a sliding window of recent
observations and its step rate over that window (steps per second). A rank whose rate stays
below ``median / factor`` (the median of every rank's latest rate) while it advances ``steps``
steps is named once; it is named again only after it caught up (its rate back within the
factor) and fell behind again. It reads no clock and touches no file: the driver feeds it
(:mod:`prefect_sgpu.observe.progress_watch`), tests feed it by hand.

Times are the rank's own (the time it reported the step): only differences of one rank's
times are used, so clocks of different nodes need not agree.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

DEFAULT_FACTOR = 2.0
DEFAULT_STEPS = 5
#: the window a rate is measured over: the newest observations spanning at least this many steps
#: (and at least ``steps``), so a rate is neither one noisy step nor the whole run
MIN_WINDOW_STEPS = 10


@dataclass(frozen=True)
class Straggler:
    """One straggling episode of one rank, as named."""

    rank: int
    #: the rank's step when it was named
    step: int
    #: its steps per second over its window, and the median over every rank's
    rate: float
    median_rate: float
    #: the rank's time (seconds since the epoch) of that step
    at: float
    #: where it runs, filled in by the driver where known
    node: int | None = None
    host: str | None = None
    instance_id: str | None = None

    def where(self) -> str:
        parts = [f"node {self.node}" if self.node is not None else "node ?"]
        if self.host:
            parts.append(f"host {self.host}")
        if self.instance_id:
            parts.append(f"instance {self.instance_id}")
        return ", ".join(parts)

    def as_row(self) -> dict[str, object]:
        """One row of the job's stragglers table."""
        return {"rank": self.rank, "node": self.node, "host": self.host, "instance id": self.instance_id,
                "step": self.step, "rate (steps/s)": round(self.rate, 3),
                "median rate (steps/s)": round(self.median_rate, 3)}


@dataclass
class _Rank:
    window: deque[tuple[int, float]] = field(default_factory=deque)
    rate: float | None = None
    #: the step from which the rank has been slow without a break (None: it is not slow now)
    slow_from: int | None = None
    named: bool = False


class StragglerDetector:
    """``observe(rank, step, t)`` -> the stragglers named by that observation (none or one)."""

    def __init__(self, factor: float = DEFAULT_FACTOR, steps: int = DEFAULT_STEPS,
                 window_steps: int | None = None) -> None:
        if not factor > 1:
            raise ValueError(f"factor must be greater than 1, got {factor!r}")
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps!r}")
        self.factor = float(factor)
        self.steps = int(steps)
        self.window_steps = max(window_steps or MIN_WINDOW_STEPS, self.steps)
        self._ranks: dict[int, _Rank] = {}
        self.named: list[Straggler] = []

    def rates(self) -> dict[int, float]:
        """Every rank's latest rate (steps per second), for ranks with two observations or more."""
        return {rank: state.rate for rank, state in sorted(self._ranks.items()) if state.rate is not None}

    def median_rate(self) -> float | None:
        rates = list(self.rates().values())
        return statistics.median(rates) if len(rates) >= 2 else None

    def observe(self, rank: int, step: int, t: float) -> list[Straggler]:
        state = self._ranks.setdefault(rank, _Rank())
        window = state.window
        if window and step < window[-1][0]:
            self._ranks[rank] = state = _Rank()  # the rank started over (a restart): a new history
            window = state.window
        if window and (step == window[-1][0] or t <= window[-1][1]):
            return []  # no news
        previous = window[-1][0] if window else None
        window.append((step, t))
        while len(window) > 2 and window[-1][0] - window[1][0] >= self.window_steps:
            window.popleft()
        if len(window) < 2:
            return []
        (first_step, first_t), (last_step, last_t) = window[0], window[-1]
        state.rate = (last_step - first_step) / (last_t - first_t)
        median = self.median_rate()
        if median is None or state.rate * self.factor >= median:
            state.slow_from, state.named = None, False  # keeping up (again): the episode is over
            return []
        if state.slow_from is None:
            state.slow_from = previous if previous is not None else step
        if state.named or step - state.slow_from < self.steps:
            return []
        state.named = True
        found = Straggler(rank=rank, step=step, rate=state.rate, median_rate=median, at=t)
        self.named.append(found)
        return [found]
