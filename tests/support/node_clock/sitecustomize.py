"""A simulated node's retry helper on a fast clock: ``SGPU_TEST_CLOCK_SCALE=30`` makes each of its waits
30 times shorter and its clock run 30 times faster, so "credentials 404 for 90 s" passes in 3 real seconds.

The simulator (``support.ec2_simulator``) puts this folder on a node's ``PYTHONPATH`` when its
``clock_scale`` is set, and its IMDS counts lateness on the same scale. Python runs ``sitecustomize`` at
start-up; this one adds an import hook that, once the module ``retry`` (the copy the node's environment
stage carries beside itself) or ``prefect_sgpu.retry`` is executed, sets its ``CLOCK``. Nothing else in
the process is scaled: timeouts, heartbeats and ``time.sleep`` elsewhere keep real time.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time

SCALE_ENV = "SGPU_TEST_CLOCK_SCALE"
MODULES = ("retry", "prefect_sgpu.retry")


class ScaledClock:
    """Monotonic time ``scale`` times faster than real; a sleep of ``s`` takes ``s / scale`` real seconds."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.origin = time.monotonic()

    def monotonic(self) -> float:
        return self.origin + (time.monotonic() - self.origin) * self.scale

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds / self.scale)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, clock: ScaledClock) -> None:
        self.inner, self.clock = inner, clock

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:  # type: ignore[no-untyped-def]
        self.inner.exec_module(module)
        module.CLOCK = self.clock


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, clock: ScaledClock) -> None:
        self.clock = clock

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname not in MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self.clock)
        return spec


def _install() -> None:
    try:
        scale = float(os.environ.get(SCALE_ENV, "") or 0)
    except ValueError:
        return
    if scale > 0 and scale != 1:
        sys.meta_path.insert(0, _Finder(ScaledClock(scale)))


_install()
