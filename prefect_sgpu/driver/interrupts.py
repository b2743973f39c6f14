"""Ctrl-C, SIGTERM, SIGHUP and interpreter exit stop every job this process drives.

Each running job registers its cancel event here. Ctrl-C raises ``KeyboardInterrupt``
in the main thread; a job running there cleans up on the way out (every rank stopped,
capacity released, MLflow run ended KILLED). Jobs running in the background
(``.submit()``) are cancelled when the main thread is interrupted while waiting on one
of them, and at interpreter exit, before ``concurrent.futures`` joins its threads, so a
process never waits hours for ranks nobody will read.

SIGTERM and SIGHUP take the same path as Ctrl-C, but only where nobody installed a
handler of their own (Prefect's flow-run engine, a web server): the handler is set when
a job starts in, or is submitted from, the main thread, and only over the default one.
"""

from __future__ import annotations

import contextvars
import logging
import signal
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")

logger = logging.getLogger("prefect_sgpu.driver.interrupts")

_live: set[threading.Event] = set()
_lock = threading.Lock()
_installed = False
#: the signals that mean "stop" to a driver, besides SIGINT
STOP_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s)


@contextmanager
def running(cancel: threading.Event) -> Iterator[None]:
    """Register a job's cancel event while it runs."""
    with _lock:
        _live.add(cancel)
    try:
        yield
    finally:
        with _lock:
            _live.discard(cancel)


def cancel_all(reason: str = "interrupted") -> int:
    """Set every running job's cancel event (each stops its ranks and cleans up); how many."""
    with _lock:
        events = [e for e in _live if not e.is_set()]
    for event in events:
        event.set()
    if events:
        logger.warning("%s: cancelling %d running job(s); their ranks are being stopped", reason, len(events))
    return len(events)


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")


def install() -> None:
    """SIGTERM/SIGHUP -> KeyboardInterrupt (where still default), and cancel at interpreter exit.

    Only from the main thread (Python's rule for signal handlers); elsewhere a no-op.
    """
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return
    with _lock:
        first, _installed = not _installed, True
    if first:
        # runs before concurrent.futures joins its workers (threading runs these in reverse order)
        threading._register_atexit(lambda: cancel_all("interpreter exit"))  # type: ignore[attr-defined]
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _interrupt)


def shielded(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` run to its end whatever is raised into the calling thread meanwhile.

    Cleanup (stop every rank, release the compute, end the MLflow run) must not be cut short
    by an exception raised into the thread that runs it: Prefect's ``timeout_seconds`` raises
    one into a task's thread when the timeout passes (``PyThreadState_SetAsyncExc``), and
    Ctrl-C raises ``KeyboardInterrupt`` in the main thread. ``fn`` runs in a thread of its own
    (with the caller's context, so its log lines reach the same run), and the caller waits for
    it to end; what was raised into the caller meanwhile is raised after, else what ``fn``
    raised, else its value is returned. Such an exception can land anywhere in the caller,
    even while the thread is being started: a start that may not have happened is made again,
    and a lock lets only the first thread to get there run ``fn``.
    """
    box: dict[str, Any] = {}
    claim = threading.Lock()
    done = threading.Event()

    def target() -> None:
        if not claim.acquire(blocking=False):
            return  # an earlier start of this call runs fn
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            box["error"] = exc
        finally:
            done.set()

    raised: BaseException | None = None
    start = True
    while True:
        try:
            if start:
                threading.Thread(target=contextvars.copy_context().run, args=(target,),
                                 name=f"sgpu-shielded-{getattr(fn, '__name__', 'call')}").start()
                start = False
            done.wait()
            break
        except BaseException as exc:  # noqa: BLE001 - kept, raised once fn has ended
            if raised is None:
                raised = exc
                logger.warning("%s raised while cleaning up: the cleanup goes on, then it is raised",
                               type(exc).__name__)
            start = not claim.locked() and not done.is_set()
    if raised is not None:
        if "error" in box:
            raise raised from box["error"]
        raise raised
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]
