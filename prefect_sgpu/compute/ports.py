"""Ports for the c10d rendezvous store on a local node.

A port found by binding port 0 comes from the kernel's ephemeral range, the same
range every outgoing connection draws its local port from. Between choosing it and
node 0's agent binding it (seconds: the agent imports torch first), another
connection (a rank's gloo socket, a Prefect client) may take it, and the rendezvous
fails with "The connection to the C10d store has failed". Ports are therefore chosen
outside the ephemeral range, where only listeners live, and never handed out twice
by this process within a while, so concurrent jobs do not pick the same one.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from pathlib import Path

#: lowest port considered (below are well-known and registered services)
LOW_PORT = 10000
#: a port handed out is not handed out again by this process for this long
REUSE_AFTER_S = 600.0

_lock = threading.Lock()
_handed: dict[int, float] = {}


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


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that is free now and outside the ephemeral range."""
    low, high = ephemeral_range()
    spans = [(a, b) for a, b in ((LOW_PORT, low - 1), (high + 1, 65535)) if b > a]
    now = time.monotonic()
    with _lock:
        for port, at in list(_handed.items()):
            if now - at > REUSE_AFTER_S:
                del _handed[port]
        for _ in range(256):
            a, b = random.choice(spans) if spans else (LOW_PORT, 65535)
            port = random.randint(a, b)
            if port not in _handed and _bindable(host, port):
                _handed[port] = now
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every candidate taken: any port
        s.bind((host, 0))
        return int(s.getsockname()[1])
