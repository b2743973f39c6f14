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
import os
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
#: bytes a travelling folder may hold after its ignore rules (Ray's working_dir limit is of this order)
DEFAULT_MAX_BYTES = 100 * 1024 * 1024
_CHUNK = 1 << 20


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
         max_bytes: int = DEFAULT_MAX_BYTES, limit_field: str = "environment.max_bytes") -> Tree:
    """The manifest of a folder or a single ``.py`` file, checked against ``max_bytes``.

    Sizes are summed before anything is hashed, so a folder over the limit fails at once
    with an :class:`SGPUConfigError` naming ``field``, the size, the limit and its largest files.
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
    files = tuple(FileEntry(path=rel, size=size, sha256=file_sha256(path)) for rel, path, size in sizes)
    return Tree(name=name, source=str(source.resolve()), files=tuple(sorted(files, key=_key)))


def installed_files(name: str, base: Path, relative: Iterable[str], field: str) -> Tree:
    """The manifest of an installed distribution's own files (its RECORD), bytecode left out."""
    kept = []
    for rel in relative:
        path = base / rel
        parts = Path(rel).parts
        if rel.endswith((".pyc", ".pyo")) or "__pycache__" in parts or ".." in parts or not path.is_file():
            continue
        kept.append(FileEntry(path=Path(rel).as_posix(), size=path.stat().st_size, sha256=file_sha256(path)))
    if not kept:
        raise SGPUConfigError(field, name, "an installed distribution whose files are on this machine")
    return Tree(name=name, source=str(base), files=tuple(sorted(kept, key=_key)))
