"""Durations the driver reads from ``PREFECT_SGPU_*`` variables, each checked the same way.

A variable that is unset or blank gives its default; anything else must be a number of seconds inside the
allowed range (whole seconds where asked), or the read raises :class:`SGPUConfigError` naming the variable,
the value and ``allowed``. NaN and infinity are never allowed.
"""

from __future__ import annotations

import math
import os

from prefect_sgpu.errors import SGPUConfigError


def env_seconds(name: str, default: float, allowed: str, *, low: float = 0.0, high: float | None = None,
                whole: bool = False) -> float:
    """Seconds from the variable ``name`` (``default`` when unset), from ``low`` to ``high`` inclusive."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        seconds = float(raw) if not whole else float(int(raw)) if raw.isdigit() else math.nan
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= low and (high is None or seconds <= high)):
        raise SGPUConfigError(name, raw, allowed)
    return int(seconds) if whole else seconds
