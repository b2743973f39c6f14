"""Which TCP sockets given processes listen on, read from /proc (no tool, nothing machine-wide)."""

from __future__ import annotations

import os
import socket
from typing import NamedTuple

#: the ``st`` column of /proc/net/tcp for a listening socket
_LISTEN = "0A"


class Listener(NamedTuple):
    pid: int
    address: str
    port: int


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)  # the kernel writes each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def listeners(pids: list[int]) -> list[Listener]:
    """Every listening TCP socket (IPv4 and IPv6) held by one of ``pids``, read in each one's own
    network namespace (``/proc/<pid>/net``)."""
    found = []
    for pid in pids:
        inodes = _socket_inodes(pid)
        for table in ("tcp", "tcp6"):
            try:
                lines = open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if fields[3] == _LISTEN and fields[9] in inodes:
                    hex_address, hex_port = fields[1].split(":")
                    found.append(Listener(pid, _address(hex_address), int(hex_port, 16)))
    return found
