"""What a job's nodes need: the driver's environment, described exactly and content-addressed.

A function pickled on the driver runs on a node only when the node's Python, packages and
the user's own code match the driver's. This module *describes* that environment; the
node half (building it with uv, caching it by digest, checking it before ranks start)
consumes the description.

Two models:

- :class:`EnvironmentOptions`, what a user asks for with ``environment=`` (checked when
  given: paths exist, URLs parse, requirements parse, nothing is read or hashed yet);
- :class:`Environment`, what :func:`capture` finds (the Python, every installed
  distribution pinned, the local and editable ones, the project's files) and its
  :attr:`~Environment.digest`.

Local packages are found by PEP 610: a distribution with a ``direct_url.json`` was not
installed from an index by name. Editable ones travel as their source folder (with its
``.gitignore`` and the default ignore rules), other local, VCS and URL installs as the
files their RECORD lists. None of them is ever installed by name from an index.

Index URLs may carry credentials. Whatever shows one (repr, str, ``describe()``,
``model_dump``, dry runs, logs, pickles) shows it masked; the literal credentials stay in
the driver's memory (:meth:`IndexURL.reveal`) and do not survive pickling. A
``${VAR}`` in a URL is read from the driver's environment when revealed and is never a
secret in itself, so such a URL survives pickling.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Mapping
from urllib.parse import urlsplit

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator)

from prefect_sgpu.environment.files import DEFAULT_MAX_BYTES, Tree, installed_files, scan
from prefect_sgpu.environment.index import IndexSettings, IndexURL, masked, masked_text
from prefect_sgpu.errors import SGPUConfigError

__all__ = ["ENVIRONMENT_ENV", "Distribution", "Environment", "EnvironmentOptions", "IndexURL", "PythonVersion",
           "capture", "for_compute", "option_text", "parse_option"]

ENVIRONMENT_ENV = "PREFECT_SGPU_ENVIRONMENT"
#: bumped whenever what the digest covers changes, so an old cache key never matches a new meaning
DIGEST_FORMAT = 1
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(value: Any) -> Any:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise SGPUConfigError("requirements", value, "a list of requirement strings (PEP 508)")
    from packaging.requirements import InvalidRequirement, Requirement

    out = []
    for i, item in enumerate(value):
        try:
            req = Requirement(str(item))
        except InvalidRequirement as exc:
            raise SGPUConfigError(f"requirements[{i}]", masked_text(str(item)), "a PEP 508 requirement, for example "
                                  "'transformers==4.46.3'", str(exc)) from None
        if req.url and urlsplit(req.url).netloc.count("@"):
            raise SGPUConfigError(f"requirements[{i}]", masked(req.url), "a requirement without credentials "
                                  "(give them in index_url as ${VAR})")
        out.append(str(req))
    return tuple(sorted(set(out)))


Requirements = Annotated[tuple[str, ...], BeforeValidator(_requirements)]


def _strings(field: str) -> Any:
    def parse(value: Any) -> Any:
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise SGPUConfigError(field, value, "a list of strings")
        return tuple(value)

    return BeforeValidator(parse)


# --- what the user asks for ----------------------------------------------------------------


def _module_source(entry: str, field: str) -> Path:
    """A py_modules entry: a path to a package folder or .py file, or a top-level module's name."""
    path = Path(entry).expanduser()
    if path.exists():
        if path.is_dir() or path.suffix == ".py":
            return path.resolve()
        raise SGPUConfigError(field, entry, "a package folder, a .py file or a top-level module name")
    if not _MODULE.match(entry):
        raise SGPUConfigError(field, entry, "an existing package folder or .py file, or a top-level module "
                              "name (no dots) importable here")
    import importlib.util

    found = importlib.util.find_spec(entry)
    if found is None:
        raise SGPUConfigError(field, entry, "an existing package folder or .py file, or a top-level module "
                              "name importable here")
    if found.submodule_search_locations:
        return Path(list(found.submodule_search_locations)[0]).resolve()
    if found.origin and found.origin.endswith(".py"):
        return Path(found.origin).resolve()
    raise SGPUConfigError(field, entry, "a module written in Python (a folder or .py file), not a built-in "
                          "or compiled one; list its distribution in requirements instead")


def _folder(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise SGPUConfigError("environment.working_dir", value, "the path of an existing folder")
    path = Path(value).expanduser()
    if not path.is_dir():
        raise SGPUConfigError("environment.working_dir", os.fspath(value), "an existing folder")
    return str(path.resolve())


def _check_modules(value: tuple[str, ...]) -> tuple[str, ...]:
    for i, entry in enumerate(value):
        _module_source(entry, f"environment.py_modules[{i}]")
    return value


class EnvironmentOptions(IndexSettings):
    """``environment=``: what to capture. ``mode="driver"`` (the default) describes the driver's
    own environment; ``mode="image"`` says the node's image has every distribution (only
    ``working_dir``/``py_modules`` travel)."""

    mode: Literal["driver", "image"] = "driver"
    working_dir: Annotated[str | None, BeforeValidator(_folder)] = Field(
        None, description="The project folder that travels (ignore rules apply).")
    excludes: Annotated[tuple[str, ...], _strings("excludes")] = Field(
        (), description="gitignore patterns left out of working_dir (after the defaults and its .gitignore).")
    max_bytes: int = Field(DEFAULT_MAX_BYTES, gt=0, description="Largest working_dir (and each py_module) in bytes.")
    py_modules: Annotated[tuple[str, ...], _strings("py_modules"), AfterValidator(_check_modules)] = Field(
        (), description="Package folders, .py files or top-level module names that travel.")
    allow_credential_files: Annotated[tuple[str, ...], _strings("allow_credential_files")] = Field(
        (), description=("gitignore patterns of travelling files the credential scan lets through (what they "
                         "hold looks like a credential and is none: a test fixture)."))
    requirements: Requirements = Field((), description="Extra PEP 508 requirements installed on the nodes.")
    auto_modules: bool = Field(True, description=(
        "The user's own modules the driver has imported (not the standard library, not installed) travel "
        "as py_modules do (docs/environment.md)."))
    allow_http_index: bool = Field(False, description=(
        "Accept http:// index, extra index and find-links URLs (no TLS: anyone on the path can change "
        "the page, including the sha256s the driver records from it). Off: only https://."))

    @model_validator(mode="after")
    def _https_indexes(self) -> "EnvironmentOptions":
        if self.allow_http_index:
            return self
        named = [("index_url", self.index_url)] if self.index_url is not None else []
        named += [(f"extra_index_urls[{i}]", u) for i, u in enumerate(self.extra_index_urls)]
        named += [(f"find_links[{i}]", u) for i, u in enumerate(self.find_links)]
        for field, url in named:
            if url.shown.lower().startswith("http://"):
                raise SGPUConfigError(f"environment.{field}", url.shown,
                                      "an https:// URL (http:// sends the pages and the wheels unprotected)",
                                      "set environment.allow_http_index=True to accept it on a network you trust")
        return self

    @model_validator(mode="after")
    def _image_installs_nothing(self) -> "EnvironmentOptions":
        if self.mode == "image":
            extra = [name for name in ("requirements", "index_url", "extra_index_urls", "find_links")
                     if getattr(self, name)]
            if extra:
                raise SGPUConfigError(f"environment.{extra[0]}", getattr(self, extra[0]),
                                      "nothing with mode='image' (the image has every distribution); "
                                      "use mode='driver' to install on the nodes")
        return self

    def capture(self, script: str | os.PathLike[str] | None = None) -> "Environment":
        """Describe the driver's environment as these options ask (reads and hashes files).

        ``script``: the job runs this file (``run_script``); with ``auto_modules`` the modules of its
        folder that it imports travel, as the driver's own imported modules do for a function."""
        py_modules = []
        for i, entry in enumerate(self.py_modules):
            source = _module_source(entry, f"environment.py_modules[{i}]")
            name = source.stem if source.suffix == ".py" else source.name
            py_modules.append(scan(name, source, f"environment.py_modules[{i}]", max_bytes=self.max_bytes,
                                   allow_credentials=self.allow_credential_files))
        working_dir = (scan("working_dir", Path(self.working_dir), "environment.working_dir", excludes=self.excludes,
                            max_bytes=self.max_bytes, allow_credentials=self.allow_credential_files)
                       if self.working_dir else None)
        distributions: tuple[Distribution, ...] = ()
        local: tuple[Tree, ...] = ()
        if self.mode == "driver":
            distributions, local = _installed(self.max_bytes, self.allow_credential_files)
        if self.auto_modules:  # last: what the user named is checked (and reported) first
            py_modules += self._auto_modules({t.name for t in py_modules}, script)
        return Environment(
            mode=self.mode, python=PythonVersion.here(), distributions=distributions, local_packages=local,
            working_dir=working_dir, py_modules=tuple(sorted(py_modules, key=lambda t: t.name)),
            requirements=self.requirements, index_url=self.index_url, extra_index_urls=self.extra_index_urls,
            find_links=self.find_links)

    def _auto_modules(self, given: set[str], script: str | os.PathLike[str] | None) -> list[Tree]:
        """The user's own modules (:mod:`prefect_sgpu.environment.modules`), scanned as py_modules are."""
        from prefect_sgpu.environment import modules as environment_modules

        roots = [Path(self.working_dir).resolve()] if self.working_dir else []
        found = environment_modules.imported(skip=given, roots=roots, shipped=editable_folders())
        if script is not None:
            names = given | {m.name for m in found}
            found += [m for m in environment_modules.imported_by_script(Path(script), skip=names)
                      if m.folder not in roots]
        trees = []
        for module in found:
            field = f"environment (the module {module.name!r} the driver imported from {module.folder})"
            try:
                trees.append(scan(module.name, module.source, field, excludes=self.excludes,
                                  max_bytes=self.max_bytes, allow_credentials=self.allow_credential_files))
            except SGPUConfigError as exc:
                raise SGPUConfigError(exc.field, exc.value, exc.allowed,
                                      f"{exc.hint}; or, when the nodes do not need it, leave the driver's own "
                                      "modules out with environment={'auto_modules': False} and name what "
                                      "they need in py_modules") from None
        return trees


# --- what was captured ----------------------------------------------------------------------


class PythonVersion(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    implementation: str = Field(description="sys.implementation.name: cpython, pypy, ...")
    version: str = Field(description="major.minor.micro")

    @property
    def minor(self) -> str:
        """``3.11``: code objects (pickled functions) load only on the same minor version."""
        return ".".join(self.version.split(".")[:2])

    @classmethod
    def here(cls) -> "PythonVersion":
        info = sys.version_info
        return cls(implementation=sys.implementation.name, version=f"{info.major}.{info.minor}.{info.micro}")

    def __str__(self) -> str:
        return f"{self.implementation} {self.version}"


class Distribution(BaseModel):
    """One installed distribution, pinned. ``source`` other than ``index``: its files travel."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    version: str
    source: Literal["index", "editable", "local"] = "index"
    entry_points: str = Field(default="", description=(
        "an editable distribution's entry_points.txt (plugins such as MLflow's find it there): the "
        "node writes it into the dist-info it makes"))


def _direct_url(dist: Any) -> dict[str, Any] | None:
    try:
        text = dist.read_text("direct_url.json")
    except OSError:
        return None
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _site_dirs() -> set[Path]:
    """The folders installers put distributions in (a distribution found elsewhere was not installed)."""
    import site
    import sysconfig

    dirs = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    dirs.update(getattr(site, "getsitepackages", lambda: [])())
    user = getattr(site, "getusersitepackages", lambda: None)()
    if user:
        dirs.add(user)
    dirs.update(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    return {Path(d).resolve() for d in dirs}


#: what ``_distributions`` found, by the fingerprint of ``sys.path`` it was found under
_FOUND: dict[tuple[tuple[str, int | None], ...], tuple[tuple[Distribution, ...], tuple[Any, ...]]] = {}


def path_fingerprint() -> tuple[tuple[str, int | None], ...]:
    """``sys.path`` with each folder's modification time: installing, removing or upgrading a
    distribution adds or removes an entry (its metadata folder) in the folder that holds it."""
    stamps = []
    for entry in sys.path:
        try:
            stamps.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            stamps.append((entry, None))
    return tuple(stamps)


def _installed(max_bytes: int, allow_credentials: Iterable[str] = ()) -> tuple[tuple[Distribution, ...],
                                                                                tuple[Tree, ...]]:
    """Every distribution the driver's interpreter sees and the files of those whose files travel,
    hashed now (the distributions are read again only when ``sys.path`` or a folder on it changed:
    reading every metadata file costs more than the rest of a capture)."""
    key = path_fingerprint()
    if key not in _FOUND:
        _FOUND.clear()
        _FOUND[key] = _distributions()
    distributions, sources = _FOUND[key]
    trees = [scan(name, folder, field, max_bytes=max_bytes, allow_credentials=allow_credentials,
                  credentials="leave_out") if rels is None
             else installed_files(name, folder, rels, field) for name, field, folder, rels in sources]
    return distributions, tuple(sorted(trees, key=lambda t: t.name))


def editable_folders() -> list[Path]:
    """The source folders of the editable distributions (and of metadata in plain folders on ``sys.path``):
    what is in them travels as that distribution's files, never as a module of its own."""
    key = path_fingerprint()
    if key not in _FOUND:
        _FOUND.clear()
        _FOUND[key] = _distributions()
    return [folder for _, _, folder, rels in _FOUND[key][1] if rels is None]


def _distributions() -> tuple[tuple[Distribution, ...], tuple[Any, ...]]:
    """Every distribution the driver's interpreter sees (the first of a name on sys.path, as import
    finds it) and where the files travel from for those not installed from an index by name:
    PEP 610's ``direct_url.json`` (editable: its source folder; file, VCS or URL installs: the
    files its RECORD lists), or metadata outside every site-packages folder (its folder)."""
    from importlib import metadata
    from urllib.request import url2pathname

    seen: dict[str, Distribution] = {}
    sources: list[tuple[str, str, Path, list[str] | None]] = []  # name, field, folder, RECORD files
    site_dirs = _site_dirs()
    for dist in metadata.distributions():
        raw_name = dist.metadata["Name"] if dist.metadata else None
        if not raw_name:
            continue
        name = _normalize(raw_name)
        if name in seen:
            continue
        direct = _direct_url(dist)
        source: Literal["index", "editable", "local"] = "index"
        field = f"environment (the installed package {name})"
        folder = Path(dist.locate_file("")).resolve()
        if direct is None and folder not in site_dirs:
            # metadata in a plain folder on sys.path (a checkout's *.egg-info, PYTHONPATH): its source travels
            source = "editable"
            sources.append((name, field, folder, None))
        elif direct is not None:
            url = str(direct.get("url", ""))
            if (direct.get("dir_info") or {}).get("editable") and url.startswith("file://"):
                source = "editable"
                sources.append((name, field, Path(url2pathname(urlsplit(url).path)), None))
            else:
                source = "local"
                base = Path(dist.locate_file(""))
                sources.append((name, field, base, [str(f) for f in (dist.files or ())
                                                    if ".." not in Path(str(f)).parts]))
        entry_points = (dist.read_text("entry_points.txt") or "") if source == "editable" else ""
        seen[name] = Distribution(name=name, version=dist.version, source=source, entry_points=entry_points)
    return tuple(sorted(seen.values(), key=lambda d: d.name)), tuple(sources)


class Environment(IndexSettings):
    """What a job's nodes need, as captured on the driver. :attr:`digest` names it.

    ``mode="image"``: the image brings every distribution (``distributions`` is empty); the
    Python version is still the driver's, for the check before ranks start.
    """

    mode: Literal["driver", "image"] = "driver"
    python: PythonVersion
    distributions: tuple[Distribution, ...] = ()
    local_packages: tuple[Tree, ...] = Field((), description="Files of the editable and local distributions.")
    working_dir: Tree | None = None
    py_modules: tuple[Tree, ...] = ()
    requirements: Requirements = ()

    @classmethod
    def image(cls, working_dir: str | os.PathLike[str] | None = None, py_modules: Iterable[str] = (),
              **options: Any) -> "Environment":
        """The image has everything: install nothing; the project's own files may still travel."""
        return capture(working_dir=working_dir, py_modules=py_modules, mode="image", **options)

    def defining(self) -> dict[str, Any]:
        """Everything that defines the built environment, and nothing else (no paths of this machine,
        no credentials): what :attr:`digest` hashes."""
        return {
            "format": DIGEST_FORMAT,
            "mode": self.mode,
            "python": [self.python.implementation, self.python.version],
            "distributions": [[d.name, d.version, d.source] for d in self.distributions],
            "local_packages": [[t.name, t.digest] for t in self.local_packages],
            "working_dir": self.working_dir.digest if self.working_dir else None,
            "py_modules": [[t.name, t.digest] for t in self.py_modules],
            "requirements": list(self.requirements),
            **self.shown(),
        }

    @property
    def digest(self) -> str:
        """sha256 of :meth:`defining`: the same on every machine with the same environment."""
        text = json.dumps(self.defining(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def describe(self) -> dict[str, Any]:
        """A summary for dry runs and logs: counts, sizes, masked index URLs, no file lists."""

        def tree(t: Tree) -> dict[str, Any]:
            return {"name": t.name, "files": len(t.files), "bytes": t.total_bytes, "digest": t.digest[:16]}

        return {
            "mode": self.mode, "digest": self.digest, "python": str(self.python),
            "distributions": len(self.distributions),
            "local_packages": [{**tree(t), "source": self._source(t.name)} for t in self.local_packages],
            "working_dir": tree(self.working_dir) if self.working_dir else None,
            "py_modules": [tree(t) for t in self.py_modules],
            "requirements": list(self.requirements), **self.shown(),
        }

    def _source(self, name: str) -> str:
        return next((d.source for d in self.distributions if d.name == name), "local")

    def __repr__(self) -> str:
        return (f"Environment(mode={self.mode!r}, digest={self.digest[:16]!r}, python={str(self.python)!r}, "
                f"distributions={len(self.distributions)}, local_packages={[t.name for t in self.local_packages]!r}, "
                f"working_dir={'yes' if self.working_dir else None}, py_modules={[t.name for t in self.py_modules]!r}, "
                f"requirements={list(self.requirements)!r}, index={self.shown()!r})")

    __str__ = __repr__


def _options(given: Mapping[str, Any], field: str) -> EnvironmentOptions:
    try:
        return EnvironmentOptions(**given)
    except SGPUConfigError as exc:
        if exc.field.startswith("environment"):
            raise
        raise SGPUConfigError(f"{field}.{exc.field}", exc.value, exc.allowed, exc.hint) from None
    except ValidationError as exc:
        err = exc.errors()[0]
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, SGPUConfigError):
            name = cause.field if cause.field.startswith("environment") else f"{field}.{cause.field}"
            raise SGPUConfigError(name, cause.value, cause.allowed, cause.hint) from None
        loc = ".".join(str(p) for p in err.get("loc", ()))
        allowed = err.get("msg", "invalid value")
        if err.get("type") == "extra_forbidden":
            allowed = "one of " + ", ".join(n for n in EnvironmentOptions.model_fields)
        shown = err.get("input")
        shown = masked_text(shown) if isinstance(shown, str) else shown
        raise SGPUConfigError(f"{field}.{loc}" if loc else field, shown, allowed) from None


def capture(working_dir: str | os.PathLike[str] | None = None, py_modules: Iterable[str] = (),
            requirements: Iterable[str] = (), *, mode: Literal["driver", "image"] = "driver",
            **options: Any) -> Environment:
    """Describe the driver's own environment: Python, pinned distributions, local and editable
    packages, ``working_dir`` and ``py_modules`` (each file hashed), ``requirements`` and the
    index settings (``index_url``, ``extra_index_urls``, ``find_links``, ``excludes``, ``max_bytes``)."""
    given = {"mode": mode, "working_dir": None if working_dir is None else os.fspath(working_dir),
             "py_modules": list(py_modules), "requirements": list(requirements), **options}
    return _options(given, "environment").capture()


# --- environment= on every layer -----------------------------------------------------------

Option = EnvironmentOptions | Environment


def _load_file(path: Path, field: str) -> dict[str, Any]:
    try:
        if path.suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # the same parser, before it joined the standard library
                import tomli as tomllib

            data = tomllib.loads(path.read_text(encoding="utf-8"))
        else:
            data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SGPUConfigError(field, str(path), "a readable JSON or TOML file of environment options",
                              str(exc)) from None
    if not isinstance(data, dict):
        raise SGPUConfigError(field, str(path), "a JSON object or TOML table of environment options")
    # relative paths in the file are the file's own, wherever the driver runs from
    for key in ("working_dir",):
        if isinstance(data.get(key), str) and not Path(data[key]).expanduser().is_absolute():
            data[key] = str(path.parent / data[key])
    for key in ("py_modules", "find_links"):
        values = data.get(key)
        if isinstance(values, list):
            data[key] = [str(path.parent / v) if isinstance(v, str) and (path.parent / v).exists()
                         and not Path(v).is_absolute() else v for v in values]
    return data


def parse_option(value: Any, field: str = "environment") -> Option | None:
    """``environment=`` as any layer gives it, checked: None, an :class:`Environment` (already
    captured), :class:`EnvironmentOptions`, a mapping of options, ``"driver"``, ``"image"``, a JSON
    object, or the path of a ``.json``/``.toml`` file of options. Raises SGPUConfigError."""
    allowed = ("'driver', 'image', a JSON object of options, the path of a .json or .toml file of options, "
               "a dict of options, EnvironmentOptions or a captured Environment")
    if value is None or isinstance(value, (Environment, EnvironmentOptions)):
        return value
    if isinstance(value, Mapping):
        if "python" in value:  # a captured Environment, dumped
            try:
                return Environment.model_validate(dict(value))
            except ValidationError as exc:
                raise SGPUConfigError(field, "a captured environment", allowed, str(exc.errors()[0]["msg"])) from None
        return _options(value, field)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise SGPUConfigError(field, value, allowed)
    text = value.strip()
    if text.lower() in ("driver", "image"):
        return EnvironmentOptions(mode=text.lower())  # type: ignore[arg-type]
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise SGPUConfigError(field, masked_text(text), allowed, f"not JSON: {exc}") from None
        return parse_option(data, field)
    path = Path(text).expanduser()
    if path.suffix in (".json", ".toml"):
        if not path.is_file():
            raise SGPUConfigError(field, text, "an existing .json or .toml file of environment options")
        return parse_option(_load_file(path.resolve(), field), field)
    raise SGPUConfigError(field, text, allowed)


def option_text(option: Option) -> str:
    """``option`` as ``PREFECT_SGPU_ENVIRONMENT`` holds it (what :func:`parse_option` reads back).

    Literal index credentials are written as given: this is the hand-over to the flow run's
    own environment (the work pool had them), never something to show.
    """
    if isinstance(option, Environment):
        raise SGPUConfigError("environment", repr(option), "options, not a captured environment, in "
                              f"{ENVIRONMENT_ENV}")
    data: dict[str, Any] = {"mode": option.mode}
    for name in ("working_dir", "excludes", "py_modules", "requirements", "allow_credential_files"):
        value = getattr(option, name)
        if value:
            data[name] = list(value) if isinstance(value, tuple) else value
    if option.max_bytes != DEFAULT_MAX_BYTES:
        data["max_bytes"] = option.max_bytes
    if not option.auto_modules:
        data["auto_modules"] = False
    if option.allow_http_index:
        data["allow_http_index"] = True
    if option.index_url is not None:
        data["index_url"] = option.index_url._url or option.index_url.shown
    for name in ("extra_index_urls", "find_links"):
        urls = getattr(option, name)
        if urls:
            data[name] = [u._url or u.shown for u in urls]
    return json.dumps(data, separators=(",", ":")) if len(data) > 1 else option.mode


def for_compute(option: Option | None, remote: bool,
                script: str | os.PathLike[str] | None = None) -> Environment | None:
    """The environment a job's nodes need: none on this machine (local nodes run in the driver's
    own environment); on remote nodes the one given, else the driver's, captured now (``script``:
    the file a script job runs, whose own imports of its folder travel too)."""
    if not remote:
        return None
    if option is None:
        option = EnvironmentOptions()
    if isinstance(option, Environment):
        return option
    return option.capture(script)
