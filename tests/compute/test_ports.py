"""Rendezvous ports: outside the ephemeral range, free, and never handed out twice (by any process)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefect_sgpu.compute.ports import ephemeral_range, free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _private_lease_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Reservations of this test only, not those of whatever else runs on this machine."""
    folder = tmp_path / "leases"
    monkeypatch.setenv("PREFECT_SGPU_LEASE_DIR", str(folder))
    return folder


def _only_candidates(monkeypatch: pytest.MonkeyPatch, low: int, count: int) -> None:
    """free_port considers the ports low .. low + count - 1 only, and forgets what this process handed out."""
    from prefect_sgpu.compute import ports

    monkeypatch.setattr(ports, "LOW_PORT", low)
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (low + count, 65535))
    monkeypatch.setattr(ports, "_handed", {})


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
        _only_candidates(monkeypatch, busy[0], 3)
        picked = ports.free_port()
        assert picked not in busy, "a port with a listener was handed out"
    finally:
        for s in listeners:
            s.close()


#: one process: ``count`` ports from the span low .. low + span - 1, printed as JSON
PICKER = r"""
import json, sys
from prefect_sgpu.compute import ports
low, span, count = map(int, sys.argv[1:4])
ports.LOW_PORT = low
ports.ephemeral_range = lambda: (low + span, 65535)
print(json.dumps([ports.free_port() for _ in range(count)]))
"""


def test_two_processes_never_hand_out_the_same_port(_private_lease_folder: Path) -> None:
    # 100 candidates, 2 x 25 picks at once: without reservations across processes,
    # a repeat is all but certain (birthday problem: ~99.9 %)
    low, span, count = random.randrange(20000, 30000), 100, 25
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    pickers = [subprocess.Popen([sys.executable, "-c", PICKER, str(low), str(span), str(count)], env=env,
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    picked = [json.loads(p.communicate(timeout=120)[0]) for p in pickers]
    assert all(p.returncode == 0 for p in pickers)
    every = picked[0] + picked[1]
    assert all(low <= port < low + span for port in every), "only the narrow span was used"
    assert len(set(every)) == len(every), f"a port was handed out twice: {sorted(every)}"

    # and a process started later does not take them either while their reservations are fresh
    later = subprocess.run([sys.executable, "-c", PICKER, str(low), str(span), str(span - 2 * count)],
                           env=env, capture_output=True, text=True, timeout=120)
    assert not set(json.loads(later.stdout)) & set(every)


def test_a_stale_reservation_is_taken_again_and_swept(monkeypatch: pytest.MonkeyPatch,
                                                      _private_lease_folder: Path) -> None:
    from prefect_sgpu.compute import ports

    port = next(p for p in iter(lambda: random.randrange(20000, 30000), None) if ports._bindable("127.0.0.1", p))
    _only_candidates(monkeypatch, port, 2)
    _private_lease_folder.mkdir()
    reservation = _private_lease_folder / f"port-{port}"
    for candidate in (port, port + 1):  # fresh: another process handed them out just now
        (_private_lease_folder / f"port-{candidate}").touch()
    assert ports.free_port() not in (port, port + 1), "a freshly reserved port was handed out"

    old = time.time() - 2 * ports.REUSE_AFTER_S
    os.utime(reservation, (old, old))  # stale
    other = _private_lease_folder / "port-1"
    other.touch()
    os.utime(other, (old, old))
    monkeypatch.setattr(ports, "_last_sweep", float("-inf"))
    assert ports.free_port() == port, "a stale reservation is taken again"
    assert time.time() - reservation.stat().st_mtime < ports.REUSE_AFTER_S, "and renewed"
    assert not other.exists(), "stale reservations are swept"


def test_ports_are_handed_out_when_the_lease_folder_is_unusable(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("PREFECT_SGPU_LEASE_DIR", str(blocked / "leases"))
    low, high = ephemeral_range()
    port = free_port()
    assert not low <= port <= high
