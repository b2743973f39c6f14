"""Byte storage for job folders: a local folder, or S3 (:mod:`prefect_sgpu.store_s3`).

The store is the one mailbox between the driver and the nodes: nothing needs an
inbound port on the driver, so a driver behind NAT can run nodes anywhere that can
reach the store. What goes where in a job's folder, and how each document is sealed,
is :mod:`prefect_sgpu.jobfolder`'s alone; a store only moves bytes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from pathlib import Path


def default_home() -> Path:
    """Where local job folders and the default MLflow store live."""
    return Path(os.environ.get("PREFECT_SGPU_HOME", Path.home() / ".prefect-sgpu")).expanduser()


def store_scope(store_uri: str) -> str:
    """A store's own part of SSM and IAM paths: 16 hex digits of the sha256 of its URI (no trailing
    ``/``). The policies rendered for one store name only paths under its scope, so a driver or a
    job role of store X is refused store Y's keys, secrets and roles (docs/security.md)."""
    return hashlib.sha256(store_uri.rstrip("/").encode()).hexdigest()[:16]


class Store(ABC):
    """Byte storage keyed by relative path, one namespace per job (``run_id``)."""

    @abstractmethod
    def uri(self, run_id: str, key: str = "") -> str: ...

    @abstractmethod
    def put(self, run_id: str, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get(self, run_id: str, key: str) -> bytes | None: ...

    @abstractmethod
    def read_from(self, run_id: str, key: str, offset: int) -> bytes: ...

    def list(self, run_id: str, prefix: str) -> list[str]:
        return sorted(self.versions(run_id, prefix))

    @abstractmethod
    def versions(self, run_id: str, prefix: str) -> dict[str, str]:
        """The objects directly under ``prefix`` (as ``list`` names them), each with a token that
        changes whenever the object is written again (S3's ETag; a file's inode, size and mtime).

        One listing tells a poller which of many objects changed without reading any of them.
        """

    @abstractmethod
    def delete(self, run_id: str, key: str) -> None: ...

    def append(self, run_id: str, key: str, offset: int, data: bytes) -> None:
        """Bytes ``offset .. offset+len(data)`` of an object that grows (a rank log, a metrics file).

        Readers see the object through ``get``/``read_from``/``list`` as if it were written whole.
        This default rewrites the object; a store where that costs the object's size on every call
        (S3) keeps the appended pieces as separate objects instead.
        """
        whole = self.get(run_id, key) or b""
        self.put(run_id, key, whole[:offset].ljust(offset, b"\0") + data)

    def seal_appended(self, run_id: str, key: str, data: bytes) -> None:
        """The object is complete: ``data`` is all of it (written once; appended pieces go)."""
        self.put(run_id, key, data)

    @property
    @abstractmethod
    def root_uri(self) -> str:
        """The store itself (what ``sgpu:store`` tags and the ``sgpu.store`` MLflow tag name)."""

    @property
    def scope(self) -> str:
        """The store's part of SSM and IAM paths (:func:`store_scope`)."""
        return store_scope(self.root_uri)

    @abstractmethod
    def runs(self) -> list[str]:
        """The names of every job folder in the store."""

    @abstractmethod
    def top(self, run_id: str) -> tuple[dict[str, float], set[str]]:
        """One job folder's top level: its files with their modification times (seconds since
        the epoch, as the store's own clock has them) and its sub-folder names."""

    @abstractmethod
    def clock(self) -> float:
        """Now, in seconds since the epoch, on the clock that stamps :meth:`top`'s modification times.

        Ages of what is in the store (a driver's heartbeat, for the sweeper) are judged on this
        clock alone: a reader whose own clock runs ahead or behind the store's must not take a
        fresh heartbeat for an old one."""

    def local_dir(self, run_id: str) -> Path | None:
        """A folder nodes on this machine may write into directly, if any."""
        return None

    def local_dir_root(self) -> Path | None:
        """The folder that holds every job's folder, when the store is on this machine."""
        return None


class LocalStore(Store):
    """A folder on this machine: the store of the local compute."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root).expanduser() if root else default_home() / "jobs"

    def _path(self, run_id: str, key: str) -> Path:
        return self.root / run_id / key

    def uri(self, run_id: str, key: str = "") -> str:
        return str(self._path(run_id, key))

    def local_dir_root(self) -> Path:
        return self.root

    @property
    def root_uri(self) -> str:
        return str(self.root)

    def runs(self) -> list[str]:
        try:
            return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        except FileNotFoundError:
            return []

    def clock(self) -> float:
        """This machine's clock: the one that stamps the folder's modification times (unless the folder
        is on a network file system whose server stamps them)."""
        return time.time()

    def top(self, run_id: str) -> tuple[dict[str, float], set[str]]:
        files: dict[str, float] = {}
        folders: set[str] = set()
        try:
            entries = list(os.scandir(self.root / run_id))
        except (FileNotFoundError, NotADirectoryError):
            return files, folders
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                if entry.is_dir():
                    folders.add(entry.name)
                else:
                    files[entry.name] = entry.stat().st_mtime
            except FileNotFoundError:  # deleted while listed
                continue
        return files, folders

    def local_dir(self, run_id: str) -> Path:
        """The job's folder, created readable by its owner only (payload, logs, results are the user's)."""
        path = self.root / run_id
        if not path.is_dir():
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.mkdir(mode=0o700, exist_ok=True)
        return path

    def put(self, run_id: str, key: str, data: bytes) -> None:
        path = self._path(run_id, key)
        self.local_dir(run_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data)

    def get(self, run_id: str, key: str) -> bytes | None:
        try:
            return self._path(run_id, key).read_bytes()
        except FileNotFoundError:
            return None

    def read_from(self, run_id: str, key: str, offset: int) -> bytes:
        try:
            with open(self._path(run_id, key), "rb") as fh:
                fh.seek(offset)
                return fh.read()
        except FileNotFoundError:
            return b""

    def versions(self, run_id: str, prefix: str) -> dict[str, str]:
        base = self._path(run_id, prefix)
        found: dict[str, str] = {}
        try:
            entries = list(os.scandir(base))
        except (FileNotFoundError, NotADirectoryError):
            return found
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                if not entry.is_file():
                    continue
                st = entry.stat()
            except FileNotFoundError:  # replaced or deleted while listed
                continue
            found[f"{prefix.rstrip('/')}/{entry.name}"] = f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"
        return found

    def delete(self, run_id: str, key: str) -> None:
        path = self._path(run_id, key)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def atomic_write(path: Path, data: bytes) -> None:
    """Write to a temporary sibling, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
