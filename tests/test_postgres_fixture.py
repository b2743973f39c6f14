"""The PostgreSQL server of ``support.postgres`` ends with its fixture on every path: a normal
teardown, an interrupted test (KeyboardInterrupt), and an owner process that dies without running
its ``finally`` (SIGTERM, SIGKILL: an xdist worker ended by its controller, a CI timeout)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.postgres import bin_dir

pytestmark = pytest.mark.skipif(bin_dir() is None, reason="PostgreSQL's server programs are not installed")

SUPPORT = Path(__file__).resolve().parent


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone(pid: int, root: Path, timeout: float = 90.0) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) or root.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_server_and_its_folder_are_gone_after_the_fixtures_teardown_and_after_an_interrupt() -> None:
    from support.postgres import postgres

    with postgres() as cluster:
        pid, root = cluster.pid, cluster.data.parent
        assert _alive(pid) and cluster.query("postgres", "SELECT 1") == [(1,)]
    assert not _alive(pid) and not root.exists()

    with pytest.raises(KeyboardInterrupt), postgres() as cluster:  # Ctrl-C inside a test
        pid, root = cluster.pid, cluster.data.parent
        raise KeyboardInterrupt
    assert not _alive(pid) and not root.exists()


#: a test process may start its children with SIGTERM ignored or blocked (both are inherited across exec); the
#: owner puts it back to its default first, as a process started from a shell has it
OWNER = """
import json, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
sys.path.insert(0, sys.argv[1])
from support.postgres import postgres
with postgres() as cluster:
    print(json.dumps({"pid": cluster.pid, "root": str(cluster.data.parent)}), flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_the_server_and_its_folder_are_gone_when_the_fixtures_process_dies_without_its_teardown(sig: int) -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(SUPPORT)], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        up = json.loads(owner.stdout.readline())  # type: ignore[union-attr]
        pid, root = int(up["pid"]), Path(up["root"])
        assert _alive(pid)
        owner.send_signal(sig)  # no ``finally`` runs in the owner: Python's default SIGTERM ends it at once
        owner.wait(timeout=30)
        assert _gone(pid, root), f"postgres {pid} or {root} outlived the process that started it"
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
            owner.wait()
