"""Rendezvous ports: outside the ephemeral range, free, and never handed out twice."""

from __future__ import annotations

import socket

import pytest

from prefect_sgpu.compute.ports import ephemeral_range, free_port


def test_ports_avoid_the_ephemeral_range_and_repeats() -> None:
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports), "a port was handed out twice"
    assert not [p for p in ports if low <= p <= high], "ports from the ephemeral range can be stolen"


def test_a_listening_port_is_never_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect_sgpu.compute import ports

    listeners = [socket.socket() for _ in range(2)]
    try:
        for s in listeners:
            s.bind(("127.0.0.1", 0))
            s.listen()
        busy = sorted(s.getsockname()[1] for s in listeners)
        # a span of three candidates, two of them listening: only the third can come back
        monkeypatch.setattr(ports, "LOW_PORT", busy[0])
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (busy[0] + 3, 65535))
        monkeypatch.setattr(ports, "_handed", {})
        picked = ports.free_port()
        assert picked not in busy, "a port with a listener was handed out"
    finally:
        for s in listeners:
            s.close()
