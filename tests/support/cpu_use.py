"""The CPU seconds each test costs, and the tests that cost the most.

On two cores the suite is CPU-bound: four workers share two cores, so a test's wall time says
more about what ran beside it than about the test. Its CPU does not. Each test's CPU is read
on the worker that runs it, from set-up to the end of teardown:

- the worker process's own time and that of the children it reaped (in-process drivers, moto,
  agents a driver started and reaped, and the ranks those agents reaped);
- every live descendant's own time and that of the children it reaped (the worker's Prefect
  server, its Ray cluster's raylets and the worker processes they reaped).

A process that outlives its parent and is adopted by init between two readings is lost, so the
numbers are a lower bound, and a test during which such a process left counts less than it
used. The controller prints the 25 tests that used the most (``./dev test`` always does) and,
with ``SGPU_TEST_CPU_FILE`` set, writes every test's seconds there as JSON.
"""

from __future__ import annotations

import json
import os

import pytest

KEY = "cpu_s"
SHOWN = 25
_started = pytest.StashKey[float]()


def cpu_seconds() -> float:
    """This process's CPU seconds, its reaped children's, and each live descendant's the same way."""
    import psutil

    me = psutil.Process()
    times = me.cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    for child in me.children(recursive=True):
        try:
            times = child.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


class CpuUse:
    """The plugin: each worker measures its tests; the controller collects and prints them."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item):  # type: ignore[no-untyped-def]
        item.stash[_started] = cpu_seconds()
        yield

    @pytest.hookimpl(hookwrapper=True, trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item):  # type: ignore[no-untyped-def]
        yield
        # before the teardown report is made: its user_properties carry the seconds to the controller
        if _started in item.stash:
            item.user_properties.append((KEY, round(cpu_seconds() - item.stash[_started], 2)))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "teardown":
            value = dict(report.user_properties).get(KEY)
            if value is not None:
                self.seen[report.nodeid] = value

    def pytest_terminal_summary(self, terminalreporter: "pytest.TerminalReporter") -> None:
        if not self.seen:
            return
        path = os.environ.get("SGPU_TEST_CPU_FILE")
        if path:
            with open(path, "w") as fh:
                json.dump(self.seen, fh, indent=1, sort_keys=True)
        terminalreporter.section("CPU per test")
        terminalreporter.write_line(f"{SHOWN} tests that used the most CPU ({sum(self.seen.values()):.0f} CPU s in "
                                    f"{len(self.seen)} tests, a lower bound: tests/support/cpu_use.py)")
        for nodeid, seconds in sorted(self.seen.items(), key=lambda kv: -kv[1])[:SHOWN]:
            terminalreporter.write_line(f"{seconds:8.1f}s cpu  {nodeid}")
