"""A job's cleanup runs to its end even when an exception is raised into the thread running it, as
Prefect's ``timeout_seconds`` raises one into a task's thread (``PyThreadState_SetAsyncExc``)."""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, Callable

import pytest

from prefect_sgpu.driver import interrupts


def _raise_into(thread: threading.Thread, exc_type: type[BaseException]) -> None:
    """What Prefect's watcher thread does when a task's timeout passes."""
    assert thread.ident is not None
    assert ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc_type)) == 1


def _interrupted_while(run: Callable[[Callable[[], str]], Any]) -> tuple[list[int], list[BaseException]]:
    """Run a 20-step cleanup through ``run`` in a thread; raise ``TimeoutError`` into that thread
    once the cleanup has begun. The steps done and what the thread raised."""
    steps: list[int] = []
    begun = threading.Event()

    def cleanup() -> str:
        begun.set()
        for i in range(20):  # Python code all along: an exception raised into its thread lands here
            time.sleep(0.05)
            steps.append(i)
        return "released"

    raised: list[BaseException] = []

    def caller() -> None:
        try:
            run(cleanup)
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            raised.append(exc)

    thread = threading.Thread(target=caller)
    thread.start()
    assert begun.wait(30)
    _raise_into(thread, TimeoutError)
    thread.join(60)
    assert not thread.is_alive()
    return steps, raised


def test_an_exception_raised_into_the_waiting_thread_is_raised_after_the_cleanup_ends() -> None:
    steps, raised = _interrupted_while(lambda fn: fn())  # unshielded: the cleanup is cut short
    assert len(steps) < 20 and len(raised) == 1 and isinstance(raised[0], TimeoutError), (steps, raised)

    steps, raised = _interrupted_while(interrupts.shielded)
    assert steps == list(range(20)), "the shielded cleanup was cut short"
    assert len(raised) == 1 and isinstance(raised[0], TimeoutError), raised


def test_shielded_returns_the_value_or_raises_the_error_of_its_call() -> None:
    assert interrupts.shielded(lambda a, b: a + b, 2, 3) == 5

    def fails() -> None:
        raise RuntimeError("release failed")

    with pytest.raises(RuntimeError, match="release failed"):
        interrupts.shielded(fails)
