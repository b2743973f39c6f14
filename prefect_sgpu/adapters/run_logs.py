"""The library's own log lines in the Prefect run they belong to.

Every logger of the library is a child of ``prefect_sgpu``. Inside a flow or task run
(a GPU task's body, a ``.distributed()`` call in a flow, a job submitted from one),
:class:`RunLogHandler` — Prefect's own API log handler — sends its records to that run's
logs, so the "no GPU on this machine" warning and every EC2 phase line show in the UI
beside the rank output. Outside a run it passes records by (Prefect's handler would
complain that there is no flow run), and where the user put Prefect's own handler on the
library's loggers (``PREFECT_LOGGING_EXTRA_LOGGERS``) it leaves the records to that one, so no
line reaches the run twice. The terminal keeps printing them as before, through
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


def _sent_by_prefect(name: str) -> bool:
    """Whether Prefect's own API log handler is on logger ``name`` or a logger its records reach
    (``PREFECT_LOGGING_EXTRA_LOGGERS=prefect_sgpu`` puts it on the library's logger): that one
    sends the record to the run already."""
    logger: logging.Logger | None = logging.getLogger(name)
    while logger is not None:
        if any(isinstance(h, APILogHandler) and not isinstance(h, RunLogHandler) for h in logger.handlers):
            return True
        logger = logger.parent if logger.propagate else None
    return False


class RunLogHandler(APILogHandler):
    """Prefect's API log handler, for records logged inside a flow or task run only, and only
    those that Prefect's own handler does not send already."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "flow_run_id", None) is None and not _in_run():
            return
        if _sent_by_prefect(record.name):
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
