"""The driver's side of liveness: its heartbeat, and riding out a store that stops answering.

Nodes stop themselves when the driver's sealed heartbeat (``heartbeat`` in the job folder, a
sequence number that only grows) has not moved for their TTL, so a dead driver leaks no paid
machine. The heartbeat is the driver's alone: :class:`DriverHeartbeat` writes it from a thread
of its own, from before the first node is asked for until the job's control files go, through
acquire, waiting, stop, release and relaunch alike. Computes never write it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from prefect_sgpu.errors import StoreUnreachable

if TYPE_CHECKING:
    from prefect_sgpu.protocol.jobfolder import JobFolder

logger = logging.getLogger("prefect_sgpu.driver.job")

#: seconds between two heartbeats; node TTLs are minutes (at least seconds in tests)
HEARTBEAT_INTERVAL_S = 2.0
class DriverHeartbeat:
    """Beats ``folder``'s heartbeat every ``interval`` seconds until :meth:`stop` (idempotent).

    The first beat is written by :meth:`start` itself, so a store that cannot be written fails
    the job before anything is spent. A later failed beat is retried at the next interval (the
    driver's poll loop judges a store outage, :class:`Outage`).
    """

    def __init__(self, folder: "JobFolder", interval: float | None = None) -> None:
        self.folder = folder
        self.interval = HEARTBEAT_INTERVAL_S if interval is None else interval
        self._done = threading.Event()
        #: why the ranks are asked for a final checkpoint (every beat from then on says so); empty: not asked
        self.checkpoint = ""
        self._thread = threading.Thread(target=self._loop, name=f"sgpu-beat-{folder.run_id}", daemon=True)

    def start(self) -> "DriverHeartbeat":
        self.folder.beat()
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._done.wait(self.interval):
            try:
                self.folder.beat(self.checkpoint)
            except Exception:  # noqa: BLE001 - the next beat may succeed; the nodes' TTL is the limit
                logger.debug("job %s: heartbeat failed", self.folder.run_id, exc_info=True)

    def ask_checkpoint(self, reason: str) -> None:
        """Ask every node's ranks for a final checkpoint now (``reason`` says why): this beat and every
        later one carry it, so a node that misses one reads it in the next, and a relaunched gang too.
        A beat that cannot be written now is written again by the thread at the next interval."""
        self.checkpoint = reason
        try:
            self.folder.beat(reason)
        except Exception:  # noqa: BLE001 - the thread's next beat carries it
            logger.debug("job %s: heartbeat failed", self.folder.run_id, exc_info=True)

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


class Outage:
    """The store (or cloud API) failing beyond botocore's own retries: ride it out for as long as the
    nodes do (their heartbeat TTL), saying so once in a while; past that, fail like the nodes do."""

    def __init__(self, run_id: str, ttl: float) -> None:
        self.run_id = run_id
        self.ttl = ttl
        self.since: float | None = None
        self.logged = 0.0

    def failed(self, exc: Exception) -> None:
        now = time.monotonic()
        self.since = self.since if self.since is not None else now
        if now - self.since > self.ttl:
            raise StoreUnreachable(
                f"job {self.run_id}: the job store has failed every call for {now - self.since:.0f}s, longer "
                f"than the nodes' heartbeat TTL ({self.ttl:g}s), after which they stop themselves: {exc}"
            ) from exc
        if now - self.logged > 30.0:
            self.logged = now
            logger.warning("job %s: the job store is unreachable (%s: %s); the nodes keep running for up to "
                           "%gs; retrying", self.run_id, type(exc).__name__, exc, self.ttl)

    def over(self) -> None:
        if self.since is not None:
            logger.warning("job %s: the job store answers again after %.0fs", self.run_id,
                           time.monotonic() - self.since)
            self.since = None


