"""The one retry helper: exponential backoff with full jitter, within a budget of seconds.

botocore retries what one AWS call answers (throttling, 5xx) inside that call. What no SDK
retries is the cloud being *late*: credentials the instance metadata service does not serve yet,
an instance profile or a policy IAM has not propagated, a security group EC2 still counts as in
use minutes after its instances ended, a reservation whose slot is not free again yet. Each of
those waits here, under a budget in seconds, saying what it waited for and for how long.

This module imports only the standard library: the node's environment stage carries it (beside
the stage, before anything is installed) as well as the driver.

Time is read through :data:`CLOCK`, looked up at each call, so a test can run a budget of minutes
on a clock that jumps instead of sleeping (``tests/support/fast_clock.py``); nothing else in the
process changes.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

T = TypeVar("T")


class Clock:
    """Real time: the monotonic clock and :func:`time.sleep`."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


#: the clock every :class:`Backoff` reads unless it is given one (a test may swap it)
CLOCK: Clock = Clock()


@dataclass
class Backoff:
    """Delays ``base_s * 2**n`` capped at ``cap_s``, each drawn uniformly below that (full jitter, so
    nodes that failed together do not retry together), until ``budget_s`` seconds have passed since
    the first attempt. ``floor_s``: the least of each delay (a cloud that needs minutes gains
    nothing from a retry every tenth of a second)."""

    budget_s: float
    base_s: float = 1.0
    cap_s: float = 20.0
    floor_s: float = 0.0
    clock: Clock | None = None
    rng: random.Random = field(default_factory=random.Random)
    attempts: int = 0
    _started: float | None = None

    def _clock(self) -> Clock:
        return self.clock or CLOCK

    def start(self) -> "Backoff":
        self._started = self._clock().monotonic()
        self.attempts = 0
        return self

    @property
    def elapsed_s(self) -> float:
        if self._started is None:
            return 0.0
        return max(0.0, self._clock().monotonic() - self._started)

    def next_delay(self) -> float | None:
        """The next delay, or None when waiting it would pass the budget."""
        if self._started is None:
            self.start()
        ceiling = min(self.cap_s, self.base_s * (2 ** min(self.attempts, 30)))
        delay = max(self.floor_s, self.rng.uniform(0.0, ceiling))
        remaining = self.budget_s - self.elapsed_s
        if remaining <= 0:
            return None
        self.attempts += 1
        return min(delay, remaining)

    def wait(self) -> bool:
        """Sleep the next delay; False (without sleeping) when the budget is spent."""
        delay = self.next_delay()
        if delay is None:
            return False
        self._clock().sleep(delay)
        return True


def retrying(
    call: Callable[[], T],
    *,
    transient: Callable[[BaseException], bool],
    budget_s: float,
    base_s: float = 1.0,
    cap_s: float = 20.0,
    floor_s: float = 0.0,
    what: str = "",
    log: Callable[[str], None] | None = None,
    clock: Clock | None = None,
) -> T:
    """``call()`` until it returns, retrying what ``transient`` says is transient for ``budget_s``
    seconds with :class:`Backoff`. The last error is raised when the budget is spent, and anything
    ``transient`` refuses at once. ``log`` hears the first retry and how long the wait was in the
    end (``what`` names what was waited for)."""
    backoff = Backoff(budget_s=budget_s, base_s=base_s, cap_s=cap_s, floor_s=floor_s, clock=clock).start()
    while True:
        try:
            result = call()
        except BaseException as exc:
            if not transient(exc) or not backoff.wait():
                if backoff.attempts and log:
                    log(f"{what or 'the call'}: gave up after {backoff.elapsed_s:.0f} s "
                        f"and {backoff.attempts + 1} attempts: {exc}")
                raise
            if backoff.attempts == 1 and log:
                log(f"{what or 'the call'}: {exc}; retrying for up to {budget_s:.0f} s")
            continue
        if backoff.attempts and log:
            log(f"{what or 'the call'}: succeeded after waiting {backoff.elapsed_s:.0f} s "
                f"({backoff.attempts + 1} attempts)")
        return result
