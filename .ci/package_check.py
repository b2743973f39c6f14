"""The packaging check: what installing prefect-sgpu from its wheel gives a user.

    ./dev package [--keep DIR]

1. ``python -m build``: the sdist, then the wheel built from that sdist (so a file missing from
   the sdist fails here), and ``twine check --strict`` on both.
2. Their contents: the license and changelog, the IAM policy documents, the entry points
   (the ``prefect-sgpu`` command, Prefect's collection, MLflow's tracking store), no tests.
3. A clean virtual environment with the wheel and no extras (the pins of constraints.txt):
   the package imports and reports pyproject's version, Prefect's collection registry lists
   its blocks and the ``sgpu`` worker type, none of the extras' packages came along, every
   module of the package imports or lacks only a package of an extra (anything else is an
   undeclared dependency), and ``prefect-sgpu --help``, ``--version`` and ``gpus --json`` run.
4. The same environment with ``[aws]``: every module imports, and ``prefect-sgpu gc --help``
   and a dry-run ``gc`` of a local store run.
5. The oldest Python pyproject's ``requires-python`` allows, when this machine has it
   (``python3.10`` on PATH; otherwise the step says it did not run): the wheel with ``[aws]``,
   every module imports, ``--version`` and a TOML environment file read.

Installs go through uv with its cache (``--offline`` first: cached wheels only, no index
round trips; the package index only when something is not cached). Each step prints its
seconds. Exit status 0 when every check passed; the first failure stops the check with
its command's output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SLUGS = {"sgpu-local-compute", "sgpu-ec2-compute", "sgpu-ray-compute", "sgpu-store"}
#: what only an extra brings: a clean install without extras must not have them
EXTRAS_ONLY = ("torch", "ray", "mlflow", "boto3", "botocore", "prefect_aws", "deepspeed", "streaming",
               "transformers", "lightning", "pandas", "pyarrow")
#: what the [aws] extra brings: with it, a module may wait only for another extra's packages
AWS_PACKAGES = ("boto3", "botocore", "prefect_aws")
ENTRY_POINTS = {
    "console_scripts": "prefect-sgpu = prefect_sgpu.cli:main",
    "prefect.collections": "prefect_sgpu = prefect_sgpu",
    "mlflow.tracking_store": "sgpu-relay = prefect_sgpu.observe.mlflow_relay:store_builder",
}

LIST_BLOCKS = """
import json
from prefect.blocks.core import Block
from prefect.plugins import load_prefect_collections
from prefect.utilities.dispatch import get_registry_for_type
from prefect.workers.base import BaseWorker

loaded = load_prefect_collections()
print(json.dumps({
    "collections": sorted(loaded),
    "blocks": sorted(k for k, cls in get_registry_for_type(Block).items() if cls.__module__.startswith("prefect_sgpu")),
    "workers": sorted(k for k, cls in get_registry_for_type(BaseWorker).items()
                      if cls.__module__.startswith("prefect_sgpu")),
}))
"""


#: imports every module of the installed package; prints {module: the missing module or the error}
IMPORT_ALL = """
import importlib, json, pkgutil, prefect_sgpu
failed = {}
for found in pkgutil.walk_packages(prefect_sgpu.__path__, "prefect_sgpu."):
    try:
        importlib.import_module(found.name)
    except ModuleNotFoundError as exc:
        failed[found.name] = exc.name
    except Exception as exc:
        failed[found.name] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"file": prefect_sgpu.__file__, "failed": failed}))
"""


class CheckFailed(Exception):
    pass


class Checker:
    def __init__(self, work: Path, python: str, uv: str) -> None:
        self.work = work
        self.python = python
        self.uv = uv
        # the user's view: no checkout on sys.path, Prefect's home and the job store in the scratch folder
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PREFECT_API_URL", "PREFECT_PROFILES_PATH")}
        self.env.update(PREFECT_HOME=str(work / "prefect-home"), PREFECT_SGPU_HOME=str(work / "sgpu-home"),
                        PREFECT_SERVER_ANALYTICS_ENABLED="false")

    def run(self, *argv: str | Path, cwd: Path | None = None) -> str:
        done = subprocess.run([str(a) for a in argv], check=False, cwd=cwd or self.work, env=self.env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise CheckFailed(f"{' '.join(map(str, argv))} exited {done.returncode}:\n{done.stdout[-6000:]}")
        return done.stdout

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        print(f"-- {name}", flush=True)
        start = time.monotonic()
        yield
        print(f"   ok ({time.monotonic() - start:.1f} s)", flush=True)

    def install(self, venv: Path, *requirements: str) -> None:
        """uv from its cache alone first; the index only when something is not cached."""
        base = [self.uv, "pip", "install", "-q", "--python", venv / "bin" / "python",
                "-c", ROOT / "constraints.txt", *requirements]
        try:
            self.run(*base[:3], "--offline", *base[3:])
        except CheckFailed as offline:
            print("   (not all of it is in uv's cache: asking the package index)", flush=True)
            try:
                self.run(*base)
            except CheckFailed as online:
                raise CheckFailed(f"{online}\n(offline try: {offline})") from None


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def build(checker: Checker, dist: Path) -> tuple[Path, Path]:
    with checker.step("python -m build (sdist, then the wheel from it)"):
        checker.run(checker.python, "-m", "build", "--installer", "uv", "--outdir", dist, ROOT)
        wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
        _check(len(wheels) == 1 and len(sdists) == 1, f"one wheel and one sdist expected in {dist}: "
                                                      f"{[p.name for p in dist.iterdir()]}")
    with checker.step("twine check --strict"):
        checker.run(checker.python, "-m", "twine", "check", "--strict", wheels[0], sdists[0])
    return wheels[0], sdists[0]


def check_contents(checker: Checker, wheel: Path, sdist: Path, version: str) -> None:
    with checker.step("the wheel's and the sdist's contents"):
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
            info = f"prefect_sgpu-{version}.dist-info"
            entry_points = zf.read(f"{info}/entry_points.txt").decode()
            metadata = zf.read(f"{info}/METADATA").decode()
        for wanted in (f"{info}/licenses/LICENSE", "prefect_sgpu/policies/node-policy.json",
                       "prefect_sgpu/policies/driver-policy.json", "prefect_sgpu/cli.py"):
            _check(wanted in names, f"{wheel.name} lacks {wanted}")
        strays = sorted({n.split("/")[0] for n in names} - {"prefect_sgpu", info})
        _check(not strays, f"{wheel.name} holds more than the package: {strays}")
        for group, line in ENTRY_POINTS.items():
            _check(f"[{group}]" in entry_points and line in entry_points,
                   f"{wheel.name}: entry point [{group}] {line} missing:\n{entry_points}")
        _check("License-Expression: Apache-2.0" in metadata, f"{wheel.name}: no SPDX license in METADATA")
        with tarfile.open(sdist) as tf:
            top = f"prefect_sgpu-{version}"
            members = set(tf.getnames())
        for wanted in ("LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "prefect_sgpu/__init__.py"):
            _check(f"{top}/{wanted}" in members, f"{sdist.name} lacks {wanted}")


def check_core(checker: Checker, wheel: Path, version: str) -> Path:
    venv = checker.work / "venv"
    with checker.step("a clean venv with the wheel, no extras"):
        checker.run(checker.uv, "venv", "-q", "--python", sys.executable, venv)
        checker.install(venv, str(wheel))
    python, command = venv / "bin" / "python", venv / "bin" / "prefect-sgpu"
    with checker.step("it imports, reports its version and lists its blocks"):
        found = checker.run(python, "-c", "import prefect_sgpu; print(prefect_sgpu.__version__)").strip()
        _check(found == version, f"prefect_sgpu.__version__ is {found!r}, pyproject says {version!r}")
        absent = json.loads(checker.run(python, "-c", "import importlib.util, json, sys; print(json.dumps("
                                        "[n for n in sys.argv[1:] if importlib.util.find_spec(n)]))",
                                        *EXTRAS_ONLY))
        _check(not absent, f"a clean install without extras brought {absent}: each belongs to an extra")
        listed = json.loads(checker.run(python, "-c", LIST_BLOCKS).strip().splitlines()[-1])
        _check("prefect_sgpu" in listed["collections"], f"Prefect did not load the collection: {listed}")
        _check(set(listed["blocks"]) == BLOCK_SLUGS, f"blocks {listed['blocks']}, expected {sorted(BLOCK_SLUGS)}")
        _check(listed["workers"] == ["sgpu"], f"worker types {listed['workers']}, expected ['sgpu']")
        print(f"   blocks: {', '.join(listed['blocks'])}; worker type: sgpu")
    with checker.step("every module imports, or lacks only an extra's package"):
        imported = import_all(checker, python, venv)
        undeclared = {m: why for m, why in imported.items() if why not in EXTRAS_ONLY}
        _check(not undeclared, f"modules that fail to import without extras: {undeclared} (a package the "
                               "core install lacks belongs in pyproject's dependencies)")
        print(f"   {len(imported)} module(s) wait for an extra: {', '.join(sorted(imported)) or 'none'}")
    with checker.step("prefect-sgpu --help, --version, gpus --json"):
        helped = checker.run(command, "--help")
        _check("gpus" in helped and "gc" in helped, f"prefect-sgpu --help names no commands:\n{helped}")
        said = checker.run(command, "--version").strip()
        _check(said == f"prefect-sgpu {version}", f"prefect-sgpu --version said {said!r}")
        catalog = json.loads(checker.run(command, "gpus", "--json"))
        _check(any(g["name"] == "H100" for g in catalog["gpu_types"]), "prefect-sgpu gpus lists no H100")
        check_toml_options(checker, python)
    return venv


READ_TOML_OPTIONS = """
import sys
from prefect_sgpu.environment import parse_option
options = parse_option(sys.argv[1])
assert options.mode == "driver" and options.max_bytes == 12345, options
"""


def check_toml_options(checker: Checker, python: Path) -> None:
    options = checker.work / "environment.toml"
    options.write_text('mode = "driver"\nmax_bytes = 12345\n')
    checker.run(python, "-c", READ_TOML_OPTIONS, options)


def import_all(checker: Checker, python: Path, venv: Path) -> dict[str, str]:
    """Each module of the installed package that fails to import, and why."""
    result = json.loads(checker.run(python, "-c", IMPORT_ALL).strip().splitlines()[-1])
    _check(Path(result["file"]).is_relative_to(venv), f"prefect_sgpu came from {result['file']}, not the venv")
    return result["failed"]


def aws_install_failures(failed: dict[str, str]) -> dict[str, str]:
    """Import failures an install with [aws] must not have: a module may wait only for another
    extra's packages (the trainers' integrations for transformers or lightning)."""
    return {m: why for m, why in failed.items() if why not in EXTRAS_ONLY or why in AWS_PACKAGES}


def check_aws(checker: Checker, venv: Path, wheel: Path) -> None:
    python, command = venv / "bin" / "python", venv / "bin" / "prefect-sgpu"
    with checker.step("the same venv with [aws]"):
        checker.install(venv, f"prefect-sgpu[aws] @ {wheel.as_uri()}")
    with checker.step("every module imports; prefect-sgpu gc --help and a dry-run gc"):
        failed = aws_install_failures(import_all(checker, python, venv))
        _check(not failed, f"modules that fail to import with [aws]: {failed}")
        helped = checker.run(command, "gc", "--help")
        _check("--dry-run" in helped, f"prefect-sgpu gc --help:\n{helped}")
        store = checker.work / "jobs"
        store.mkdir()
        swept = checker.run(command, "gc", "--dry-run", "--no-mlflow", "--store", store)
        _check(f"store {store}" in swept and "dry run" in swept, f"prefect-sgpu gc --dry-run said:\n{swept}")


def find_python(minor: str) -> str | None:
    """An interpreter of Python ``minor`` (e.g. "3.10") that runs: on PATH, else a pyenv install
    (whose shim on PATH fails unless that version is selected)."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [shutil.which(f"python{minor}"), *sorted(map(str, pyenv.glob(f"{minor}.*/bin/python{minor}")))]
    for candidate in filter(None, candidates):
        done = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              check=False, capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip() == minor:
            return candidate
    return None


def check_oldest_python(checker: Checker, wheel: Path, version: str, requires_python: str) -> None:
    floor = requires_python.strip().removeprefix(">=").strip()
    if ".".join(map(str, sys.version_info[:2])) == floor:
        print(f"-- the oldest supported Python ({floor}) is the one checked above")
        return
    found = find_python(floor)
    if found is None:
        print(f"-- NOT RUN: the oldest supported Python, {floor}, is not on this machine "
              f"(python{floor} on PATH or under $PYENV_ROOT/versions)")
        return
    venv = checker.work / f"venv-{floor}"
    with checker.step(f"a clean venv on Python {floor} (requires-python {requires_python}) with [aws]"):
        checker.run(checker.uv, "venv", "-q", "--python", found, venv)
        checker.install(venv, f"prefect-sgpu[aws] @ {wheel.as_uri()}")
    python = venv / "bin" / "python"
    with checker.step(f"Python {floor}: every module imports, --version, a TOML environment file"):
        failed = aws_install_failures(import_all(checker, python, venv))
        _check(not failed, f"modules that fail to import on Python {floor}: {failed}")
        said = checker.run(venv / "bin" / "prefect-sgpu", "--version").strip()
        _check(said == f"prefect-sgpu {version}", f"prefect-sgpu --version said {said!r} on Python {floor}")
        check_toml_options(checker, python)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev package", description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="keep the built wheel, sdist and venv in this folder")
    args = parser.parse_args(argv)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    version = project["version"]
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv is None:
        print("package check: uv is not installed (pip install uv)", file=sys.stderr)
        return 2
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="sgpu-package-", dir=args.keep))
    checker = Checker(work, sys.executable, uv)
    started = time.monotonic()
    try:
        wheel, sdist = build(checker, work / "dist")
        check_contents(checker, wheel, sdist, version)
        venv = check_core(checker, wheel, version)
        check_aws(checker, venv, wheel)
        check_oldest_python(checker, wheel, version, project["requires-python"])
    except CheckFailed as exc:
        print(f"package check FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"package check passed in {time.monotonic() - started:.1f} s (prefect-sgpu {version}"
          + (f", kept in {work})" if args.keep else ")"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
