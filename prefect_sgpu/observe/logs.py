"""Live per-rank logs: tail each rank's log in the store, tag every line with its rank.

Inside a Prefect flow or task run the lines go to that run's logger (so they are
stored on the server as the run's logs); elsewhere they are printed.

What a rank writes is not trusted to drive the terminal it lands on: every control
character but the tab (escape sequences, carriage returns, bidirectional overrides) is
shown as its escape (``\\x1b``), in the printed line and in Prefect's log alike. A log
object whose name is not ``logs/rank-N.log`` is skipped with one log line; the other
ranks' logs go on.

What the driver asks of the store is budgeted: one listing per poll for every rank's log (sizes and
appended pieces from the listing), then ranged reads of only the logs that grew, at most
:data:`READ_CAP` bytes of each per poll. Polls come every :data:`FAST_S` seconds while logs grow and
back off to :data:`SLOW_S` while nothing changes. A line longer than :data:`MAX_LINE` bytes is cut there
(one "line too long" warning per log; the rest of that line is skipped), so a log without newlines
never holds more than that in the driver's memory.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from typing import Any, Callable

from prefect_sgpu.protocol.jobfolder import LOGS
from prefect_sgpu.store import Listed, Store

logger = logging.getLogger("prefect_sgpu")

LineSink = Callable[[int, int, str], None]

#: seconds between polls while some log grows
FAST_S = 1.0
#: the longest wait between polls while nothing changes (each quiet poll waits 1.5x the last)
SLOW_S = 10.0
#: the most bytes of one log read in one request (and held at once)
READ_CAP = 1024 * 1024
#: the most bytes of one log read per poll (the rest comes on the next, which is not delayed)
POLL_CAP = 4 * READ_CAP
#: the longest line handed on; the rest of a longer one is skipped
MAX_LINE = 64 * 1024

#: C0 controls but the tab, DEL, C1 controls, and the Unicode format controls that reorder or hide text
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")
#: the names ranks write (``jobfolder.log_key``), digits in ASCII only
_RANK_LOG = re.compile(r"rank-([0-9]{1,9})\.log")


def printable(text: str) -> str:
    """``text`` with every control character but the tab shown as its escape (``\\x1b``, ``\\u202e``)."""
    return _CONTROL.sub(lambda m: ascii(m.group())[1:-1], text)


def rank_of_log(key: str) -> int | None:
    """``logs/rank-00003.log`` -> 3; None for any other name."""
    match = _RANK_LOG.fullmatch(key.rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def prefect_run_logger() -> Any | None:
    """The current Prefect run's logger, or None outside a flow/task run (and without importing Prefect
    where this process never did: no run can be current there)."""
    if "prefect.context" not in sys.modules:
        return None
    try:
        from prefect.context import FlowRunContext, TaskRunContext
        from prefect.logging import get_run_logger
    except ImportError:  # prefect not installed: plain printing
        return None
    if TaskRunContext.get() is None and FlowRunContext.get() is None:
        return None
    return get_run_logger()


class RankLogSink:
    """Where tagged rank lines and driver messages go."""

    def __init__(self, name: str, run_logger: Any | None = None, echo: bool = True) -> None:
        self.name = name
        self.run_logger = run_logger if run_logger is not None else prefect_run_logger()
        self.echo = echo

    def line(self, rank: int, node: int, text: str) -> None:
        tagged = f"[rank {rank} node {node}] {text}"
        if self.run_logger is not None:
            self.run_logger.info(tagged)
        elif self.echo:
            print(tagged, file=sys.stdout, flush=True)

    def info(self, message: str) -> None:
        (self.run_logger or logger).info(message)

    def warning(self, message: str) -> None:
        (self.run_logger or logger).warning(message)


class LogTailer:
    """Follow ``logs/rank-*.log`` of a job and hand complete lines to a sink."""

    def __init__(self, store: Store, run_id: str, procs_per_node: int, sink: LineSink,
                 interval: float = FAST_S, slowest: float = SLOW_S) -> None:
        self.store = store
        self.run_id = run_id
        self.procs_per_node = max(procs_per_node, 1)
        self.sink = sink
        self.interval = interval
        self.slowest = max(slowest, interval)
        self._offsets: dict[str, int] = {}
        self._partial: dict[str, bytes] = {}
        #: logs inside a line too long to show: its rest is skipped up to the next newline
        self._cutting: set[str] = set()
        self._warned_long: set[str] = set()
        self._skipped: set[str] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        #: which node a rank runs on (the driver sets it once the compute has placed the ranks)
        self.node_of: Callable[[int], int] | None = None

    def start(self) -> "LogTailer":
        self._thread = threading.Thread(target=self._loop, name=f"sgpu-logs-{self.run_id}", daemon=True)
        self._thread.start()
        return self

    def next_delay(self, delay: float, changed: bool) -> float:
        """The wait before the next poll: fast after a change, 1.5x longer (up to ``slowest``) after none."""
        return self.interval if changed else min(max(delay, self.interval) * 1.5, self.slowest)

    def _loop(self) -> None:
        failures = 0
        delay = self.interval
        while not self._stop.wait(delay * min(2 ** failures, 50) if failures else delay):
            try:
                delay = self.next_delay(delay, self.poll())
                failures = 0
            except Exception:  # noqa: BLE001 - a store hiccup (S3 5xx) must not end live logs
                failures += 1
                logger.debug("reading rank logs failed (%d in a row); retrying", failures, exc_info=True)

    def poll(self, final: bool = False) -> bool:
        """One listing of the job's logs, then ranged reads of those that grew (all of them when
        ``final``, else at most :data:`POLL_CAP` bytes each). True when any log had new bytes."""
        changed = False
        with self._lock:
            for key, listed in sorted(self.store.listing(self.run_id, LOGS).items()):
                if key in self._skipped:
                    continue
                offset = self._offsets.get(key, 0)
                if listed.size < offset:  # written anew, shorter: follow it from its start
                    offset = 0
                    self._partial.pop(key, None)
                    self._cutting.discard(key)
                if listed.size == offset and not (final and self._partial.get(key)):
                    continue
                place = self._place(key)
                if place is None:
                    continue
                changed |= listed.size > offset
                self._read(key, listed, offset, place, final)
        return changed

    def _read(self, key: str, listed: Listed, offset: int, place: tuple[int, int], final: bool) -> None:
        budget = listed.size - offset if final else min(listed.size - offset, POLL_CAP)
        while budget > 0:
            data = self.store.read_range(self.run_id, listed, offset, min(budget, READ_CAP))
            if not data:
                break
            offset += len(data)
            budget -= len(data)
            self._offsets[key] = offset
            self._lines(key, data, place)
        self._offsets.setdefault(key, offset)
        rest = self._partial.get(key, b"")
        if final and offset >= listed.size and rest:
            self._partial[key] = b""
            self._emit(place, rest)

    def _lines(self, key: str, data: bytes, place: tuple[int, int]) -> None:
        """Hand on the complete lines of ``partial + data``; keep (at most :data:`MAX_LINE` of) the rest."""
        *lines, rest = data.split(b"\n")
        if lines and key in self._cutting:  # the end of a line already shown cut short
            self._cutting.discard(key)
            lines = lines[1:]
        elif lines:
            lines[0] = self._partial.get(key, b"") + lines[0]
        elif key in self._cutting:
            return
        else:
            rest = self._partial.get(key, b"") + rest
        for raw in lines:
            self._emit(place, raw[:MAX_LINE] if len(raw) <= MAX_LINE else self._cut(key, raw))
        if len(rest) > MAX_LINE:
            self._emit(place, self._cut(key, rest))
            self._cutting.add(key)
            rest = b""
        self._partial[key] = rest

    def _cut(self, key: str, raw: bytes) -> bytes:
        if key not in self._warned_long:
            self._warned_long.add(key)
            logger.warning("line too long in %s of job %s: shown cut at %d bytes, the rest of it skipped",
                           printable(key), self.run_id, MAX_LINE)
        return raw[:MAX_LINE] + " [line too long: cut]".encode()

    def _emit(self, place: tuple[int, int], raw: bytes) -> None:
        try:
            self.sink(*place, printable(raw.decode("utf-8", "replace").rstrip("\r")))
        except Exception:  # noqa: BLE001 - a broken sink must not kill the job
            logger.debug("log sink failed", exc_info=True)

    def _place(self, key: str) -> tuple[int, int] | None:
        """(rank, node) of a rank log; None, once logged, for a name that is not one."""
        rank = rank_of_log(key)
        try:
            if rank is None:
                raise ValueError("not named logs/rank-N.log")
            return rank, (self.node_of(rank) if self.node_of is not None else rank // self.procs_per_node)
        except Exception as exc:  # noqa: BLE001 - one bad name must not end every rank's live logs
            self._skipped.add(key)
            logger.warning("skipping log object %s of job %s (%s); the other rank logs go on",
                           printable(repr(key)), self.run_id, printable(str(exc)))
            return None

    def restart(self, move_aside: Callable[[], None]) -> None:
        """Show every line so far, let ``move_aside`` move the logs away, then follow new files from
        their start (a relaunched gang writes new logs under the same names)."""
        self.poll(final=True)
        with self._lock:
            move_aside()
            self._offsets.clear()
            self._partial.clear()
            self._cutting.clear()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.poll(final=True)
        except Exception:  # noqa: BLE001 - the full logs stay in the store; cleanup goes on
            logger.warning("could not read the last rank log lines of %s", self.run_id, exc_info=True)
