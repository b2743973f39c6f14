"""Where a job's checkpoints live: a folder, or a prefix of an object store, behind one small API.

The driver hands every rank ``SGPU_CHECKPOINT_URI``: the job store's ``checkpoints``
folder by default (``<store>/<run id>/checkpoints``), or a folder a GPU task keys by
flow run, task and inputs so a Prefect retry finds it. A local URI is used in place
(every simulated node of the local compute sees the same folder). An object store's
URI (``s3://``: the store its scheme names, :func:`prefect_sgpu.store.store_class`) is
staged: ranks write into a node-local folder and :class:`Location` uploads each node's
files (in parts for large shards), downloads a step to a node that lacks it, and lists
and deletes steps there. The ranks reach the store with the node's own credentials;
the store's region and endpoint travel in ``SGPU_STORE_REGION`` / ``SGPU_STORE_ENDPOINT_URL``.

A folder counts once its ``COMPLETE`` marker is written (last), and only when that marker
carries a manifest sealed with the location's key (:mod:`prefect_sgpu.checkpoints.manifest`).
Nothing from the location becomes a local path unchecked: :meth:`Location.fetch` downloads
exactly the files the sealed manifest names (plain relative names, checked again after
resolving), each into a fresh folder of a private stage, checks every file's size and sha256,
and only then moves the folder into place. The stage is this user's own (``0700``, owner
checked, never a symlink): the job folder's ``checkpoint-stage`` on a node, else
``checkpoint-stage`` in the prefect-sgpu home.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

from prefect_sgpu.checkpoints.manifest import (MARKER, FileEntry, Manifest, check_name, hash_file,
                                              hash_folder, inside, key_for, mismatch, open_marker, seal_marker,
                                              verify_folder, warn_once)
from prefect_sgpu.errors import CheckpointRefused
from prefect_sgpu.store import Objects, is_object_uri, store_class

__all__ = ["DIR_ENV", "ENDPOINT_ENV", "MARKER", "REGION_ENV", "URI_ENV", "Location", "is_remote",
           "location_uri", "private_dir", "step_dir_name"]

URI_ENV = "SGPU_CHECKPOINT_URI"
#: the older name of the same setting, a local folder
DIR_ENV = "SGPU_CHECKPOINT_DIR"
REGION_ENV = "SGPU_STORE_REGION"
ENDPOINT_ENV = "SGPU_STORE_ENDPOINT_URL"
STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def location_uri() -> str:
    """This rank's checkpoint location: the launcher's, else ``<job dir>/checkpoints``, else ``./checkpoints``."""
    uri = os.environ.get(URI_ENV) or os.environ.get(DIR_ENV)
    if uri:
        return uri
    return str(Path(os.environ.get("SGPU_JOB_DIR", ".")) / "checkpoints")


def is_remote(uri: str) -> bool:
    """Whether ``uri`` is an object store's (staged on each node), not a folder."""
    return is_object_uri(uri)


def _stage_root() -> Path:
    """Where this user's node stages remote checkpoints: the job's own folder, else the prefect-sgpu home
    (never a fixed name in a shared temporary folder another user could create first)."""
    from prefect_sgpu.store import default_home

    job_dir = os.environ.get("SGPU_JOB_DIR")
    return (Path(job_dir) if job_dir else default_home()) / "checkpoint-stage"


def private_dir(path: Path) -> Path:
    """``path`` as a folder of this user's alone (``0700``): created if missing; refused when it is a
    symlink, not a folder, or another user's (someone made it first to redirect or read our writes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise CheckpointRefused(f"checkpoint stage {path} is not a folder of its own (a symlink or a file: "
                                f"{exc.strerror}); refusing to stage checkpoints there") from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise CheckpointRefused(f"checkpoint stage {path} belongs to uid {info.st_uid}, not to this user "
                                    f"(uid {os.geteuid()}); refusing to stage checkpoints there")
        if stat.S_IMODE(info.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def _remove(path: Path) -> None:
    """Whatever is at ``path`` (a folder, a file, a symlink: never what a symlink points to)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(path)
    else:
        path.unlink()


class Location:
    """One checkpoint location: ``local`` is the folder ranks read and write on this node."""

    def __init__(self, uri: str | os.PathLike[str] | None = None, stage: Path | None = None) -> None:
        self.uri = str(uri) if uri is not None else location_uri()
        self.remote = is_remote(self.uri)
        self._own_stage = stage is None
        if self.remote:
            digest = hashlib.sha256(self.uri.encode()).hexdigest()[:16]
            self.local = Path(stage) if stage is not None else _stage_root() / digest
        else:
            self.local = Path(self.uri).expanduser()
        self._objects: Objects | None = None
        self._key: str | None = None

    def __repr__(self) -> str:
        return f"Location({self.uri!r})"

    @property
    def key(self) -> str:
        """The key this location's manifests are sealed with (:func:`checkpoint_manifest.key_for`)."""
        if self._key is None:
            own = os.environ.get(URI_ENV) or os.environ.get(DIR_ENV)
            self._key = key_for(self.uri, own)
        return self._key

    def ensure_local(self) -> Path:
        """``local``, created: for a remote location a private stage (this user's, ``0700``, no symlink)."""
        if not self.remote:
            self.local.mkdir(parents=True, exist_ok=True)
        else:
            if self._own_stage:
                private_dir(self.local.parent)
            private_dir(self.local)
        return self.local

    def _where(self, name: str) -> str:
        return f"{self.uri.rstrip('/')}/{name}"

    # -- object store --------------------------------------------------------------

    @property
    def objects(self) -> Objects:
        """The remote location's objects (keys relative to it), through the store its scheme names,
        as the driver configured it for this node."""
        if self._objects is None:
            store = store_class(self.uri).from_env(self.uri, region=os.environ.get(REGION_ENV) or None,
                                                   endpoint_url=os.environ.get(ENDPOINT_ENV) or None)
            self._objects = store.objects()
        return self._objects

    def _keys(self, under: str = "") -> list[str]:
        """Every object key below the location (or ``under`` it), relative to the location. Names only:
        nothing turns a listed key into a path (a restore takes its files from the sealed manifest)."""
        return self.objects.keys(under)

    # -- what is there -------------------------------------------------------------

    def marker_steps(self) -> list[int]:
        """Steps with a ``COMPLETE`` marker, sealed or not (verified or not)."""
        return self._marker_steps()

    def _marker_steps(self) -> list[int]:
        """Steps with a ``COMPLETE`` marker, sealed or not."""
        steps: set[int] = set()
        if self.remote:
            for key in self._keys():
                head, _, name = key.partition("/")
                match = STEP_DIR.match(head)
                if match and name == MARKER:
                    steps.add(int(match.group(1)))
        elif self.local.is_dir():
            for child in self.local.iterdir():
                match = STEP_DIR.match(child.name)
                if match and (child / MARKER).is_file():
                    steps.add(int(match.group(1)))
        return sorted(steps)

    def complete_steps(self) -> list[int]:
        """Steps whose ``COMPLETE`` marker carries a manifest sealed with this location's key, oldest first.

        A marker that is unsigned, forged or moved is logged (once) and the step does not count; the
        files themselves are checked when the step is fetched."""
        steps = []
        for step in self._marker_steps():
            try:
                if self.manifest(step_dir_name(step)) is not None:
                    steps.append(step)
            except CheckpointRefused as exc:
                warn_once(self.uri, step_dir_name(step), exc)
        return steps

    def step_dirs(self) -> list[int]:
        """Every step folder at the location, complete or not."""
        if self.remote:
            return sorted({int(m.group(1)) for k in self._keys() if (m := STEP_DIR.match(k.partition("/")[0]))})
        if not self.local.is_dir():
            return []
        return sorted(int(m.group(1)) for c in self.local.iterdir() if (m := STEP_DIR.match(c.name)))

    def marker(self, step: int) -> bytes | None:
        """The ``COMPLETE`` marker of ``step`` as written, unchecked, or None (see :meth:`manifest`)."""
        return self._marker_bytes(step_dir_name(step))

    def _marker_bytes(self, name: str) -> bytes | None:
        check_name(name, self._where(name))
        if self.remote:
            return self.objects.get(f"{name}/{MARKER}")
        try:
            return (self.local / name / MARKER).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def manifest(self, name: str) -> Manifest | None:
        """The sealed manifest of folder ``name`` (None when it has no marker); CheckpointRefused when the
        marker is not sealed with this location's key for this folder."""
        blob = self._marker_bytes(name)
        return None if blob is None else open_marker(blob, self.key, name, self._where(name))

    # -- moving folders ------------------------------------------------------------

    def upload(self, name: str) -> dict[str, FileEntry]:
        """Every file of this node's ``local/name`` (marker and temporary files aside) to the location;
        returns each file's manifest entry (size, sha256) as it was sent."""
        check_name(name, self._where(name))
        source = self.local / name
        files = hash_folder(source)
        if not self.remote:
            return files
        for rel in files:
            self.objects.upload(f"{name}/{rel}", source / rel)
        return files

    def put_marker(self, name: str, info: dict[str, Any], files: dict[str, FileEntry] | None = None) -> None:
        """The folder's sealed marker, written last: ``info`` and a manifest of ``files`` (default: every
        file in ``local/name``, for a folder every writer shares or one node wrote whole).

        Remotely it goes to the location only: this node's stage may hold its own part alone."""
        from prefect_sgpu.store import atomic_write

        check_name(name, self._where(name))
        if files is None:
            files = hash_folder(self.local / name)
        blob = seal_marker(self.key, name, info, files)
        if self.remote:
            self.objects.put(f"{name}/{MARKER}", blob)
        else:
            atomic_write(self.local / name / MARKER, blob)

    def fetch(self, name: str) -> Path:
        """``name`` as a complete local folder whose files are exactly those of its sealed manifest.

        A local location is checked in place (no symlink, no file more or less, every size and
        sha256). A remote one is downloaded, file by file as the manifest names them, into a fresh
        folder of the private stage, checked, and moved into place; a staged copy that holds the
        manifest's files already is used as it is. CheckpointRefused, naming the step and the file,
        when anything does not match: nothing of it is then left in the stage."""
        where = self._where(name)
        check_name(name, where)
        if "/" in name:
            raise CheckpointRefused(f"checkpoint {where}: a checkpoint folder is one name, not a path")
        manifest = self.manifest(name)
        if manifest is None:
            raise CheckpointRefused(f"checkpoint {where} has no {MARKER} marker: not a complete checkpoint")
        target = self.local / name
        if not self.remote:
            verify_folder(target, manifest, where)
            return target
        self.ensure_local()
        if self._staged(target, manifest, where):
            return target
        fresh = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=self.local))
        try:
            for rel, entry in sorted(manifest.files.items()):
                dest = inside(fresh, rel, where)
                dest.parent.mkdir(parents=True, exist_ok=True)
                self.objects.download(f"{name}/{rel}", dest)
                got = hash_file(dest)
                if got != entry:
                    raise mismatch(where, rel, got, entry)
            blob = self._marker_bytes(name)
            if blob is None or open_marker(blob, self.key, name, where) != manifest:
                raise CheckpointRefused(f"checkpoint {where}: its marker changed during the fetch: refused")
            (fresh / MARKER).write_bytes(blob)  # last: the staged copy is complete
            _remove(target)
            os.rename(fresh, target)
        except BaseException:
            shutil.rmtree(fresh, ignore_errors=True)
            raise
        return target

    def _staged(self, target: Path, manifest: Manifest, where: str) -> bool:
        """True when this node's private stage holds ``manifest``'s folder whole already (a copy this
        node fetched and checked; sizes are compared, hashes were checked on the way in)."""
        try:
            blob = (target / MARKER).read_bytes()
            if open_marker(blob, self.key, manifest.name, where) != manifest:
                return False
            verify_folder(target, manifest, where, hashes=False)
        except (OSError, CheckpointRefused):
            return False
        return True

    def delete(self, name: str) -> None:
        """A step folder, at the location and in this node's stage."""
        check_name(name, self._where(name))
        if self.remote:
            self.objects.delete(self._keys(name))
        shutil.rmtree(self.local / name, ignore_errors=True)

    def prune_stage(self, keep: str) -> None:
        """Drop every staged step folder but ``keep`` (the location holds the others)."""
        if not self.remote or not self.local.is_dir():
            return
        for child in self.local.iterdir():
            if STEP_DIR.match(child.name) and child.name != keep:
                shutil.rmtree(child, ignore_errors=True)
