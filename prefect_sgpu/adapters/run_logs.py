"""The library's own log lines in the Prefect run they belong to.

Every logger of the library is a child of ``prefect_sgpu``. Inside a flow or task run
(a GPU task's body, a ``.distributed()`` call in a flow, a job submitted from one),
:class:`RunLogHandler` — Prefect's own API log handler — sends its records to that run's
logs, so the "no GPU on this machine" warning and every EC2 phase line show in the UI
beside the rank output. Outside a run it passes records by (Prefect's handler would
complain that there is no flow run). The terminal keeps printing them as before, through
whatever handlers the process has.
"""

from __future__ import annotations

import logging
import threading

from prefect.logging.handlers import APILogHandler

LIBRARY_LOGGER = "prefect_sgpu"
_attach_lock = threading.Lock()


def _in_run() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return TaskRunContext.get() is not None or FlowRunContext.get() is not None


class RunLogHandler(APILogHandler):
    """Prefect's API log handler, for records logged inside a flow or task run only."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "flow_run_id", None) is None and not _in_run():
            return
        super().emit(record)


def attach(level: int = logging.INFO) -> None:
    """Send the library's records of ``level`` and above to the current run's logs (idempotent).

    The ``prefect_sgpu`` logger gets ``level`` only when nobody set one on it.
    """
    logger = logging.getLogger(LIBRARY_LOGGER)
    with _attach_lock:
        if not any(isinstance(h, RunLogHandler) for h in logger.handlers):
            handler = RunLogHandler()
            handler.setLevel(level)
            logger.addHandler(handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(level)
