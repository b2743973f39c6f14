"""The user's own modules that travel with a job by default.

A function pickled on the driver refers to the modules it uses by name: a rank imports them
while it loads the payload. Installed distributions are pinned and built on the node, the
function's own module travels by value, but a sibling package of the user's project
(``mylib/`` beside ``user_train.py``) is neither: without it every rank of a remote job
fails with ``ModuleNotFoundError`` before the function runs.

So, unless ``environment={"auto_modules": False}``, every top-level module the driver has
imported from a folder on ``sys.path`` that is

- not the standard library, not a site-packages folder, not inside a virtual environment, and
- not an installed distribution (those are pinned, or travel as local packages)

travels as files, exactly as a ``py_modules`` entry does: the same ignore rules, hashes and
size limit, and importable on every rank. What is imported is the truth of what the driver's
code may need: a module the driver never imported cannot be in the payload.

For a script (``run_script``), nothing of the script's folder has been imported on the driver:
the modules the script imports that lie in its folder (and, in turn, what those import from
there) travel the same way, found by reading the files' ``import`` statements.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path
from typing import Iterable

from prefect_sgpu.errors import PayloadImportError

__all__ = ["LocalModule", "explained", "imported", "imported_by_script", "is_local_source", "where_on_driver"]

#: a folder on sys.path whose name says it holds installed distributions
_INSTALLED_FOLDERS = ("site-packages", "dist-packages")


class LocalModule:
    """One top-level module of the user's: its name, its source (a package folder or a .py file)
    and the folder on ``sys.path`` it was imported from."""

    __slots__ = ("name", "source", "folder")

    def __init__(self, name: str, source: Path, folder: Path) -> None:
        self.name, self.source, self.folder = name, source, folder

    def __repr__(self) -> str:
        return f"LocalModule({self.name!r}, {str(self.source)!r})"


def _not_user_folders() -> list[Path]:
    """Folders whose modules are never the user's: the standard library and every environment's."""
    import site
    import sysconfig

    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix})
    paths.update(getattr(site, "getsitepackages", lambda: [])())
    user = getattr(site, "getusersitepackages", lambda: None)()
    if user:
        paths.add(user)
    return [Path(p).resolve() for p in paths if p]


def _path_folders() -> list[Path]:
    """``sys.path`` as folders, in order ('' is the current folder, as import reads it)."""
    out: list[Path] = []
    for entry in sys.path:
        try:
            folder = Path(entry or os.getcwd()).resolve()
        except OSError:
            continue
        if folder.is_dir() and folder not in out:
            out.append(folder)
    return out


def _is_user_folder(folder: Path, excluded: list[Path]) -> bool:
    if any(part in _INSTALLED_FOLDERS for part in folder.parts):
        return False
    if (folder / "pyvenv.cfg").is_file():
        return False
    return not any(folder == ex or folder.is_relative_to(ex) for ex in excluded)


def _source_of(module: object) -> Path | None:
    """A top-level module's source: its package folder, or its own ``.py`` file."""
    file = getattr(module, "__file__", None)
    paths = list(getattr(module, "__path__", None) or ())
    if file:
        path = Path(file)
        if path.name == "__init__.py":
            return path.parent.resolve()
        return path.resolve() if path.suffix == ".py" else None
    if len(paths) == 1:  # a namespace package of one folder
        return Path(paths[0]).resolve()
    return None


def imported(skip: Iterable[str] = (), roots: Iterable[Path] = (), shipped: Iterable[Path] = ()) -> list[LocalModule]:
    """The user's top-level modules this process has imported (see the module doc), sorted by name.

    Left out, because they travel already: ``skip``, names given in ``py_modules``; modules imported
    from one of ``roots``, folders that travel whole and are a node's import root (``working_dir``);
    modules imported from one of ``shipped``, the folders of editable distributions (or their ``src``),
    which travel as such.
    """
    skipped = set(skip)
    root_folders = {Path(p).resolve() for p in roots}
    shipped_folders = [Path(p).resolve() for p in shipped]
    excluded = _not_user_folders()
    folders = [f for f in _path_folders() if _is_user_folder(f, excluded)]
    found: dict[str, LocalModule] = {}
    for name, module in list(sys.modules.items()):
        if "." in name or name == "__main__" or name in skipped or module is None:
            continue
        source = _source_of(module)
        if source is None or (source.suffix != ".py" and not source.is_dir()):
            continue
        folder = source.parent
        if folder not in folders or folder in root_folders:
            continue
        if source.stem != name and source.name != name:
            continue  # registered under another name (a test runner's, an alias): not importable by it
        if any(folder in (f, f / "src") for f in shipped_folders):
            continue  # importable from an editable distribution's tree, which travels as such
        found[name] = LocalModule(name, source, folder)
    return [found[n] for n in sorted(found)]


def _imported_names(path: Path) -> set[str]:
    """Top-level names a Python file imports (absolute imports only; relative ones stay inside a package)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def imported_by_script(script: Path, skip: Iterable[str] = ()) -> list[LocalModule]:
    """Modules of ``script``'s own folder that it imports, followed through what those import from
    that folder (a script's folder is its first import root on every rank, as with ``python script.py``)."""
    script = Path(script).resolve()
    folder = script.parent
    skipped = set(skip)
    found: dict[str, LocalModule] = {}
    todo = [script]
    while todo:
        path = todo.pop()
        for name in sorted(_imported_names(path)):
            if name in found or name in skipped:
                continue
            package, single = folder / name, folder / f"{name}.py"
            if (package / "__init__.py").is_file() or (package.is_dir() and any(package.glob("*.py"))):
                found[name] = LocalModule(name, package, folder)
                todo.extend(sorted(package.rglob("*.py")))
            elif single.is_file() and single != script:
                found[name] = LocalModule(name, single, folder)
                todo.append(single)
    return [found[n] for n in sorted(found)]


def where_on_driver(name: str) -> str | None:
    """Where the driver imports the top-level module ``name`` from (its package folder or file), if it can."""
    import importlib.util

    top = name.split(".")[0]
    module = sys.modules.get(top)
    source = _source_of(module) if module is not None else None
    if source is None:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            source = Path(list(spec.submodule_search_locations)[0])
        elif spec is not None and spec.origin and spec.origin.endswith(".py"):
            source = Path(spec.origin)
    return str(source) if source is not None else None


def is_local_source(source: str) -> bool:
    """Whether a module's source lies in the user's own folders (not an environment's, not the
    standard library): such a module travels as files, any other is installed on the nodes."""
    path = Path(source).resolve()
    return _is_user_folder(path.parent, _not_user_folders())


def explained(error: PayloadImportError) -> PayloadImportError:
    """A rank's :class:`PayloadImportError` as this process (the driver) explains it: where it imports
    the module from, and whether that is the user's own code (ship it) or installed (install it)."""
    try:
        source = where_on_driver(error.module)
        local = source is not None and is_local_source(source)
    except Exception:  # noqa: BLE001 - an explanation never hides the error itself
        source, local = None, True
    return PayloadImportError(error.module, error.rank_detail, source, local, explained=True)
