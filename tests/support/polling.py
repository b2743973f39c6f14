"""Waiting on a condition with a deadline, never on a bare sleep."""

from __future__ import annotations

import time
from typing import Any, Callable


def poll(read: Callable[[], Any], ok: Callable[[Any], bool], what: str, timeout: float = 60) -> Any:
    """Call ``read`` every half second until ``ok`` accepts what it returned; that value, or an
    AssertionError naming ``what`` and the last value read once ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        got = read()
        if ok(got):
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not appear within {timeout:g}s; last read: {got!r}"[:3000])
        time.sleep(0.5)
