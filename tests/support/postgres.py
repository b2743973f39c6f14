"""A PostgreSQL server, and a Prefect server whose database it is, as a production user runs Prefect.

Debian's ``postgresql`` package provides the programs (``./dev`` installs it where it is
missing). The cluster lives in a fresh folder, listens on 127.0.0.1 only, on a free port, and
asks for a password (SCRAM) that only this harness knows. PostgreSQL refuses to run as root: as
root the cluster belongs to the package's ``postgres`` user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from support.aws_fixtures import free_port
from support.served import served


def bin_dir() -> Path | None:
    """Where PostgreSQL's server programs are (the newest version Debian installed), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


@dataclass
class Postgres:
    """A running cluster: ``url(db)`` is SQLAlchemy's asyncpg URL for database ``db``."""

    port: int
    password: str
    data: Path
    pid: int = 0  # the postmaster's process id

    def url(self, database: str) -> str:
        return f"postgresql+asyncpg://postgres:{self.password}@127.0.0.1:{self.port}/{database}"

    def query(self, database: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        """Rows of one statement, read straight from the database (asyncpg, as Prefect's server)."""
        import asyncio

        import asyncpg

        async def run() -> list[tuple[Any, ...]]:
            conn = await asyncpg.connect(host="127.0.0.1", port=self.port, user="postgres",
                                         password=self.password, database=database)
            try:
                return [tuple(row) for row in await conn.fetch(sql, *args)]
            finally:
                await conn.close()

        return asyncio.run(run())

    def create_database(self, name: str) -> None:
        import asyncio

        import asyncpg

        async def run() -> None:
            conn = await asyncpg.connect(host="127.0.0.1", port=self.port, user="postgres",
                                         password=self.password, database="postgres")
            try:
                await conn.execute(f'CREATE DATABASE "{name}"')
            finally:
                await conn.close()

        asyncio.run(run())


#: The guard of a cluster: a process of its own session that reads the owner's lines ("pid N" once the
#: postmaster runs, "done" once the owner has stopped it) until end of input. End of input without
#: "done" means the owner died without its ``finally`` (SIGTERM or SIGKILL from xdist, a CI timeout or
#: pytest-timeout's thread method, which calls ``os._exit``): the guard then stops the postmaster as
#: the owner does (SIGINT, PostgreSQL's "fast" shutdown; SIGKILL after 60 s) and removes the folder.
#: The pipe's write end is not inheritable, so the owner's other children never hold it open.
_GUARD = r"""
import os, shutil, signal, sys, time
pid, done = 0, False
for line in sys.stdin:
    word = line.split()
    if word[:1] == ["pid"]:
        pid = int(word[1])
    elif word == ["done"]:
        done = True
if done:
    sys.exit(0)

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

if pid and alive(pid):
    os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + 60
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)
shutil.rmtree(sys.argv[1], ignore_errors=True)
"""


def _start_guard(root: Path) -> subprocess.Popen[bytes]:
    """The guard of the cluster in ``root`` (see ``_GUARD``), started before anything is in ``root``."""
    return subprocess.Popen([sys.executable, "-c", _GUARD, str(root)], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _tell_guard(guard: subprocess.Popen[bytes], line: str) -> None:
    assert guard.stdin is not None
    guard.stdin.write(f"{line}\n".encode())
    guard.stdin.flush()


def _as_owner() -> dict[str, Any]:
    """Popen arguments that run a PostgreSQL program as the cluster's owner."""
    return {"user": "postgres", "group": "postgres"} if os.geteuid() == 0 else {}


@contextlib.contextmanager
def postgres() -> Iterator[Postgres]:
    """A fresh cluster for as long as the context lasts; its folder is removed afterwards."""
    programs = bin_dir()
    if programs is None:
        raise RuntimeError("PostgreSQL's server programs are not installed: `./dev test` installs Debian's "
                           "postgresql package, or run `apt-get install postgresql`")
    root = Path(tempfile.mkdtemp(prefix="sgpu-postgres-"))
    data, password = root / "data", secrets.token_urlsafe(24)
    pwfile = root / "pw"
    pwfile.write_text(password + "\n")
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
        shutil.chown(pwfile, "postgres", "postgres")
    os.chmod(pwfile, 0o600)
    port = free_port()
    proc = None
    guard = _start_guard(root)
    try:
        subprocess.run([str(programs / "initdb"), "-D", str(data), "-U", "postgres", "--auth=scram-sha-256",
                        f"--pwfile={pwfile}", "--encoding=UTF8", "--locale=C"], check=True,
                       capture_output=True, timeout=120, cwd=root, **_as_owner())
        pwfile.unlink()
        log = open(root / "server.log", "ab")
        proc = subprocess.Popen(
            [str(programs / "postgres"), "-D", str(data), "-c", "listen_addresses=127.0.0.1", "-p", str(port),
             "-c", f"unix_socket_directories={root}", "-c", "fsync=off", "-c", "max_connections=200"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root, **_as_owner())
        log.close()
        _tell_guard(guard, f"pid {proc.pid}")
        cluster = Postgres(port, password, data, proc.pid)
        deadline = time.monotonic() + 120
        while True:  # up when it answers a query (a first start on a busy machine takes seconds)
            if proc.poll() is not None:
                raise RuntimeError(f"postgres exited ({proc.returncode}): {(root / 'server.log').read_text()[-2000:]}")
            try:
                cluster.query("postgres", "SELECT 1")
                break
            except (OSError, Exception) as exc:  # noqa: BLE001 - refused until it listens
                if time.monotonic() > deadline:
                    raise RuntimeError(f"postgres did not answer in 120 s: {exc}") from exc
                time.sleep(0.2)
        yield cluster
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # "fast" shutdown: clients are disconnected, no wait for them
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)
        with contextlib.suppress(OSError):
            _tell_guard(guard, "done")  # stopped and removed here: the guard leaves without acting
            guard.stdin.close()
        guard.wait(timeout=30)


@contextlib.contextmanager
def prefect_server_on(cluster: Postgres, database: str = "prefect") -> Iterator[str]:
    """``prefect server start`` with ``database`` of ``cluster`` as its database; its API URL."""
    cluster.create_database(database)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_DATABASE_CONNECTION_URL": cluster.url(database),
                "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_API_PORT": str(port),
                "PREFECT_UI_ENABLED": "false"})
    api = f"http://127.0.0.1:{port}/api"
    with served("prefect server",
                lambda home: [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                              "--port", str(port)],
                lambda home: {**env, "PREFECT_HOME": str(home)}, f"{api}/health"):
        yield api
