"""The machine-wide lease folder is shared by every user of the machine: a name another user plants
in it is never written through, a folder they control is refused, and a lock they hold for ever
delays nothing for ever. Real files, links and flocks in a private folder per test."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

from prefect_sgpu.compute import leases, ports
from prefect_sgpu.compute.local import LocalProcessCompute
from prefect_sgpu.errors import ProvisioningError
from prefect_sgpu.protocol.jobfolder import JobFolder
from prefect_sgpu.spec import JobSpec


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "leases"
    monkeypatch.setenv(leases.LEASE_DIR_ENV, str(path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    monkeypatch.setenv("PREFECT_SGPU_DEVICE", "cuda")
    return leases.lease_dir()


def _plant(kind: str, path: Path, victim: Path) -> None:
    if kind == "symlink":
        path.symlink_to(victim)
    elif kind == "hard link":
        os.link(victim, path)
    else:
        os.mkfifo(path)


@pytest.mark.parametrize("kind", ["symlink", "hard link", "fifo"])
def test_a_lock_file_planted_as_a_link_or_fifo_is_refused_and_never_written_through(
        folder: Path, tmp_path: Path, kind: str) -> None:
    """Another user plants ``gpu-0.lock`` pointing at one of this user's files: leasing GPU 0 used to
    truncate that file and write the holder note into it."""
    victim = tmp_path / "precious.txt"
    victim.write_text("this user's own data\n")
    _plant(kind, leases.lock_path(folder, "0"), victim)

    with pytest.raises(OSError, match="refused"):
        leases.try_lease(["0"], 1, "run-a")
    assert victim.read_text() == "this user's own data\n"
    lease, busy = leases.try_lease(["1", "2"], 2, "run-a")  # the other GPUs' files are as they were
    assert lease is not None and lease.gpus == ["1", "2"] and busy == []
    lease.close()

    spec = JobSpec(gpus=1, mlflow=False)
    compute = LocalProcessCompute(isolation="none")
    request = compute.plan(spec, "run-b")
    with pytest.raises(ProvisioningError, match=leases.LEASE_DIR_ENV):  # the job says what to change
        compute.acquire(request, JobFolder.local(tmp_path / "jobs" / "run-b", "00" * 32),
                        time.monotonic() + 60, threading.Event())
    assert victim.read_text() == "this user's own data\n"


def test_a_lease_folder_that_is_a_symlink_or_open_to_anyone_is_refused(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder itself: a symlink where it is expected (to a folder its planter controls), or a
    folder others may write without the sticky bit (anyone could swap its lock files)."""
    real = tmp_path / "theirs"
    real.mkdir(mode=0o1777)
    os.chmod(real, 0o1777)
    (tmp_path / "leases").symlink_to(real)
    monkeypatch.setenv(leases.LEASE_DIR_ENV, str(tmp_path / "leases"))
    with pytest.raises(OSError, match="not a folder"):
        leases.lease_dir()

    open_folder = tmp_path / "open"
    open_folder.mkdir()
    os.chmod(open_folder, 0o777)
    monkeypatch.setenv(leases.LEASE_DIR_ENV, str(open_folder))
    with pytest.raises(OSError, match="sticky"):
        leases.lease_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user takes root")
def test_a_lease_folder_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    theirs = tmp_path / "leases"
    theirs.mkdir()
    os.chmod(theirs, 0o1777)
    os.chown(theirs, 4242, 4242)
    monkeypatch.setenv(leases.LEASE_DIR_ENV, str(theirs))
    with pytest.raises(OSError, match="another user"):
        leases.lease_dir()


def test_a_ports_lock_held_for_ever_delays_a_port_but_does_not_block_it(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's process takes the folder's ``ports.lock`` and never lets go: choosing a
    rendezvous port waits a bounded time, then goes on with this process's own reservations."""
    monkeypatch.setattr(ports, "LOCK_WAIT_S", 0.5, raising=False)
    monkeypatch.setattr(ports, "_folder_failed", False)
    holder = os.open(folder / "ports.lock", os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file description: excludes this process too
    chosen: list[int] = []
    try:
        thread = threading.Thread(target=lambda: chosen.append(ports.free_port()), daemon=True)
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive() and chosen, "free_port waited for ever on a lock another process holds"
    finally:
        fcntl.flock(holder, fcntl.LOCK_UN)
        os.close(holder)
        thread.join(timeout=120)
    low, high = ports.ephemeral_range()
    assert not low <= chosen[0] <= high


def test_a_stale_port_reservation_planted_as_a_symlink_touches_nothing_through_it(
        folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Renewing a stale ``port-<n>`` reservation sets the time of the name itself, never of a file a
    planted symlink points at."""
    victim = tmp_path / "precious.txt"
    victim.write_text("data\n")
    old = time.time() - 10 * ports.REUSE_AFTER_S
    os.utime(victim, (old, old))
    port = 23456  # the candidates: this port and the next, both with a planted stale reservation
    for candidate in (port, port + 1):
        (folder / f"port-{candidate}").symlink_to(victim)
    monkeypatch.setattr(ports, "LOW_PORT", port)
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (port + 2, 65535))
    monkeypatch.setattr(ports, "_handed", {})
    monkeypatch.setattr(ports, "_last_sweep", float("inf"))  # no sweep: the renewal is what is checked
    assert ports.free_port() in (port, port + 1)
    assert victim.stat().st_mtime == pytest.approx(old, abs=1.0), "the symlink's target was touched"
