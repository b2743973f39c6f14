"""Live per-rank logs: tail each rank's log in the store, tag every line with its rank.

Inside a Prefect flow or task run the lines go to that run's logger (so they are
stored on the server as the run's logs); elsewhere they are printed.

What a rank writes is not trusted to drive the terminal it lands on: every control
character but the tab (escape sequences, carriage returns, bidirectional overrides) is
shown as its escape (``\\x1b``), in the printed line and in Prefect's log alike. A log
object whose name is not ``logs/rank-N.log`` is skipped with one log line; the other
ranks' logs go on.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from typing import Any, Callable

from prefect_sgpu.protocol.jobfolder import LOGS
from prefect_sgpu.store import Store

logger = logging.getLogger("prefect_sgpu")

LineSink = Callable[[int, int, str], None]

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
                 interval: float = 0.2) -> None:
        self.store = store
        self.run_id = run_id
        self.procs_per_node = max(procs_per_node, 1)
        self.sink = sink
        self.interval = interval
        self._offsets: dict[str, int] = {}
        self._partial: dict[str, bytes] = {}
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

    def _loop(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval * min(2 ** failures, 50)):
            try:
                self.poll()
                failures = 0
            except Exception:  # noqa: BLE001 - a store hiccup (S3 5xx) must not end live logs
                failures += 1
                logger.debug("reading rank logs failed (%d in a row); retrying", failures, exc_info=True)

    def poll(self, final: bool = False) -> None:
        with self._lock:
            for key in self.store.list(self.run_id, LOGS):
                if key in self._skipped:
                    continue
                place = self._place(key)
                if place is None:
                    continue
                data = self.store.read_from(self.run_id, key, self._offsets.get(key, 0))
                if not data and not (final and self._partial.get(key)):
                    continue
                self._offsets[key] = self._offsets.get(key, 0) + len(data)
                buf = self._partial.get(key, b"") + data
                *lines, rest = buf.split(b"\n")
                if final and rest:
                    lines.append(rest)
                    rest = b""
                self._partial[key] = rest
                for raw in lines:
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

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.poll(final=True)
        except Exception:  # noqa: BLE001 - the full logs stay in the store; cleanup goes on
            logger.warning("could not read the last rank log lines of %s", self.run_id, exc_info=True)
