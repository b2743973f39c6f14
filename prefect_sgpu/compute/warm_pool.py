"""Warm allocations of the local compute: node processes kept between jobs.

A cold local job starts one interpreter per node and one per rank, each importing torch.
A warm allocation keeps one :mod:`~prefect_sgpu.launch.warm_node` process per node (torch
imported, nothing of any job in it) and hands it the next job of the same shape, so
consecutive GPU tasks of a flow and repeated ``.distributed()`` calls of one driver pay the
start once.

Lifetime: a warm set belongs to this driver process. It is in one job at a time; between
jobs it waits in the pool of this process, and goes away

- when the compute that used it last is closed (the task runner closes its compute when
  the flow ends), or on demand (:func:`release_warm`);
- after ``keep_warm`` seconds without a job;
- when this interpreter exits; and if the driver dies outright, because each warm node
  exits when its stdin (a pipe from the driver) reaches end of file.

A warm node that died, or whose job could not be stopped cleanly, is never reused.

This is the driver's half: the pool and its sets. The channel to one warm node process is
:mod:`prefect_sgpu.procs.warm_channel`, shared with the remote lease node, which starts warm
nodes on its own machine.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.procs.warm_channel import WarmNodeProcess

logger = logging.getLogger("prefect_sgpu.compute.warm_pool")

@dataclass(kw_only=True)
class Pooled:
    """What the pool keeps of anything warm (local warm sets, Ray warm groups): its shape and its
    idle time. Subclasses say whether it can serve another job (``healthy``) and how it ends."""

    key: tuple[Any, ...]
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    jobs: int = 0
    idle_since: float = 0.0
    keep_warm: float = 0.0
    owner: int = 0
    in_use: bool = True
    closed: bool = False
    #: ``time.monotonic()`` when a job on this set, nodes unchanged since, last passed the gang check
    #: (None: never, or a job on it failed since)
    gang_checked_at: float | None = None
    #: the nodes (index, address, host, instance id) of the job that passed it: a set whose nodes differ
    #: from these is checked again
    gang_checked_nodes: tuple[tuple[Any, ...], ...] = ()

    def healthy(self) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


@dataclass(kw_only=True)
class WarmSet(Pooled):
    """The warm nodes of one allocation shape, and the GPUs they hold."""

    nodes: list[WarmNodeProcess]
    lease: Any = None  # the GpuLease (prefect_sgpu.compute.leases) its node holds, if any

    @property
    def gpus(self) -> list[str]:
        return list(self.lease.gpus) if self.lease is not None else []

    def healthy(self) -> bool:
        return not self.closed and all(n.alive() for n in self.nodes)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for node in self.nodes:  # end of file to all first: they stop together
            try:
                if node.proc.stdin is not None:
                    node.proc.stdin.close()
            except OSError:
                pass
        for node in self.nodes:
            node.close()
        if self.lease is not None:
            self.lease.close()
        logger.debug("warm set %s closed after %d job(s)", self.id, self.jobs)


def start_set(key: tuple[Any, ...], argvs: list[list[str]], env: dict[str, str], logs: Path,
              lease: Any, fds_of: Callable[[int], list[int]], until: float,
              cancel: threading.Event, run_id: str, timeout: float) -> WarmSet:
    """Start one warm node per argv and wait until all have preloaded; on any failure none is left."""
    nodes: list[WarmNodeProcess] = []
    warm = WarmSet(key=key, nodes=nodes, lease=lease)
    try:
        for index, argv in enumerate(argvs):
            nodes.append(WarmNodeProcess(index, argv, env, logs / f"warm-{warm.id}-node-{index}.log", fds_of(index)))
        for node in nodes:
            node.wait_ready(until, cancel, run_id, timeout)
    except BaseException:
        warm.close()
        raise
    return warm


class WarmPool:
    """This process's idle warm sets, by shape; one reaper thread ends the ones idle too long."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sets: list[Pooled] = []
        self._wake = threading.Event()
        self._reaper: threading.Thread | None = None

    def take(self, key: tuple[Any, ...], owner: int) -> Any:
        """An idle healthy set of this shape, now in use by ``owner``; broken ones are closed."""
        broken: list[Pooled] = []
        found = None
        with self._lock:
            for warm in list(self._sets):
                if warm.in_use or warm.key != key:
                    continue
                if not warm.healthy():
                    self._sets.remove(warm)
                    broken.append(warm)
                    continue
                warm.in_use, warm.owner, found = True, owner, warm
                break
        for warm in broken:
            warm.close()
        return found

    def add(self, warm: Pooled, owner: int) -> None:
        with self._lock:
            warm.in_use, warm.owner = True, owner
            self._sets.append(warm)

    def give_back(self, warm: Pooled, keep_warm: float) -> None:
        """After a job: idle, for the next job of its shape, until ``keep_warm`` seconds pass (closed
        at once when its owner was closed meanwhile, or when it is not healthy)."""
        if warm.keep_warm < 0 or keep_warm <= 0 or not warm.healthy():
            self.discard(warm)
            return
        with self._lock:
            warm.in_use, warm.idle_since, warm.keep_warm = False, time.monotonic(), keep_warm
            warm.jobs += 1
            if self._reaper is None or not self._reaper.is_alive():
                self._reaper = threading.Thread(target=self._reap, name="sgpu-warm-reaper", daemon=True)
                self._reaper.start()
        self._wake.set()

    def discard(self, warm: Pooled) -> None:
        with self._lock:
            if warm in self._sets:
                self._sets.remove(warm)
        warm.close()

    def close(self, owner: int | None = None) -> int:
        """Close idle sets (of ``owner``, or all); sets in a job close when it gives them back."""
        with self._lock:
            gone = [w for w in self._sets if not w.in_use and (owner is None or w.owner == owner)]
            for warm in self._sets:
                if warm.in_use and (owner is None or warm.owner == owner):
                    warm.keep_warm = -1.0  # closed on give_back
            for warm in gone:
                self._sets.remove(warm)
        for warm in gone:
            warm.close()
        return len(gone)

    def idle(self) -> list[Any]:
        with self._lock:
            return [w for w in self._sets if not w.in_use]

    def _reap(self) -> None:
        while True:
            self._wake.wait(1.0)
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                expired = [w for w in self._sets if not w.in_use and now - w.idle_since >= w.keep_warm]
                for warm in expired:
                    self._sets.remove(warm)
            for warm in expired:
                logger.debug("warm set %s idle for %.0fs: closing it", warm.id, now - warm.idle_since)
                warm.close()


POOL = WarmPool()


def release_warm() -> int:
    """Close every idle warm allocation of this process now; returns how many were closed.

    Warm sets that are in a job close when that job ends."""
    return POOL.close()


atexit.register(release_warm)


def check_keep_warm(field: str, value: Any, zero: str) -> float:
    """``keep_warm`` seconds as a float, or SGPUConfigError naming ``field`` (``zero``: what 0 means)."""
    try:
        seconds = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError):
        seconds = -1.0
    if seconds < 0:
        raise SGPUConfigError(field, value, f"seconds (a number >= 0; 0: {zero})")
    return seconds
