"""Running a job in a thread, so a test can cancel it or watch it from outside."""

from __future__ import annotations

import threading
from typing import Any


def run_in_thread(job: Any) -> tuple[threading.Thread, list[BaseException | None]]:
    """Start ``job.run()`` in a thread; the list receives its exception (or None) when it ends."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            job.run()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    thread = threading.Thread(target=run, name=f"job-{job.run_id}")
    thread.start()
    return thread, outcome


def drive(job: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Start ``job.run()`` in a daemon thread; the dict receives ``result`` or ``error`` when it ends."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = job.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"job-{job.run_id}", daemon=True)
    thread.start()
    return thread, outcome
