"""Ports for the c10d rendezvous store on a local node.

A port found by binding port 0 comes from the kernel's ephemeral range, the same
range every outgoing connection draws its local port from. Between choosing it and
node 0's agent binding it (seconds: the agent imports torch first), another
connection (a rank's gloo socket, a Prefect client) may take it, and the rendezvous
fails with "The connection to the C10d store has failed". Ports are therefore chosen
outside the ephemeral range, where only listeners live, and never handed out twice
within a while by any process on this machine, so concurrent jobs do not pick the same
one: each port handed out is also reserved by a file ``port-<n>`` in the machine-wide
lease folder (:func:`prefect_sgpu.compute.leases.lease_dir`), created under a flock on
the folder's ``ports.lock``; a reservation older than ``REUSE_AFTER_S`` is stale.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from pathlib import Path

from prefect_sgpu.compute.leases import flock_within, lease_dir, open_shared

logger = logging.getLogger("prefect_sgpu.compute.ports")

#: lowest port considered (below are well-known and registered services)
LOW_PORT = 10000
#: a port handed out is not handed out again (by any process on this machine) for this long
REUSE_AFTER_S = 600.0
#: seconds between two sweeps of stale reservation files by this process
SWEEP_EVERY_S = 60.0
#: the longest wait for the folder's ports lock (held for a few file operations by its holder)
LOCK_WAIT_S = 10.0

_lock = threading.Lock()
_handed: dict[int, float] = {}
_last_sweep = float("-inf")
_folder_failed = False


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux default 32768-60999)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _reserve(folder: Path | None, port: int) -> bool:
    """Reserve ``port`` machine-wide (the caller holds the folder's flock); False: reserved already."""
    if folder is None:
        return True
    path = folder / f"port-{port}"
    try:
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                return False
            try:
                os.fchmod(fd, 0o666)  # another user's process may renew it once stale
            except OSError:
                pass
            os.close(fd)
            return True
        if age < REUSE_AFTER_S:
            return False
        try:
            os.utime(path, follow_symlinks=False)  # stale: renewed under the flock (never a link's target)
        except PermissionError:
            return False  # another user's reservation that this user cannot renew
        return True
    except OSError as exc:  # a folder that stopped working (full, removed): this process's guarantee only
        _folder_unusable(exc)
        return True


def _folder_unusable(exc: OSError) -> None:
    global _folder_failed
    if not _folder_failed:
        _folder_failed = True
        logger.warning("ports are not reserved across processes: the lease folder is unusable (%s)", exc)


def _sweep(folder: Path) -> None:
    """Remove stale reservations (the caller holds the folder's flock); at most once a minute."""
    global _last_sweep
    if time.monotonic() - _last_sweep < SWEEP_EVERY_S:
        return
    _last_sweep = time.monotonic()
    now = time.time()
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.startswith("port-"):
                    try:
                        if now - entry.stat().st_mtime > REUSE_AFTER_S:
                            os.unlink(entry.path)
                    except OSError:
                        pass
    except OSError:
        pass


def _folder_lock() -> tuple[Path | None, int | None]:
    """The lease folder and a descriptor holding its ports flock, or (None, None) when it is unusable."""
    try:
        folder = lease_dir()
        fd = open_shared(folder / "ports.lock")
    except OSError as exc:
        _folder_unusable(exc)
        return None, None
    try:
        if not flock_within(fd, LOCK_WAIT_S):  # held for ever by another user's process: do without it
            raise TimeoutError(f"{folder / 'ports.lock'} was held by another process for {LOCK_WAIT_S:.0f} s")
    except OSError as exc:
        os.close(fd)
        _folder_unusable(exc)
        return None, None
    except BaseException:
        os.close(fd)
        raise
    return folder, fd


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that is free now and outside the ephemeral range.

    Not handed out by this or (through the lease folder) any other process on this
    machine in the last ``REUSE_AFTER_S``, unless every candidate was: then any free port."""
    low, high = ephemeral_range()
    spans = [(a, b) for a, b in ((LOW_PORT, low - 1), (high + 1, 65535)) if b > a]
    now = time.monotonic()
    with _lock:
        for port, at in list(_handed.items()):
            if now - at > REUSE_AFTER_S:
                del _handed[port]
        folder, fd = _folder_lock()
        try:
            for _ in range(256):
                a, b = random.choice(spans) if spans else (LOW_PORT, 65535)
                port = random.randint(a, b)
                if port not in _handed and _bindable(host, port) and _reserve(folder, port):
                    _handed[port] = now
                    return port
        finally:
            if folder is not None and fd is not None:
                _sweep(folder)
                os.close(fd)  # drops the flock
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every candidate taken: any port
        s.bind((host, 0))
        return int(s.getsockname()[1])
