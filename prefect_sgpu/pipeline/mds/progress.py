"""Progress of a conversion: a rich bar in the terminal and, in a Prefect task run, an artifact.

Conversions of large sources take minutes, and a run in the Prefect UI should show how
far one got. Reporting must never cost a conversion: an artifact only appears once a
conversion has run a while, and a failure to write one is logged and then ignored.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

# one logger for the whole package, the one it had before it was split into files
logger = logging.getLogger("prefect_sgpu.pipeline.mds")

#: a Prefect progress artifact is created once a conversion has run this long (seconds)
ARTIFACT_AFTER_S = 2.0
ARTIFACT_EVERY_S = 2.0


class ConversionProgress:
    """A rich progress bar in the terminal and, inside a Prefect task run, a progress artifact."""

    def __init__(self, enabled: bool, total: int | None, label: str) -> None:
        self.total = total
        self.label = label
        self.bar: Any = None
        self.task_id: Any = None
        self.started = time.monotonic()
        self.artifact_id: Any = None
        self.last_artifact = 0.0
        self.in_task_run = enabled and _in_prefect_task_run()
        if enabled:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("rows"), TimeElapsedColumn(), TimeRemainingColumn(),
                                transient=False, refresh_per_second=2)
            self.bar.start()
            self.task_id = self.bar.add_task(label, total=total)

    def advance(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task_id, completed=done)
        if self.in_task_run and self.total:
            now = time.monotonic()
            if now - self.started >= ARTIFACT_AFTER_S and now - self.last_artifact >= ARTIFACT_EVERY_S:
                self._artifact(100.0 * done / self.total)
                self.last_artifact = now

    def _artifact(self, percent: float) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        try:
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(percent, description=f"MDS conversion: {self.label}")
            else:
                update_progress_artifact(self.artifact_id, percent)
        except Exception as exc:  # noqa: BLE001 - progress reporting must never fail a conversion
            logger.debug("progress artifact not updated: %s", exc)
            self.in_task_run = False

    def close(self, done: int, ok: bool) -> None:
        if self.bar is not None:
            self.bar.update(self.task_id, completed=done)
            self.bar.stop()
        if ok and self.artifact_id is not None:
            self._artifact(100.0)


def _in_prefect_task_run() -> bool:
    if "prefect" not in sys.modules:  # never import Prefect just to find out
        return False
    from prefect.context import TaskRunContext

    return TaskRunContext.get() is not None
