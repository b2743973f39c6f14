"""Clocks that let a test run AWS's minutes of lateness in moments.

:class:`VirtualClock` replaces :data:`prefect_sgpu.retry.CLOCK` in the test's own process (the
``virtual_clock`` fixture): a sleep advances the clock at once (after a real pause of at most
``real_pause_s``, so other threads still run), and the simulated cloud reads the same clock to
decide when IAM has propagated or a group is free again. Nothing else in the process is shifted.
"""

from __future__ import annotations

import threading
import time


class VirtualClock:
    """A monotonic clock that a sleep advances: ``sleep(90)`` returns at once, 90 s later."""

    def __init__(self, real_pause_s: float = 0.002) -> None:
        self._offset = 0.0
        self._lock = threading.Lock()
        self.real_pause_s = real_pause_s
        self.slept: list[float] = []

    def monotonic(self) -> float:
        with self._lock:
            return time.monotonic() + self._offset

    def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            return
        with self._lock:
            self._offset += seconds
            self.slept.append(seconds)
        time.sleep(min(seconds, self.real_pause_s))

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._offset += seconds

    @property
    def waited_s(self) -> float:
        return sum(self.slept)
