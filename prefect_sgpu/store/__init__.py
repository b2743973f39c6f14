"""Byte storage for job folders: a local folder, or an object store chosen by the URL's scheme.

The store is the one mailbox between the driver and the nodes: nothing needs an
inbound port on the driver, so a driver behind NAT can run nodes anywhere that can
reach the store. What goes where in a job's folder, and how each document is sealed,
is :mod:`prefect_sgpu.protocol.jobfolder`'s alone; a store only moves bytes.

Which class serves a scheme is data (:data:`SCHEMES`), so code that opens storage by URL
(checkpoints, shard sets, a node's bootstrap) imports no cloud's module.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any

from prefect_sgpu.errors import SGPUConfigError

#: The :class:`Store` class of each URL scheme, as ``"module:attribute"`` (data, like an entry point: code
#: that opens storage by URL imports no cloud's module). A second cloud adds its line here, or its
#: module calls :func:`register_scheme`; a URL without a scheme is a local folder.
SCHEMES: dict[str, str] = {"s3": "prefect_sgpu.store.s3:S3Store"}


def default_home() -> Path:
    """Where local job folders and the default MLflow store live."""
    return Path(os.environ.get("PREFECT_SGPU_HOME", Path.home() / ".prefect-sgpu")).expanduser()


def store_scope(store_uri: str) -> str:
    """A store's own part of SSM and IAM paths: 16 hex digits of the sha256 of its URI (no trailing
    ``/``). The policies rendered for one store name only paths under its scope, so a driver or a
    job role of store X is refused store Y's keys, secrets and roles (docs/security.md)."""
    return hashlib.sha256(store_uri.rstrip("/").encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Listed:
    """One object as a listing shows it: its size (an object still appended to: the end of its last
    piece), a token that changes whenever it is written, and, for such an object, its pieces as
    ``(offset, size, store key)`` so a reader fetches only those it lacks without listing again."""

    key: str
    size: int
    token: str
    pieces: tuple[tuple[int, int, str], ...] = ()


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

    def request_counts(self) -> dict[str, int]:
        """The requests this store sent so far, by kind (an object store's are billed: a node reports its
        own with the job, :mod:`prefect_sgpu.protocol.node_requests`); a folder's cost nothing: none."""
        return {}

    def listing(self, run_id: str, prefix: str) -> dict[str, Listed]:
        """The objects directly under ``prefix`` with their sizes (:class:`Listed`), in as few
        requests as the store allows (S3: one listing for every object and every appended piece).
        This default reads each object; stores override it."""
        found: dict[str, Listed] = {}
        for key, token in self.versions(run_id, prefix).items():
            found[key] = Listed(key, len(self.get(run_id, key) or b""), token)
        return found

    def read_range(self, run_id: str, listed: Listed, offset: int, limit: int) -> bytes:
        """At most ``limit`` bytes of a listed object from ``offset`` (a bounded read: a reader's memory
        never holds more than ``limit`` of an object however large it grew). This default reads
        from ``offset`` to the end; stores override it with a ranged read."""
        return self.read_from(run_id, listed.key, offset)[:max(limit, 0)]

    def get_at_most(self, run_id: str, key: str, limit: int) -> tuple[bytes | None, bool]:
        """``(bytes, whole)``: the object's first ``limit`` bytes at most (None when it is not there), and
        whether that is all of it. No more than ``limit + 1`` bytes are read (a ranged read), so a
        reader can refuse an object too large for its kind before holding it."""
        data = self.get(run_id, key)  # this default reads it whole; stores override it
        if data is None:
            return None, True
        return data[:limit], len(data) <= limit

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

    @classmethod
    def from_env(cls, uri: str, **options: Any) -> "Store":
        """The store at ``uri`` as the driver configured it for this node or rank (what the environment
        carries beside ``options``); a store with no such settings is opened as given."""
        return cls(uri, **options)  # type: ignore[call-arg]

    def objects(self, *, store_settings: bool = True) -> "Objects":
        """The objects under the store's root, by key relative to it (checkpoints, shard sets).
        ``store_settings=False`` leaves out what this store adds to its own writes (encryption, an
        expected owner): for objects other tools share. Raises SGPUConfigError for a folder store."""
        raise SGPUConfigError("uri", self.root_uri, "an object store's URI (" + ", ".join(SCHEMES) + ")")


class Objects(ABC):
    """The objects under one object-store URI, by key relative to it: what checkpoints and shard sets
    need beside a job folder's bytes (a listing at any depth, files sent from and fetched to disk,
    deletes in a caller's order)."""

    @property
    @abstractmethod
    def uri(self) -> str:
        """The URI the keys are relative to, without a trailing ``/``."""

    @abstractmethod
    def keys(self, under: str = "") -> list[str]:
        """Every key below the URI (or below its folder ``under``), however deep."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether the store answers that ``key`` is there (False: it is not, or not this caller's to see)."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The object's bytes; None when it is not there."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def upload(self, key: str, path: Path) -> None:
        """A file from disk, without reading it into memory whole (large files go in parts)."""

    @abstractmethod
    def download(self, key: str, path: Path) -> None:
        """The object into the file ``path``."""

    @abstractmethod
    def delete(self, keys: list[str]) -> None:
        """These objects, in batches in the order given: a caller that needs one gone before the rest
        starts deletes it in a call of its own."""


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
        return {key: listed.token for key, listed in self.listing(run_id, prefix).items()}

    def listing(self, run_id: str, prefix: str) -> dict[str, Listed]:
        base = self._path(run_id, prefix)
        found: dict[str, Listed] = {}
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
            key = f"{prefix.rstrip('/')}/{entry.name}"
            found[key] = Listed(key, st.st_size, f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}")
        return found

    def get_at_most(self, run_id: str, key: str, limit: int) -> tuple[bytes | None, bool]:
        try:
            with open(self._path(run_id, key), "rb") as fh:
                data = fh.read(max(limit, 0) + 1)
        except (FileNotFoundError, IsADirectoryError):
            return None, True
        return data[:limit], len(data) <= limit

    def read_range(self, run_id: str, listed: Listed, offset: int, limit: int) -> bytes:
        try:
            with open(self._path(run_id, listed.key), "rb") as fh:
                fh.seek(max(offset, 0))
                return fh.read(max(limit, 0))
        except FileNotFoundError:
            return b""

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


#: every request any object store of this process sent, by kind: what a rank reports for the job it ran
#: (its checkpoints' and shard sets' stores are its own, opened and dropped as it goes), read by
#: :func:`process_request_counts`
_PROCESS_REQUESTS: dict[str, int] = {}
_PROCESS_REQUESTS_LOCK = threading.Lock()


def count_process_request(kind: str) -> None:
    """One request an object store of this process sent (stores call it for each, as they count their own)."""
    with _PROCESS_REQUESTS_LOCK:
        _PROCESS_REQUESTS[kind] = _PROCESS_REQUESTS.get(kind, 0) + 1


def process_request_counts() -> dict[str, int]:
    """The requests every object store of this process sent so far, by kind, stores since dropped included."""
    with _PROCESS_REQUESTS_LOCK:
        return dict(_PROCESS_REQUESTS)


def register_scheme(scheme: str, target: str) -> None:
    """Serve URLs ``scheme://...`` with the Store class at ``target`` (``"module:attribute"``)."""
    SCHEMES[scheme] = target


def is_object_uri(uri: str) -> bool:
    """Whether ``uri`` names an object store (its scheme is in :data:`SCHEMES`), not a folder."""
    scheme, sep, _ = str(uri).partition("://")
    return bool(sep) and scheme in SCHEMES


def store_class(uri: str) -> type[Store]:
    """The Store class that serves ``uri``: its scheme's, or :class:`LocalStore` for a path."""
    scheme, sep, _ = str(uri).partition("://")
    if not sep:
        return LocalStore
    if scheme not in SCHEMES:
        raise SGPUConfigError("uri", uri, "a local path or a URI of " + ", ".join(f"{s}://" for s in SCHEMES))
    module, _, attribute = SCHEMES[scheme].partition(":")
    found: Any = import_module(module)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found


def open_store(uri: str, **options: Any) -> Store:
    """The store at ``uri``, opened by the class its scheme names: a folder for a path or ``file://``.
    ``options`` are that class's (for S3: ``region``, ``endpoint_url``, ``kms_key_id``, ``bucket_owner``);
    None values are left out, so a caller passes what its command line said without sorting it."""
    scheme, sep, rest = str(uri).partition("://")
    if sep and scheme == "file":
        return LocalStore(rest)
    cls = store_class(uri)
    if cls is LocalStore:
        return LocalStore(uri)
    return cls(uri, **{k: v for k, v in options.items() if v is not None})  # type: ignore[call-arg]
