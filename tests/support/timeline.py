"""A per-worker timeline of the suite: each test's start and end, and every second each process's CPU.

Opt-in: ``SGPU_TEST_TIMELINE=timeline.jsonl ./dev test ...``. Every process of the run appends JSON
lines to that file (one ``os.write`` per line, ``O_APPEND``):

- ``{"ev": "worker", "worker": "gw0", "pid": ...}`` once per pytest process (``main`` without xdist);
- ``{"ev": "start"|"end", "worker": ..., "t": ..., "test": nodeid}`` around each test, from the start
  of its set-up to the end of its teardown;
- from the controller only, once a second (``SGPU_TEST_TIMELINE_EVERY``): ``{"ev": "proc", ...}``
  the first time a process of this suite is seen (pid, start tick, parent, command line) and
  ``{"ev": "cpu", "t": ..., "p": [[pid, start, ticks], ...], "machine": [busy, idle]}`` for the
  processes whose CPU ticks (user + system, its own) grew since the last reading, and the whole
  machine's busy and idle ticks (``/proc/stat``, every core) since boot.

A process belongs to this suite when it is below the controller in the process tree, or when its
environment carries this suite's ``SGPU_TEST_SUITE`` id (an orphan re-parented to init keeps it),
or when it was seen as one before. A process that lives less than one reading is missed, so the
numbers are a lower bound. ``./dev bench suite_timeline FILE`` turns the file into tables:
CPU by test, by session server, between tests and after the test that started a process ended.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

ENV = "SGPU_TEST_TIMELINE"
EVERY_ENV = "SGPU_TEST_TIMELINE_EVERY"
#: the pid of the pytest that samples (a pytest started by a test sees it and records nothing)
ROOT_ENV = "SGPU_TEST_TIMELINE_ROOT"
#: one id per suite run, inherited by every process the suite starts (set by the controller first)
SUITE_ENV = "SGPU_TEST_SUITE"


def suite_id() -> str:
    """This suite's id: the controller's, inherited by its workers and their children."""
    return os.environ.setdefault(SUITE_ENV, uuid.uuid4().hex[:12])


def _write(fd: int, record: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())


def read_stat(pid: str) -> tuple[int, int, int] | None:
    """(parent pid, start tick, CPU ticks of the process itself) from ``/proc/PID/stat``; None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[1]), int(fields[19]), int(fields[11]) + int(fields[12])


def _carries(pid: int, marker: bytes) -> bool:
    try:
        return marker in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


class Sampler:
    """The controller's reader of ``/proc``: which processes are this suite's, and their CPU ticks."""

    def __init__(self, fd: int, root: int, every: float) -> None:
        self.fd, self.root, self.every = fd, root, every
        self.marker = f"{SUITE_ENV}={suite_id()}\0".encode()
        self.ticks: dict[tuple[int, int], int] = {}  # this suite's processes -> last ticks
        self.foreign: set[tuple[int, int]] = set()  # checked once: not this suite's
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sgpu-timeline", daemon=True)

    def sample(self) -> None:
        now = time.time()
        stats: dict[int, tuple[int, int, int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (stat := read_stat(entry)) is not None:
                stats[int(entry)] = stat
        mine = {self.root} | {pid for pid, start in self.ticks if stats.get(pid, (0, -1, 0))[1] == start}
        changed = []
        for pid in sorted(stats):
            parent, start, ticks = stats[pid]
            key = (pid, start)
            if key in self.foreign:
                continue
            if key not in self.ticks:
                chain, up = [pid], (pid if pid in mine else parent)
                while up not in mine and up in stats and up > 1 and up not in chain:
                    chain.append(up)
                    up = stats[up][0]
                if up not in mine and not _carries(pid, self.marker):
                    self.foreign.add(key)
                    continue
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                _write(self.fd, {"ev": "proc", "t": now, "pid": pid, "start": start, "ppid": parent,
                                 "cmd": cmd[:300]})
                self.ticks[key] = 0
            mine.add(pid)
            if ticks > self.ticks[key]:
                changed.append([pid, start, ticks])
                self.ticks[key] = ticks
        # the machine's ticks since boot, busy and idle (idle + iowait): what the cores did beside the suite
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
        _write(self.fd, {"ev": "cpu", "t": now, "p": changed,
                         "machine": [sum(fields) - fields[3] - fields[4], fields[3] + fields[4]]})

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            try:
                self.sample()
            except Exception as exc:  # a reader that fails says so once and stops; the run goes on
                _write(self.fd, {"ev": "error", "t": time.time(), "error": repr(exc)})
                return


class Timeline:
    """The plugin: test start/end on every pytest process, the sampler on the controller."""

    def __init__(self, path: str, controller: bool) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _write(self.fd, {"ev": "worker", "t": time.time(), "worker": self.worker, "pid": os.getpid(),
                         "controller": controller, "hz": os.sysconf("SC_CLK_TCK"),
                         "cores": os.cpu_count()})
        self.sampler: Sampler | None = None
        if controller:
            self.sampler = Sampler(self.fd, os.getpid(), float(os.environ.get(EVERY_ENV, "1")))
            self.sampler.thread.start()

    def _event(self, ev: str, item: pytest.Item) -> None:
        _write(self.fd, {"ev": ev, "t": time.time(), "worker": self.worker, "pid": os.getpid(),
                         "test": item.nodeid})

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item):  # type: ignore[no-untyped-def]
        self._event("start", item)
        yield

    @pytest.hookimpl(hookwrapper=True, trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item):  # type: ignore[no-untyped-def]
        yield
        self._event("end", item)

    def pytest_unconfigure(self) -> None:
        if self.sampler is not None:
            self.sampler.stop.set()
            self.sampler.thread.join(timeout=10)
            self.sampler.sample()  # the last second's ticks
        _write(self.fd, {"ev": "exit", "t": time.time(), "worker": self.worker, "pid": os.getpid()})
        os.close(self.fd)


def configure(config: pytest.Config) -> None:
    """Register the timeline when ``SGPU_TEST_TIMELINE`` names a file (the controller samples)."""
    path = os.environ.get(ENV)
    if not path:
        return
    controller = not hasattr(config, "workerinput")
    if controller and os.environ.get(ROOT_ENV, str(os.getpid())) != str(os.getpid()):
        # a pytest a test runs (tests/test_test_imports.py): not part of this timeline, nor its workers
        del os.environ[ENV]
        return
    if controller:
        os.environ[ROOT_ENV] = str(os.getpid())
    config.pluginmanager.register(Timeline(path, controller=controller), "sgpu-timeline")
