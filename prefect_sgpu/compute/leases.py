"""Machine-wide leases on whole GPUs, shared by every driver process on this machine.

One lock file per GPU id (``gpu-<id>.lock``) in one folder (``PREFECT_SGPU_LEASE_DIR``,
default ``<tmp>/prefect-sgpu-leases``). A GPU is leased while an exclusive ``flock`` on
its file is held. The kernel drops a flock when the last descriptor of its open file
description is closed, so:

- a lease outlives neither its holders nor its holders' crash (no stale lease to clean);
- a lease passed to child processes (``subprocess.Popen(pass_fds=lease.fds)``) lasts
  until the parent *and* those children have closed it: a node agent orphaned by a
  killed driver keeps its GPUs until it exits;
- two opens of one file are two descriptions, so two jobs of one process exclude each
  other exactly as two processes do.

Leases are taken all at once or not at all (:func:`try_lease`): nothing is held while a
job waits, so two jobs cannot deadlock each holding part of what the other needs.
The holder (pid, run id, time) is written into each lock file, for messages only.

The folder is shared by every user of the machine, so nothing in it is trusted as a path:
the folder itself must be a real directory (not a symlink), owned by this user or root and
sticky when others may write it; a lock file is opened without following a symlink and
used only when it is a regular file with one link, so a name planted by another user (a
symlink or hard link to one of this user's files, a FIFO) is refused, never written
through. Waiting for the folder's own lock (:func:`flock_within`) is bounded.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

LEASE_DIR_ENV = "PREFECT_SGPU_LEASE_DIR"

_ensured: set[Path] = set()


def lease_dir() -> Path:
    """The machine-wide lease folder, created world-writable and sticky (like /tmp) if missing.

    Raises OSError when it cannot be created."""
    path = Path(os.environ.get(LEASE_DIR_ENV) or Path(tempfile.gettempdir()) / "prefect-sgpu-leases")
    if path not in _ensured:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o1777)
        except FileExistsError:
            pass
        else:
            os.chmod(path, 0o1777)  # mkdir's mode is cut by the umask: every user must create files here
        check_folder(path)
        _ensured.add(path)
    return path


def check_folder(path: Path) -> None:
    """OSError unless ``path`` is a folder that only this user, root or the sticky bit guard.

    A symlink (another user may have put it where the folder is expected), a folder of another
    user (its owner can remove or replace any file in it) or one others may write without the
    sticky bit (anyone can) would let another user break every lease in it."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise OSError(f"the lease folder {path} is not a folder (a symlink or a file): refused")
    if info.st_uid not in (os.geteuid(), 0):
        raise OSError(f"the lease folder {path} belongs to another user (uid {info.st_uid}), who could remove "
                      "or replace its lease files: refused (an administrator can create it owned by root, "
                      "mode 1777, as /tmp is)")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise OSError(f"the lease folder {path} is writable by others without the sticky bit: refused")


def flock_within(fd: int, timeout_s: float) -> bool:
    """An exclusive flock on ``fd`` within ``timeout_s`` seconds; False when another process held it
    longer (another user can hold a shared folder's lock for ever: the caller goes on without it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def open_shared(path: Path) -> int:
    """A descriptor of ``path``, created mode 0o666 if missing so every user can lock it.

    Opens read-write, or read-only where another user's file does not allow writing
    (flock needs neither). Never ``O_CREAT`` on an existing file: in a sticky folder
    Linux (``fs.protected_regular``) refuses that for files of other users."""
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # a FIFO must not block the open
    while True:
        try:
            return _regular(os.open(path, os.O_RDWR | flags), path)
        except FileNotFoundError:
            pass
        except PermissionError:
            return _regular(os.open(path, os.O_RDONLY | flags), path)
        except OSError as exc:
            if os.path.islink(path):  # O_NOFOLLOW: ELOOP
                raise OSError(f"{path} is a symlink (planted by another user?): refused") from exc
            raise
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flags, 0o666)
        except FileExistsError:
            continue  # another process created it just now: open theirs
        try:
            os.fchmod(fd, 0o666)
        except OSError:
            pass
        return fd


def _regular(fd: int, path: Path) -> int:
    """``fd`` when it is a regular file with one link; closed and OSError otherwise (a hard link
    to another file, a FIFO or a device planted under a lease file's name is never written)."""
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
        return fd
    os.close(fd)
    raise OSError(f"{path} is not a plain lease file (a link, FIFO or device, planted by another user?): "
                  "refused")


def lock_path(folder: Path, gpu: str) -> Path:
    """The lock file of GPU ``gpu`` (an index or a UUID as CUDA_VISIBLE_DEVICES lists it)."""
    return folder / f"gpu-{re.sub(r'[^A-Za-z0-9._-]', '_', gpu)}.lock"


@dataclass
class GpuLease:
    """Exclusive leases on ``gpus``, held while any process holds one of ``fds`` open."""

    gpus: list[str]
    #: one descriptor per GPU, in the order of ``gpus``; empty once closed
    fds: list[int] = field(default_factory=list)

    def close(self) -> None:
        """Close this process's descriptors (idempotent). Children given them keep the lease."""
        fds, self.fds = self.fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def try_lease(candidates: Sequence[str], count: int, run_id: str) -> tuple[GpuLease | None, list[str]]:
    """Lease ``count`` of ``candidates`` (tried in their order), or none at all.

    Returns the lease, or None when fewer than ``count`` are free now (nothing is held
    then), and the candidates found leased by others."""
    folder = lease_dir()
    taken: list[tuple[str, int]] = []
    busy: list[str] = []
    try:
        for gpu in candidates:
            if len(taken) == count:
                break
            fd = open_shared(lock_path(folder, gpu))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                busy.append(gpu)
                continue
            except BaseException:
                os.close(fd)
                raise
            taken.append((gpu, fd))
        if len(taken) < count:
            for _, fd in taken:
                os.close(fd)
            return None, busy
    except BaseException:
        for _, fd in taken:
            os.close(fd)
        raise
    holder = json.dumps({"pid": os.getpid(), "run_id": run_id,
                         "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()
    for _, fd in taken:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder, 0)
        except OSError:
            pass  # a read-only lock file of another user: the lease holds, the note is stale
    return GpuLease(gpus=[g for g, _ in taken], fds=[fd for _, fd in taken]), busy


def holder(gpu: str) -> str:
    """Who last leased ``gpu``, as its lock file says (``"pid 123 (run abc) since ..."``)."""
    try:
        info = json.loads(lock_path(lease_dir(), gpu).read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "holder unknown"
    return f"pid {info.get('pid')} (run {info.get('run_id')}) since {info.get('since')}"
