"""``environment=`` on Ray: the job's captured environment as Ray's own ``runtime_env``.

Ray already moves code and installs packages for the processes of a job (``working_dir``,
``py_modules``, ``pip``); prefect-sgpu adds no second mechanism beside it. This module turns
an :class:`~prefect_sgpu.environment.Environment` into those keys and merges them with a
``runtime_env`` the user gave (``RayCompute(runtime_env=...)``), refusing before anything is
started what the two would both set.

What maps to what (docs/environment.md, "On Ray"):

- ``working_dir`` -> ``working_dir`` (the folder; ``excludes`` leave out exactly what the
  capture left out: the default ignore rules, its ``.gitignore`` and ``excludes=``);
- ``py_modules`` -> ``py_modules`` (each package folder or ``.py`` file);
- ``requirements`` (mode ``"driver"``) -> ``pip``: the requirements as its packages, the index
  settings as pip's install options (``--index-url``, ``--extra-index-url``, ``--find-links``).
  Ray's pip plugin installs them in a virtualenv on top of the cluster's own packages.

The driver's pinned distributions and its local packages are *not* sent: an existing cluster
runs its own image (its Ray, its CUDA build of torch), and reinstalling the driver's set there
through Ray's pip plugin would be minutes per node, replace the cluster's builds with the
driver's platform's, and could not change Ray itself under a running raylet. Ray checks the
Python minor version and the Ray version itself when the driver connects.

Index credentials: a ``runtime_env`` is shown by Ray (dashboard, ``ray list``, the state API,
the agent's logs), so an index URL with credentials (literal or ``${VAR}``) is refused; Ray's
installer runs in each node's own environment, where ``PIP_INDEX_URL`` or a netrc may carry them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from prefect_sgpu.environment.files import DEFAULT_EXCLUDES
from prefect_sgpu.errors import SGPUConfigError

if TYPE_CHECKING:
    from prefect_sgpu.environment import Environment, IndexURL
    from prefect_sgpu.environment.files import Tree

#: pip options Ray's pip plugin uses when none are given (kept when we give our own)
PIP_DEFAULT_OPTIONS = ("--disable-pip-version-check", "--no-cache-dir")
#: runtime_env keys that choose how packages are installed: only one may be set, and the environment's
#: requirements need ``pip``
INSTALLERS = ("pip", "uv", "conda")
#: Ray's own variable for a job's runtime_env, read by ``ray.init()`` (how ``ray job submit`` hands it over)
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def from_environment(environment: "Environment | None", *, installs: bool = True) -> dict[str, Any]:
    """The ``runtime_env`` keys that carry ``environment`` on Ray (empty when nothing travels).

    ``installs=False``: the processes already run in an environment that has the requirements
    (nothing goes to ``pip``)."""
    if environment is None:
        return {}
    out: dict[str, Any] = {}
    excludes = list(DEFAULT_EXCLUDES)
    if environment.working_dir is not None:
        out["working_dir"] = environment.working_dir.source
        excludes += _left_out(environment.working_dir)
    if environment.py_modules:
        out["py_modules"] = [t.source for t in environment.py_modules]
    if out:
        out["excludes"] = excludes
    if installs and environment.mode == "driver" and environment.requirements:
        out["pip"] = {"packages": list(environment.requirements),
                      "pip_install_options": [*PIP_DEFAULT_OPTIONS, *_index_options(environment)]}
    return out


def merged(given: Mapping[str, Any] | None, environment: "Environment | None", *, field: str = "runtime_env",
           installs: bool = True) -> dict[str, Any]:
    """``given`` (the user's own ``runtime_env``) with ``environment`` mapped onto it.

    Both may set different keys; ``py_modules`` and ``excludes`` lists are joined. A key both
    would set (``working_dir``, or an installer when the environment has requirements) raises
    :class:`SGPUConfigError` naming it, before anything is started."""
    given = dict(given or {})
    mapped = from_environment(environment, installs=installs)
    if "working_dir" in mapped and given.get("working_dir") is not None:
        raise SGPUConfigError(
            f"{field}.working_dir", given["working_dir"],
            "no working_dir in runtime_env when environment= has one "
            f"(environment.working_dir={mapped['working_dir']!r})",
            "give the project folder in one place: environment={'working_dir': ...} (its ignore rules and size "
            "limit apply) or runtime_env={'working_dir': ...}, not both")
    if "pip" in mapped:
        assert environment is not None
        for key in INSTALLERS:
            if given.get(key) is not None:
                raise SGPUConfigError(
                    f"{field}.{key}", _shown(given[key]),
                    "no pip, uv or conda in runtime_env when environment= has requirements "
                    f"(environment.requirements={list(environment.requirements)!r}, installed with Ray's pip)",
                    "list every extra package in environment.requirements (with its index settings), "
                    "or every one in runtime_env, not both")
    out = dict(given)
    for key, value in mapped.items():
        if key in ("py_modules", "excludes") and given.get(key):
            out[key] = [*given[key], *value]
        else:
            out[key] = value
    return out


def job_config_json(runtime_env: Mapping[str, Any]) -> str:
    """``runtime_env`` as Ray's job-config variable holds it: ``ray.init()`` in the driver merges it
    with its own ``runtime_env=`` (and refuses a key both set), as for ``ray job submit``."""
    return json.dumps({"runtime_env": dict(runtime_env)}, separators=(",", ":"), sort_keys=True)


def _shown(value: Any) -> Any:
    from prefect_sgpu.environment.index import masked_text

    return masked_text(value) if isinstance(value, str) else value


def _index_options(environment: "Environment") -> list[str]:
    options: list[str] = []
    if environment.index_url is not None:
        options += ["--index-url", _plain(environment.index_url, "environment.index_url")]
    for i, url in enumerate(environment.extra_index_urls):
        options += ["--extra-index-url", _plain(url, f"environment.extra_index_urls[{i}]")]
    for i, url in enumerate(environment.find_links):
        options += ["--find-links", _plain(url, f"environment.find_links[{i}]")]
    return options


def _plain(url: "IndexURL", field: str) -> str:
    """The URL as Ray may show it: refused when it carries credentials, literal or ``${VAR}``."""
    text = url.shown
    if url.has_secret or "${" in text:
        raise SGPUConfigError(
            field, text, "an index URL without credentials on Ray (a runtime_env is shown by Ray's dashboard, "
            "`ray list` and the state API, so nothing secret may be written into it)",
            "use a credential-free mirror, or give the cluster's nodes the index themselves "
            "(PIP_INDEX_URL, PIP_EXTRA_INDEX_URL or a netrc in the nodes' environment: Ray's pip runs with it)")
    return url.reveal()


def _left_out(tree: "Tree") -> list[str]:
    """Patterns (anchored at the folder) for what the capture left out of ``tree`` beyond the defaults,
    so Ray uploads exactly the files the digest covers: whole folders where none of their files
    travel, else single files."""
    root = Path(tree.source)
    kept = {f.path for f in tree.files}
    kept_dirs = {str(Path(p).parent).replace(os.sep, "/") for p in kept}
    kept_dirs |= {"/".join(d.split("/")[:i]) for d in kept_dirs for i in range(1, d.count("/") + 1)}
    patterns: list[str] = []
    if not root.is_dir():
        return patterns
    for current, dirs, files in os.walk(root):
        rel = Path(current).relative_to(root).as_posix()
        prefix = "" if rel == "." else f"{rel}/"
        for name in list(dirs):
            sub = f"{prefix}{name}"
            if os.path.islink(os.path.join(current, name)) or sub not in kept_dirs:
                dirs.remove(name)
                if not _default_excluded(name, is_dir=True):
                    patterns.append(f"/{sub}/")
        for name in files:
            path = f"{prefix}{name}"
            if path not in kept and not _default_excluded(name, is_dir=False):
                patterns.append(f"/{path}")
    return patterns


def _default_excluded(name: str, *, is_dir: bool) -> bool:
    """Whether a default rule already leaves this name out (no need to repeat it)."""
    import fnmatch

    for rule in DEFAULT_EXCLUDES:
        if rule.endswith("/"):
            if is_dir and fnmatch.fnmatch(name, rule[:-1]):
                return True
        elif fnmatch.fnmatch(name, rule):
            return True
    return False


def uploaded(runtime_env: Mapping[str, Any]) -> dict[str, Any]:
    """``runtime_env`` with its local ``working_dir`` and ``py_modules`` uploaded to the connected
    cluster and named by their ``gcs://`` URIs, as ``ray.init(runtime_env=...)`` does for a job.

    A task's or actor's own ``runtime_env`` may name only URIs (Ray refuses local paths there),
    and one process holds one Ray connection for many jobs of different environments, so each
    job's files go up here, through Ray's own upload (content-addressed: the same files are
    uploaded once)."""
    if not any(key in runtime_env for key in ("working_dir", "py_modules")):
        return dict(runtime_env)
    import ray
    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

    worker = ray._private.worker.global_worker
    scratch = worker.node.get_runtime_env_dir_path() if getattr(worker, "node", None) is not None else None
    include_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    out = upload_py_modules_if_needed(dict(runtime_env), include_gitignore=include_gitignore, scratch_dir=scratch)
    out = upload_working_dir_if_needed(out, include_gitignore=include_gitignore, scratch_dir=scratch)
    out.pop("excludes", None)  # applied by the upload
    return out
