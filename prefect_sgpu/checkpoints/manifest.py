"""What makes a checkpoint trusted: a manifest of its files, sealed with its location's key.

Whoever can write a checkpoint location (the job store's bucket, a shared folder) must not
choose what a restore loads, nor write anywhere else on the machine that restores. So a
checkpoint folder counts only when its ``COMPLETE`` marker carries a manifest (every file's
relative name, size and sha256) sealed with :func:`prefect_sgpu.protocol.jobfolder.seal` (kind
``checkpoint``, bound to the folder's name, so a step cannot be moved to another step's place)
under a key the store never holds. A restore checks the seal, then takes exactly the files
the manifest names, each checked against its size and hash, before anything is loaded.

**The key's scope is one checkpoint location.** A Prefect retry is a new job with a new job
key, but it reuses its task's checkpoint location (``gpu_task`` keys it by flow run, task and
inputs), so the job key cannot seal checkpoints. Instead the driver holds one *checkpoint
secret* per user (``SGPU_CHECKPOINT_SECRET``, else a file ``checkpoint-secret`` in the
prefect-sgpu home, created ``0600`` on first use) and derives each location's key from it:
``HMAC(secret, location URI)``. It hands ranks their own location's key (``SGPU_CHECKPOINT_KEY``)
the way it hands them ``secrets=``: in the node agent's environment locally, through the job's
SSM SecureString on EC2, never in the store. So

- every retry of a task derives the same key and verifies what earlier attempts wrote;
- a rank holds the key of its own location only: a compromised job can forge its own task's
  checkpoints, never another task's or another flow run's;
- the driver (``load_model``, the recovery report) derives any location's key itself;
- trade-off: the secret lives where the driver runs. A retry picked up by a worker on another
  machine derives other keys and finds no verified checkpoint (it starts fresh, with a log line)
  unless every worker has the same ``SGPU_CHECKPOINT_SECRET``; whoever reads the secret can forge
  checkpoints of every location of that user; a new secret makes every older checkpoint
  unverifiable (ignored, never loaded).

A rank that opens a location other than its own uses the user's secret when it can read it
(the local compute: the driver's own user and home), else a key derived from its own location's
key, which its task's retries share and nobody else holds.

Local checkpoint folders are checked the same way: a folder another user can write is the same
threat as a shared bucket. This module imports nothing heavy.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import re
import stat
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from prefect_sgpu.errors import CheckpointRefused, DocumentRefused, SGPUConfigError
from prefect_sgpu.protocol.jobfolder import new_key, seal, unseal

logger = logging.getLogger("prefect_sgpu.checkpoints")

#: this rank's own checkpoint location's key (hex), handed over like ``secrets=``
KEY_ENV = "SGPU_CHECKPOINT_KEY"
#: the driver's checkpoint secret (hex), for workers that must share it; never handed to a node
SECRET_ENV = "SGPU_CHECKPOINT_SECRET"
SECRET_FILE = "checkpoint-secret"
#: the key ranks derive an explicit folder's key from (hex), handed over like ``secrets=``: one per user
#: secret and job store, so every run of that store verifies what earlier runs wrote to the same folder
FOLDERS_KEY_ENV = "SGPU_CHECKPOINT_FOLDERS_KEY"
MARKER = "COMPLETE"
_LOCATION = b"prefect-sgpu checkpoint location v1\n"
_SUB_LOCATION = b"prefect-sgpu checkpoint sub-location v1\n"
_FOLDERS = b"prefect-sgpu checkpoint folders v1\n"
_FOLDER = b"prefect-sgpu checkpoint folder v1\n"
_HEX_KEY = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20
ALLOWED_NAME = "a plain relative name ('/'-separated parts; not absolute, no empty, '.' or '..' part, no NUL)"


# --- names that become paths -------------------------------------------------------------


def name_problem(name: Any) -> str | None:
    """Why ``name`` (from a manifest, a listing or a URI) must not become a path, or None."""
    if not isinstance(name, str):
        return f"not a string ({type(name).__name__})"
    if not name:
        return "empty"
    if "\x00" in name or "\\" in name:
        return "holds a NUL or a backslash"
    if name.startswith("/"):
        return "absolute"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "has an empty, '.' or '..' part"
    return None


def check_name(name: Any, where: str) -> str:
    """``name`` when it is a plain relative name, else CheckpointRefused naming it."""
    problem = name_problem(name)
    if problem is not None:
        raise CheckpointRefused(f"checkpoint {where}: the name {name!r} is {problem}; allowed: "
                                f"{ALLOWED_NAME}. Nothing was written for it")
    return name


def inside(root: Path, name: str, where: str) -> Path:
    """``root / name`` after checking the name and, once resolved, that it stays inside ``root``."""
    check_name(name, where)
    path = root / name
    if not path.resolve().is_relative_to(root.resolve()):
        raise CheckpointRefused(f"checkpoint {where}: {name!r} resolves outside {root} (a symlink): refused")
    return path


# --- the key -----------------------------------------------------------------------------


def canonical(uri: str) -> str:
    """A location as its key is derived from: ``s3://`` without a trailing slash, else an absolute path."""
    uri = str(uri)
    return uri.rstrip("/") if uri.startswith("s3://") else os.path.abspath(os.path.expanduser(uri))


def derive(secret: str, purpose: bytes, uri: str) -> str:
    """An HMAC of ``uri`` (canonical form) under ``secret`` for one ``purpose``: the same secret
    gives unrelated values for different purposes (other modules derive their own records this way)."""
    return hmac.new(bytes.fromhex(secret), purpose + canonical(uri).encode(), hashlib.sha256).hexdigest()


def secret_path() -> Path:
    from prefect_sgpu.store import default_home

    return default_home() / SECRET_FILE


def _bad_secret(where: str, value: str, why: str) -> SGPUConfigError:
    return SGPUConfigError(where, value, "64 hex digits, in a file owned by this user and readable by "
                           "this user alone (mode 0600)", f"{why}. Checkpoints are sealed with keys derived "
                           "from it")


def read_secret() -> str | None:
    """The checkpoint secret this process can read (``SGPU_CHECKPOINT_SECRET``, else the file), or None."""
    value = os.environ.get(SECRET_ENV, "").strip().lower()
    if value:
        if not _HEX_KEY.match(value):
            raise _bad_secret(SECRET_ENV, "<hidden>", "it is not 64 hex digits")
        return value
    path = secret_path()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _bad_secret("checkpoint secret", str(path), f"it cannot be opened without following a link "
                          f"({exc.strerror})") from None
    with os.fdopen(fd, "r") as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise _bad_secret("checkpoint secret", str(path), f"it is owned by uid {info.st_uid} with mode "
                              f"{stat.S_IMODE(info.st_mode):o}")
        value = fh.read().strip()
    if not _HEX_KEY.match(value):
        raise _bad_secret("checkpoint secret", str(path), "it is not 64 hex digits")
    return value


def driver_secret() -> str:
    """The checkpoint secret, created when there is none (``0600``; atomically, so first uses agree)."""
    found = read_secret()
    if found is not None:
        return found
    path = secret_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(new_key() + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)  # fails when another process made one first: theirs counts
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    found = read_secret()
    assert found is not None
    return found


def location_key(uri: str) -> str:
    """The key of location ``uri``, derived from the driver's secret (what the driver hands ranks)."""
    return derive(driver_secret(), _LOCATION, uri)


def folders_key(store_root: str) -> str:
    """The key a rank derives explicit folders' keys from, for the jobs of the store at ``store_root``
    (what the driver hands ranks beside their location's key)."""
    return derive(driver_secret(), _FOLDERS, store_root)


def key_for(uri: str, own_uri: str | None) -> str:
    """The key this process seals and checks ``uri``'s checkpoints with.

    ``own_uri`` is this rank's own location, whose key came in ``SGPU_CHECKPOINT_KEY``. Another
    location (an explicit ``Checkpointer(folder=...)``) is keyed from the user's secret where this
    process can read it, else from ``SGPU_CHECKPOINT_FOLDERS_KEY``: the same key for every run of the
    store, so a new run resumes from a folder an earlier run wrote."""
    own = os.environ.get(KEY_ENV, "").strip().lower()
    if own and not _HEX_KEY.match(own):
        raise _bad_secret(KEY_ENV, "<hidden>", "it is not 64 hex digits")
    if own and own_uri is not None and canonical(uri) == canonical(own_uri):
        return own
    secret = read_secret()
    if secret is not None:
        return derive(secret, _LOCATION, uri)
    folders = os.environ.get(FOLDERS_KEY_ENV, "").strip().lower()
    if folders:
        if not _HEX_KEY.match(folders):
            raise _bad_secret(FOLDERS_KEY_ENV, "<hidden>", "it is not 64 hex digits")
        return derive(folders, _FOLDER, uri)
    if own:  # a rank without the user's secret (a remote node): a key only its own task holds
        return derive(own, _SUB_LOCATION, uri)
    return location_key(uri)


# --- the manifest --------------------------------------------------------------------------


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Manifest(BaseModel):
    """A complete checkpoint folder: what its writer said (``info``) and every file it holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    info: dict[str, Any] = Field(default_factory=dict)
    files: dict[str, FileEntry]


def hash_file(path: Path) -> FileEntry:
    """Size and sha256 of a regular file, opened without following a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise CheckpointRefused(f"checkpoint file {path} cannot be opened without following a link "
                                f"({exc.strerror}): refused") from None
    digest = hashlib.sha256()
    size = 0
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise CheckpointRefused(f"checkpoint file {path} is not a regular file: refused")
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileEntry(size=size, sha256=digest.hexdigest())


def _ignored(rel: str) -> bool:
    """The marker itself, and a temporary file a writer left (no loader reads one)."""
    return rel == MARKER or rel.endswith(".tmp")


def folder_files(folder: Path) -> list[str]:
    """Every file below ``folder`` by relative name (marker and temporary files aside), no link followed."""
    found: list[str] = []

    def walk(path: Path, prefix: str) -> None:
        with os.scandir(path) as entries:
            for entry in entries:
                rel = prefix + entry.name
                if entry.is_symlink():
                    raise CheckpointRefused(f"checkpoint folder {folder} holds a symlink, {rel}: refused")
                if entry.is_dir(follow_symlinks=False):
                    walk(Path(entry.path), rel + "/")
                elif not _ignored(rel):
                    found.append(rel)

    walk(folder, "")
    return sorted(found)


def hash_folder(folder: Path) -> dict[str, FileEntry]:
    """The manifest entries of every file of a folder this process (or its node) wrote."""
    return {rel: hash_file(folder / rel) for rel in folder_files(folder)}


def seal_marker(key: str, name: str, info: dict[str, Any], files: dict[str, FileEntry]) -> bytes:
    """The ``COMPLETE`` marker of folder ``name``: readable JSON for people, of which only the sealed
    manifest inside (``sealed``) counts."""
    for rel in files:
        check_name(rel, f"{name}/{rel}")
    body = Manifest(name=name, info=info, files=files).model_dump_json().encode()
    sealed = seal(key, "checkpoint", name, body)
    readable = {**info, "files": len(files), "sealed": base64.b64encode(sealed).decode()}
    return json.dumps(readable, indent=1).encode()


def open_marker(blob: bytes, key: str, name: str, where: str) -> Manifest:
    """The manifest of a marker sealed with ``key`` for folder ``name``; CheckpointRefused otherwise."""
    try:
        sealed = base64.b64decode(json.loads(blob)["sealed"], validate=True)
    except (ValueError, KeyError, TypeError):
        raise CheckpointRefused(f"checkpoint {where}: its {MARKER} carries no sealed manifest (unsigned, "
                                "or written before checkpoints were sealed): refused") from None
    try:
        body = unseal(sealed, key, "checkpoint", name, what=f"checkpoint {where}")
    except DocumentRefused as exc:
        why = "it was sealed for another folder (moved)" if "bound to" in str(exc) else \
            "its seal does not match this location's key (forged, or sealed for another location or with " \
            "another checkpoint secret)"
        raise CheckpointRefused(f"checkpoint {where}: {why}: refused") from None
    try:
        manifest = Manifest.model_validate_json(body)
    except ValidationError as exc:
        raise CheckpointRefused(f"checkpoint {where}: its manifest is malformed ({exc.errors()[0]['msg']}): "
                                "refused") from None
    for rel in manifest.files:
        check_name(rel, f"{where}/{rel}")
    return manifest


def verify_folder(folder: Path, manifest: Manifest, where: str, *, hashes: bool = True) -> None:
    """Refuse ``folder`` unless it is a real folder holding exactly the manifest's files, each of its
    size and (with ``hashes``) sha256. No link is followed."""
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        raise CheckpointRefused(f"checkpoint {where}: the folder {folder} is missing") from None
    if not stat.S_ISDIR(info.st_mode):
        raise CheckpointRefused(f"checkpoint {where}: {folder} is not a folder (a symlink?): refused")
    present = set(folder_files(folder))
    expected = set(manifest.files)
    if present != expected:
        extra, missing = sorted(present - expected), sorted(expected - present)
        raise CheckpointRefused(f"checkpoint {where}: files differ from its sealed manifest "
                                f"(not in it: {extra[:5]}, missing: {missing[:5]}): refused")
    for rel in sorted(expected):
        want = manifest.files[rel]
        if hashes:
            got = hash_file(folder / rel)
        else:
            got = FileEntry(size=os.lstat(folder / rel).st_size, sha256=want.sha256)
        if got != want:
            raise mismatch(where, rel, got, want)


def mismatch(where: str, rel: str, got: FileEntry, want: FileEntry) -> CheckpointRefused:
    """The refusal of a file that is not what the sealed manifest says."""
    return CheckpointRefused(f"checkpoint {where}: {rel} differs from its sealed manifest ({got.size} "
                             f"bytes, sha256 {got.sha256[:16]}..., expected {want.size} bytes, "
                             f"{want.sha256[:16]}...): changed after it was written; refused")


_warned: set[tuple[str, str]] = set()


def warn_once(where: str, name: str, exc: Exception) -> None:
    """Log a refused checkpoint once per process (listings repeat every save)."""
    if (where, name) in _warned:
        return
    _warned.add((where, name))
    logger.warning("%s", exc)
