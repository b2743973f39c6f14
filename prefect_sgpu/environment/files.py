"""The files that travel with a job: a folder, its ignore rules, its size limit, its manifest.

A job's project (``working_dir``), its named ``py_modules`` and the driver's local and
editable packages reach the nodes as files, never as names on an index. What the driver
describes is a *manifest*: every file's path relative to its folder, size and sha256,
sorted. Two machines with the same files get the same manifest digest, wherever the
folder lies; one changed byte gives a new one. The node half will check every file it
receives against this manifest.

Ignore rules are gitignore patterns (pathspec's ``gitwildmatch``, the dialect of the
folder's own ``.gitignore``): the defaults below, then the folder's ``.gitignore``, then the
caller's ``excludes`` (so ``!pattern`` there can take back a default).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Iterable, Iterator

from pydantic import BaseModel, ConfigDict

from prefect_sgpu.errors import SGPUConfigError

#: never travels: version control, caches, virtual environments, build output, bytecode
DEFAULT_EXCLUDES = (
    ".git/", ".hg/", ".svn/", "__pycache__/", "*.pyc", "*.pyo", ".venv/", "venv/", ".tox/", ".nox/",
    ".mypy_cache/", ".pytest_cache/", ".ruff_cache/", ".ipynb_checkpoints/", "*.egg-info/", "build/",
    "dist/", "node_modules/", ".DS_Store", "mlruns/",
)
#: never travels either: files that hold credentials by their name (dotenv files, TLS and SSH private
#: keys, netrc, the AWS and SSH configuration folders, package-index and database password files). A
#: ``!pattern`` in ``excludes`` takes one back (its content is still scanned, :func:`credential_in`)
CREDENTIAL_EXCLUDES = (
    ".env", ".env.*", ".envrc", "*.pem", "*.key", "*.p12", "*.pfx", ".netrc", "_netrc", ".aws/", ".ssh/",
    "id_rsa", "id_rsa.*", "id_dsa", "id_dsa.*", "id_ecdsa", "id_ecdsa.*", "id_ecdsa_sk", "id_ecdsa_sk.*",
    "id_ed25519", "id_ed25519.*", "id_ed25519_sk", "id_ed25519_sk.*", ".pgpass", ".pypirc", ".git-credentials",
)
DEFAULT_EXCLUDES += CREDENTIAL_EXCLUDES
#: what a credential looks like inside a text file: an AWS access key id (long-term ``AKIA``, temporary
#: ``ASIA``; AWS's documented example ``AKIAIOSFODNN7EXAMPLE`` aside) or a PEM private key block
_CREDENTIAL = re.compile(rb"(?<![0-9A-Z])(?P<aws>(?:AKIA|ASIA)[0-9A-Z]{16})(?![0-9A-Z])"
                         rb"|(?P<pem>-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----)")
_CREDENTIAL_KINDS = {"aws": "an AWS access key id", "pem": "a PEM private key"}
#: bytes of a file looked at for a NUL to tell a binary file (never scanned) from a text one
_TEXT_PROBE = 8192
#: bytes a travelling folder may hold after its ignore rules (Ray's working_dir limit is of this order)
DEFAULT_MAX_BYTES = 100 * 1024 * 1024
_CHUNK = 1 << 20

logger = logging.getLogger("prefect_sgpu.environment")
_WARNED: set[tuple[str, str]] = set()


class FileEntry(BaseModel):
    """One file: its path relative to the folder (``/``-separated), size and sha256."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    size: int
    sha256: str


class Tree(BaseModel):
    """A folder (or one module file) that travels: where it is here, and its manifest.

    ``name`` is where it goes on the node (a ``py_modules`` entry's module name, a local
    package's distribution name, ``working_dir``); ``source`` is only where the driver
    read it and is not part of the digest, so another checkout of the same files hashes
    the same.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    source: str
    files: tuple[FileEntry, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def digest(self) -> str:
        """sha256 over the manifest: path, size and sha256 of every file, in path order."""
        return manifest_digest(self.files)


def manifest_digest(files: Iterable[FileEntry]) -> str:
    lines = [json.dumps([f.path, f.size, f.sha256], separators=(",", ":")) for f in sorted(files, key=_key)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _key(entry: FileEntry) -> str:
    return entry.path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def credential_in(path: Path) -> str | None:
    """What credential a text file holds (``"an AWS access key id"``, ``"a PEM private key"``), or None;
    a binary file (a NUL in its first bytes) is not scanned."""
    return _read(path)[1]


def _read(path: Path) -> tuple[str, str | None]:
    """The file's sha256 and, for a text file, the credential it holds (one pass over the bytes)."""
    digest = hashlib.sha256()
    tail, found, text = b"", None, True
    with open(path, "rb") as fh:
        first = True
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            if first and b"\0" in chunk[:_TEXT_PROBE]:
                text = False
            first = False
            if text and found is None:
                window = tail + chunk
                for match in _CREDENTIAL.finditer(window):
                    if match.group("aws") != b"AKIAIOSFODNN7EXAMPLE":
                        found = _CREDENTIAL_KINDS[match.lastgroup or "aws"]
                        break
                tail = window[-64:]
    return digest.hexdigest(), found if text else None


def _credential_files(source: Path, field: str, read: list[tuple[str, int, str, str | None]],
                      allow: Iterable[str], refuse: bool) -> set[str]:
    """The travelling files that hold a credential and no ``allow`` pattern lets through. ``refuse``:
    the first is an SGPUConfigError naming it and the opt-outs (leave it out, or list it in
    ``allow_credential_files`` when it holds no real credential); else each is logged and left out."""
    import pathspec

    allowed = pathspec.PathSpec.from_lines("gitwildmatch", list(allow))
    found = set()
    for rel, _, _, kind in read:
        if kind is None or allowed.match_file(rel):
            continue
        if refuse:
            raise SGPUConfigError(
                field, f"{rel} in {source}", f"files without credentials: it holds {kind}",
                f"nothing was shipped. Leave it out with excludes=['/{rel}'] (or .gitignore), or, when it holds "
                f"no real credential (a test fixture), let it travel with "
                f"environment={{'allow_credential_files': ['/{rel}']}}")
        if (str(source), rel) not in _WARNED:  # once per process: every capture reads the checkout again
            _WARNED.add((str(source), rel))
            logger.warning("%s: %s in %s holds %s: left out of what travels (list it in "
                           "environment={'allow_credential_files': [...]} when it is no real credential)",
                           field, rel, source, kind)
        found.add(rel)
    return found


def ignore_spec(root: Path, excludes: Iterable[str] = ()) -> object:
    """The pathspec of ``root``: defaults, its ``.gitignore``, then ``excludes`` (later rules win)."""
    import pathspec

    lines = list(DEFAULT_EXCLUDES)
    gitignore = root / ".gitignore"
    if root.is_dir() and gitignore.is_file():
        lines += gitignore.read_text(encoding="utf-8", errors="replace").splitlines()
    lines += list(excludes)
    return pathspec.PathSpec.from_lines("gitwildmatch", lines)


def _walk(root: Path, spec: object) -> Iterator[tuple[str, Path]]:
    """(relative path, file) of every file under ``root`` the rules keep.

    Symlinked folders are not entered; a symlinked file travels only when it resolves
    inside ``root`` (its content, as a plain file): nothing outside the folder leaves by a link.
    """
    real_root = root.resolve()
    for folder, dirs, files in os.walk(root, followlinks=False):
        rel_folder = Path(folder).relative_to(root).as_posix()
        prefix = "" if rel_folder == "." else rel_folder + "/"
        kept = []
        for d in sorted(dirs):
            if os.path.islink(os.path.join(folder, d)) or spec.match_file(prefix + d + "/"):  # type: ignore[attr-defined]
                continue
            kept.append(d)
        dirs[:] = kept
        for name in sorted(files):
            rel = prefix + name
            path = Path(folder) / name
            if spec.match_file(rel):  # type: ignore[attr-defined]
                continue
            if path.is_symlink():
                target = path.resolve()
                if not target.is_file() or not target.is_relative_to(real_root):
                    continue
            elif not path.is_file():
                continue  # sockets, fifos
            yield rel, path


def _mib(size: int) -> str:
    return f"{size / (1024 * 1024):.1f} MiB"


def scan(name: str, source: Path, field: str, *, excludes: Iterable[str] = (),
         max_bytes: int = DEFAULT_MAX_BYTES, limit_field: str = "environment.max_bytes",
         allow_credentials: Iterable[str] = (), credentials: str = "refuse") -> Tree:
    """The manifest of a folder or a single ``.py`` file, checked against ``max_bytes``.

    Sizes are summed before anything is hashed, so a folder over the limit fails at once
    with an :class:`SGPUConfigError` naming ``field``, the size, the limit and its largest files.
    Every text file that would travel is scanned for credentials (:func:`credential_in`): one found
    is an :class:`SGPUConfigError` naming the file (``credentials="refuse"``: a project, a module) or
    is left out with a warning (``"leave_out"``: an editable distribution's checkout, whose tests may
    hold fake keys), unless ``allow_credentials`` (gitignore patterns) matches it.
    """
    source = Path(source)
    if source.is_file():
        entries = [(source.name, source)]
    elif source.is_dir():
        entries = list(_walk(source, ignore_spec(source, excludes)))
    else:
        raise SGPUConfigError(field, str(source), "an existing folder or .py file")
    sizes = [(rel, path, path.stat().st_size) for rel, path in entries]
    total = sum(size for _, _, size in sizes)
    if total > max_bytes:
        largest = sorted(sizes, key=lambda item: -item[2])[:3]
        shown = ", ".join(f"{rel} ({_mib(size)})" for rel, _, size in largest)
        raise SGPUConfigError(
            field, f"{source} ({_mib(total)} in {len(sizes)} files after ignore rules)",
            f"at most {_mib(max_bytes)} ({limit_field}={max_bytes})",
            f"largest: {shown}; leave files out with excludes=[...] (gitignore patterns, .gitignore is read too) "
            f"or raise {limit_field}",
        )
    read = [(rel, size, *_read(path)) for rel, path, size in sizes]
    left_out = _credential_files(source, field, read, allow_credentials, refuse=credentials == "refuse")
    files = tuple(FileEntry(path=rel, size=size, sha256=sha) for rel, size, sha, _ in read if rel not in left_out)
    return Tree(name=name, source=str(source.resolve()), files=tuple(sorted(files, key=_key)))


def installed_files(name: str, base: Path, relative: Iterable[str], field: str) -> Tree:
    """The manifest of an installed distribution's own files (its RECORD), bytecode left out.

    Only files inside ``base`` (its site folder) travel: a RECORD entry that is absolute, climbs with
    ``..`` or resolves outside ``base`` through a link names some other file of this machine, and is
    left out."""
    kept = []
    real_base = base.resolve()
    for rel in relative:
        path = base / rel
        parts = Path(rel).parts
        if rel.endswith((".pyc", ".pyo")) or "__pycache__" in parts or ".." in parts or Path(rel).is_absolute():
            continue
        if not path.resolve().is_relative_to(real_base) or not path.is_file():
            continue
        kept.append(FileEntry(path=Path(rel).as_posix(), size=path.stat().st_size, sha256=file_sha256(path)))
    if not kept:
        raise SGPUConfigError(field, name, "an installed distribution whose files are on this machine")
    return Tree(name=name, source=str(base), files=tuple(sorted(kept, key=_key)))
