"""A live status line for a job on the caller's terminal (rich), off when stderr is not a TTY.

While a ``.distributed()`` call or a GPU task waits for its job, one line shows the job,
its latest phase (what the library logs from the waiting thread: EC2's ``requested ->
running -> agent up -> rendezvous``, quota waits, ...), rank 0's step (``runtime.progress``)
and the time since the call. It never prints into a log file, a pipe or CI output; set
``PREFECT_SGPU_LIVE=0`` to turn it off on a terminal too, or ``1`` to force it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

LIVE_ENV = "PREFECT_SGPU_LIVE"
LIBRARY_LOGGER = "prefect_sgpu"


def enabled(stream: Any = None) -> bool:
    """The live line is on: forced by ``PREFECT_SGPU_LIVE``, else when ``stream`` (stderr) is a TTY."""
    forced = os.environ.get(LIVE_ENV, "").strip().lower()
    if forced in ("0", "false", "no", "off"):
        return False
    if forced in ("1", "true", "yes", "on"):
        return True
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def read_step(store: Any, run_id: str, *, key: str, gang: int = 0) -> tuple[int, int | None] | None:
    """Rank 0's last reported ``(step, total)`` from the job folder, or None (none yet, or a file
    not sealed with the job's progress key for rank 0 of this gang: :mod:`prefect_sgpu.protocol.rank_progress`)."""
    from prefect_sgpu.protocol.rank_progress import read_line

    try:
        fields = (read_line(store, run_id, 0, key, gang) or "").split()
        if len(fields) < 2:
            return None
        total = int(fields[2]) if len(fields) > 2 else 0
        return int(fields[1]), (total if total > 0 else None)
    except Exception:  # noqa: BLE001 - half-written, gone or refused: next time
        return None


def job_step(job: Any) -> tuple[int, int | None] | None:
    """Rank 0's last reported ``(step, total)`` of a running job, or None (its folder not made yet)."""
    folder = getattr(job, "folder", None)
    if folder is None:
        return None
    return read_step(job.store, job.run_id, key=folder.key, gang=folder.gang)


class _PhaseHandler(logging.Handler):
    """Keeps the latest library message logged from the waiting thread."""

    def __init__(self, owner: int) -> None:
        super().__init__(logging.INFO)
        self.owner = owner
        self.latest = ""

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.owner:
            try:
                self.latest = record.getMessage().splitlines()[0][:120]
            except Exception:  # noqa: BLE001 - a status line never fails a job
                pass


class LiveStatus:
    """``with LiveStatus(job): job.run()`` shows the job's live line while it runs (when enabled)."""

    def __init__(self, job: Any, *, console: Any = None, every: float = 0.5) -> None:
        self.job = job
        self.every = every
        self.on = console is not None or enabled()
        self._console = console
        self._stop = threading.Event()
        self._handler = _PhaseHandler(threading.get_ident())
        self._started = time.monotonic()
        self._step: tuple[int, int | None] | None = None
        self._status: Any = None
        self._thread: threading.Thread | None = None

    def line(self) -> str:
        """The status text as it stands now."""
        parts = [f"[bold]{getattr(self.job.call, 'name', 'job')}[/] [dim]{self.job.run_id}[/]"]
        if self._handler.latest:
            parts.append(self._handler.latest.replace("[", "\\["))
        if self._step is not None:
            step, total = self._step
            parts.append(f"step {step}" + (f"/{total} ({100 * step / total:.0f}%)" if total else ""))
        parts.append(f"{time.monotonic() - self._started:.0f}s")
        return " | ".join(parts)

    def _follow(self) -> None:
        last_read = 0.0
        while not self._stop.wait(self.every):
            now = time.monotonic()
            if now - last_read >= 2.0:
                self._step = job_step(self.job) or self._step
                last_read = now
            self._status.update(self.line())

    def __enter__(self) -> "LiveStatus":
        if not self.on:
            return self
        from rich.console import Console

        console = self._console or Console(stderr=True, highlight=False)
        logging.getLogger(LIBRARY_LOGGER).addHandler(self._handler)
        self._status = console.status(self.line(), spinner="dots")
        self._status.start()
        self._thread = threading.Thread(target=self._follow, daemon=True, name=f"sgpu-live-{self.job.run_id}")
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.on or self._status is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.every + 5)
        self._status.stop()
        logging.getLogger(LIBRARY_LOGGER).removeHandler(self._handler)
