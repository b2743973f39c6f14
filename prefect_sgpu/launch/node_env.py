"""The node's first stage: build (or reuse) the driver's environment, then start the bootstrap in it.

This file runs on a bare image *before* anything but the image's own Python exists: it imports
the standard library only, and the EC2 user-data carries it (compressed) rather than expecting
it installed. It is the node half of :mod:`prefect_sgpu.environment.ship`:

1. read the environment's manifest from the store (``<store>/.environments/<digest>/manifest-<sha256>.json``)
   and check it against the sha256 the user-data names (the user-data is the launcher's own:
   a store writer cannot change which environment a node builds);
2. if ``<root>/<digest>-<platform>/.complete`` exists, reuse that venv: nothing is installed;
3. otherwise, under a lock: ``uv venv`` with the driver's Python minor version, ``uv pip install
   --no-deps`` of the driver's pinned distributions (``--require-hashes`` for those the manifest records
   sha256s of; then the extra requirements, constrained by those pins) from the manifest's index
   settings (the image's uv settings, ``UV_OFFLINE`` and
   ``UV_CACHE_DIR`` included, apply); every shipped file (local packages, this project, the
   user's ``working_dir`` and ``py_modules``) fetched by sha256, checked, and laid out; then the
   marker. When the manifest's index settings carry credentials (it shows them masked), the real
   URLs come from the job's secrets (``/prefect-sgpu/<store scope>/<run id>/secrets``) and reach uv only through its environment (``UV_INDEX_URL``,
   ``UV_EXTRA_INDEX_URL``, ``UV_FIND_LINKS``), never a command line; every line this stage
   prints or uploads has them masked;
4. ``exec`` the bootstrap with the venv's Python.

The store, the secrets and the node's own identity are reached through a :class:`Transport`, chosen
by the store URL's scheme (:data:`STAGE_TRANSPORTS`) or by ``--transport``: for ``s3://`` stores it is
:mod:`prefect_sgpu.launch.ec2_stage` (S3, SSM and IMDSv2 from the standard library), which the
user-data carries beside this file. What the stage needs only sometimes, the uv it brings when the
image has none (:mod:`prefect_sgpu.launch.stage_uv`) and the pack code
(:mod:`prefect_sgpu.launch.node_pack`), it loads from the environment's own shipped prefect-sgpu
files, each checked against the manifest's sha256 (:func:`shipped_module`): the user-data has room
for little more than this file and its transport.
This module knows no cloud. A failing step prints its output (the console) and writes it to
``<store>/<run id>/setup/<instance id>.log``, where the driver shows it, then exits non-zero: the
user-data's trap powers the instance off.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import types
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Protocol

#: an image's own package index for uv's wheel (:data:`prefect_sgpu.launch.stage_uv.UV_INDEX_ENV`)
UV_INDEX_ENV = "PREFECT_SGPU_UV_INDEX"

FORMAT = 1
ENV_ROOT_ENV = "PREFECT_SGPU_ENV_ROOT"
DEFAULT_ROOTS = ("/var/lib/prefect-sgpu/envs", "~/.cache/prefect-sgpu/envs")
COMPLETE = ".complete"
SHA = re.compile(r"^[0-9a-f]{64}$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class SetupError(Exception):
    """A step of the environment build failed: ``step`` and the output that says why."""

    def __init__(self, step: str, output: str = "") -> None:
        output = mask(output)
        super().__init__(f"environment setup failed at {step}" + (f":\n{output.strip()}" if output.strip() else ""))
        self.step = step


#: (secret text, what shows instead) of the index credentials this stage holds: masked in all it prints or uploads
_MASKS: list[tuple[str, str]] = []
#: the name of the revealed index settings in a job's secrets SecureString (environment_ship.INDEX_SECRET)
INDEX_SECRET = "PREFECT_SGPU_INDEX_URLS"


def masked_url(url: str) -> str:
    """``url`` with its user info and query replaced by ``***`` (as the driver shows it; stage_uv's twin:
    neither file can import the other on a node)."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    netloc = f"***@{netloc}" if "@" in parts.netloc else netloc
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "***" if parts.query else "", ""))


def hide(url: str) -> None:
    """Mask ``url``, and each credential in it, in everything this stage prints or uploads from now on."""
    parts = urllib.parse.urlsplit(url)
    found = [(url, masked_url(url))]
    if "@" in parts.netloc:
        userinfo = parts.netloc.rsplit("@", 1)[0]
        secret = userinfo.partition(":")[2] or userinfo  # the password, or a token given as the user
        found += [(userinfo, "***"), (secret, "***"), (urllib.parse.unquote(secret), "***")]
    if parts.query:
        found.append((parts.query, "***"))
        found += [(value, "***") for _name, value in urllib.parse.parse_qsl(parts.query)]
    for text, shown in found:
        if len(text) >= 4 and (text, shown) not in _MASKS:
            _MASKS.append((text, shown))
    _MASKS.sort(key=lambda m: -len(m[0]))  # the whole URL before its parts


def mask(text: str) -> str:
    for secret, shown in _MASKS:
        text = text.replace(secret, shown)
    return text


def log(message: str) -> None:
    print(mask(f"[prefect-sgpu env] {message}"), flush=True)


# --- the transport to the store -----------------------------------------------------------------

#: the stage transport of each store scheme: a module's name, imported from this stage's own folder (the
#: user-data carries it beside this file) or, when this stage runs from its package, from the package
STAGE_TRANSPORTS = {"s3": "ec2_stage"}
#: when this stage finished (wall clock), for the bootstrap it starts: the node's "environment ready"
READY_AT_ENV = "SGPU_ENVIRONMENT_READY_AT"


class Transport(Protocol):
    """What the stage asks of the cloud it runs on, whatever the cloud: the module a transport lives in
    names its class ``TRANSPORT``, built by ``TRANSPORT.from_args(store_uri, argv)`` from the stage's
    arguments this module does not know. Keys are relative to the store's root. Each method raises
    when it fails (the stage then ends, saying why)."""

    root_uri: str

    def uri(self, key: str) -> str: ...

    def get(self, key: str) -> bytes: ...

    def get_range(self, key: str, start: int, end: int) -> bytes: ...

    def put(self, key: str, body: bytes, content_type: str = ...) -> None: ...

    def start_upload(self, key: str) -> str: ...

    def put_part(self, key: str, upload: str, number: int, data: bytes) -> str: ...

    def finish_upload(self, key: str, upload: str, parts: list[str]) -> None: ...

    def read_secret(self, name: str) -> str: ...

    def instance_id(self) -> str: ...

    def launch_index(self) -> int: ...


def load_transport(name: str, store_uri: str, argv: list[str]) -> Transport:
    """The transport of module ``name`` (a plain name: beside this stage), over ``store_uri``."""
    import importlib

    module = importlib.import_module(f"{__package__}.{name}" if __package__ and "." not in name else name)
    return module.TRANSPORT.from_args(store_uri, argv)


def read(transport: Transport, key: str) -> bytes:
    try:
        return transport.get(key)
    except Exception as exc:  # noqa: BLE001 - the stage ends, saying what it could not read
        raise SetupError(f"reading {transport.uri(key)}", f"{exc}") from None


# --- the manifest -------------------------------------------------------------------------------


def safe_relative(path: str) -> str:
    """A path from the manifest, refused unless relative and plain (no empty, ``.`` or ``..`` part)."""
    parts = path.split("/")
    if not path or path.startswith("/") or "\\" in path or any(p in ("", ".", "..") for p in parts):
        raise SetupError("checking the manifest", f"file path {path!r} is not allowed: a relative path "
                         "without empty, '.' or '..' parts")
    return path


def check_manifest(data: bytes, sha256: str) -> dict:
    found = hashlib.sha256(data).hexdigest()
    if found != sha256:
        raise SetupError("checking the manifest", f"its sha256 is {found}, the user-data names {sha256}")
    manifest = json.loads(data)
    if manifest.get("format") != FORMAT or not SHA.match(str(manifest.get("digest", ""))):
        raise SetupError("checking the manifest", f"format {manifest.get('format')!r}: this stage reads {FORMAT}")
    for tree in manifest["trees"]:
        if not NAME.match(tree["name"]) or tree["kind"] not in ("site", "path"):
            raise SetupError("checking the manifest", f"tree {tree['name']!r} of kind {tree['kind']!r}")
        safe_relative(tree["root"]) if tree.get("root") else None
        if tree.get("dist") and not (NAME.match(tree["dist"][0]) and NAME.match(tree["dist"][1])):
            raise SetupError("checking the manifest", f"distribution {tree['dist'][:2]!r}")
        for path, _size, sha in tree["files"]:
            safe_relative(path)
            if not SHA.match(sha):
                raise SetupError("checking the manifest", f"{path}: sha256 {sha!r}")
    return manifest


# --- building -----------------------------------------------------------------------------------


def run(step: str, argv: list[str], env: dict[str, str] | None = None) -> None:
    """``argv`` with ``env`` added to this process's environment (index credentials travel only there,
    never in a command line); its output printed masked."""
    log(f"{step}: {' '.join(argv[:6])}{' ...' if len(argv) > 6 else ''}")
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, **env} if env else None)
    if done.stdout.strip():
        print(mask(done.stdout.rstrip()), flush=True)
    if done.returncode != 0:
        raise SetupError(step, "\n".join(done.stdout.strip().splitlines()[-30:]))


#: the folder of a fast local disk (an instance store) the node uses as it is; empty: none is looked for
DISK_ENV = "PREFECT_SGPU_FAST_DISK"
#: what moves to a fast disk, each only where the image set nothing: the environments' root, uv's cache, and
#: the temp folder of the stage, uv and (inherited by the bootstrap) every job's scratch
ON_DISK = {ENV_ROOT_ENV: "envs", "UV_CACHE_DIR": "uv-cache", "TMPDIR": "tmp"}


def use_disk(mount_points, table="/proc/self/mounts"):
    """Build, cache and scratch on the node's fast disk: :data:`DISK_ENV`'s folder, else the first of
    ``mount_points`` (the transport's ``DISK_MOUNTS``) the mount table ``table`` lists (a plain folder of the
    root volume is never one). What :data:`ON_DISK` names and the image left unset goes under
    ``<disk>/prefect-sgpu``, in the environment the bootstrap inherits. Terse: it travels in the user-data."""
    disk = os.environ.get(DISK_ENV)
    if disk is None:
        table = Path(table).read_text() if os.path.exists(table) else ""
        disk = next((p for p in mount_points if f" {p} " in table), "")
    if disk and os.access(disk, os.W_OK):
        for name, sub in ON_DISK.items():
            os.makedirs(os.environ.setdefault(name, os.path.join(disk, "prefect-sgpu", sub)), exist_ok=True)


def env_root() -> Path:
    given = os.environ.get(ENV_ROOT_ENV)
    candidates = [given] if given else list(DEFAULT_ROOTS)
    for candidate in candidates:
        root = Path(os.path.expanduser(candidate))
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(root, os.W_OK):
            return root
    raise SetupError("choosing the environment folder", f"none of {candidates} is writable (set {ENV_ROOT_ENV})")


def fetch_file(store: Transport, files_key: str, cache: Path, sha: str) -> Path:
    """One shipped file, from this node's cache by sha256 or from the store, checked either way."""
    path = cache / sha
    if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == sha:
        return path
    data = read(store, f"{files_key}/{sha}")
    if hashlib.sha256(data).hexdigest() != sha:
        raise SetupError("fetching shipped files", f"{files_key}/{sha} does not match its sha256")
    tmp = cache / f".{sha}.{os.getpid()}"
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def lay_out(base: Path, files: list, blobs: dict[str, Path]) -> None:
    base = base.resolve()
    for path, _size, sha in files:
        target = (base / safe_relative(path)).resolve()
        if base not in target.parents:
            raise SetupError("laying out shipped files", f"{path!r} leaves {base}")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(blobs[sha], target)


def site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def uv(index: dict | None = None, shipped: "Callable[[str], Any] | None" = None) -> str:
    """The image's ``uv``, else the pinned one this stage fetches (:func:`prefect_sgpu.launch.stage_uv.uv`:
    from this stage's package, or ``shipped(UV_MODULE)``, the environment's own copy)."""
    found = shutil.which("uv")
    if found:
        return found
    if __package__:
        from prefect_sgpu.launch import stage_uv
    else:
        stage_uv = shipped(UV_MODULE) if shipped is not None else None
        if stage_uv is None:
            raise SetupError("fetching uv", f"the image has no `uv` on PATH and the environment ships no "
                             f"{UV_MODULE}: install uv in the image")
    try:
        return stage_uv.uv(index, env_root(), log)
    except stage_uv.UvMissing as exc:
        raise SetupError("fetching uv", str(exc)) from None


def index_args(index: dict) -> list[str]:
    args = []
    if index.get("index_url"):
        args += ["--index-url", index["index_url"]]
    for url in index.get("extra_index_urls") or ():
        args += ["--extra-index-url", url]
    for url in index.get("find_links") or ():
        args += ["--find-links", url]
    return args


def index_env(index: dict) -> dict[str, str]:
    """The revealed index settings as uv's environment variables: what a process list never shows."""
    env = {}
    if index.get("index_url"):
        env["UV_INDEX_URL"] = index["index_url"]
    if index.get("extra_index_urls"):
        env["UV_EXTRA_INDEX_URL"] = " ".join(index["extra_index_urls"])
    if index.get("find_links"):
        env["UV_FIND_LINKS"] = ",".join(index["find_links"])
    return env


def revealed_index(manifest: dict, read_secret) -> dict | None:
    """The manifest's index settings with their credentials, from the job's SecureString (``read_secret``),
    when the manifest says they have some; None when the manifest's own (credential-free) settings do."""
    if not manifest["index"].get("credentials"):
        return None
    try:
        values = json.loads(read_secret())
        index = json.loads(values[INDEX_SECRET])
    except (KeyError, TypeError, ValueError) as exc:
        raise SetupError("reading the index credentials", f"the job's secrets hold no index settings "
                         f"({type(exc).__name__})") from None
    for url in [index.get("index_url") or "", *index.get("extra_index_urls", ()), *index.get("find_links", ())]:
        if url:
            hide(url)
    return index


def packages_digest(manifest: dict) -> str:
    """What a venv holds before the shipped files are laid out in it: the Python, the pins, the extra
    requirements and the index settings (as the manifest shows them). Packs are keyed by it, so a pack
    serves every environment of the same packages, whatever the project's files."""
    keys = ("format", "implementation", "python", "pins", "requirements", "index")
    if manifest.get("hashes"):  # only when recorded: the digest of packages without them stays as it was
        keys += ("hashes",)
    return hashlib.sha256(json.dumps({k: manifest.get(k) for k in keys}, sort_keys=True,
                                     separators=(",", ":")).encode()).hexdigest()


def install(venv: Path, manifest: dict, index: dict | None = None,
            shipped: "Callable[[str], Any] | None" = None) -> None:
    """The venv with the driver's Python and packages, nothing shipped yet. ``index``: the revealed index
    settings (credentials only in uv's environment), else the manifest's.

    The venv is relocatable (uv's entry points find their Python beside them, the ``.pth`` of shipped
    trees names them relative to site-packages), and a Python uv downloads lands under the
    environments' root (``python/``, unless the image sets ``UV_PYTHON_INSTALL_DIR``): a pack of both
    works under another root."""
    tool = uv(manifest["index"] if index is None else index, shipped)
    if venv.exists():  # an earlier build that did not finish
        shutil.rmtree(venv)
    pythons = {} if os.environ.get("UV_PYTHON_INSTALL_DIR") else {"UV_PYTHON_INSTALL_DIR": str(venv.parent / "python")}
    run("creating the venv", [tool, "venv", "-q", "--relocatable", "--python", manifest["python"], str(venv)], pythons)
    python = venv / "bin" / "python"
    work = venv / "sgpu"
    work.mkdir()
    pins = work / "pins.txt"
    pins.write_text("\n".join(manifest["pins"]) + "\n")
    hashes = manifest.get("hashes") or {}
    hashed = [pin for pin in manifest["pins"] if pin in hashes]
    by_version = [pin for pin in manifest["pins"] if pin not in hashes]
    args, env = (index_args(manifest["index"]), None) if index is None else ([], index_env(index))
    common = [tool, "pip", "install", "-q", "--python", str(python), *args]
    if hashed:  # first (by sha256): a pin the extra requirements installed would not be checked again
        if __package__:
            from prefect_sgpu.launch import stage_uv
        else:
            stage_uv = shipped(UV_MODULE)
        stage_uv.install_hashed(common, work, hashed, hashes, env, run, SetupError)
    if manifest["requirements"]:  # resolved against the pins, a bad one fails before the big install
        extra = work / "requirements.txt"
        extra.write_text("\n".join(manifest["requirements"]) + "\n")
        run("installing the extra requirements", [*common, "-c", str(pins), "-r", str(extra)], env)
    if by_version:  # exactly the driver's set: nothing to resolve
        rest = work / ("pins-by-version.txt" if hashed else "pins.txt")
        rest.write_text("\n".join(by_version) + "\n")
        run("installing the driver's pinned distributions", [*common, "--no-deps", "-r", str(rest)], env)


def lay_out_trees(venv: Path, manifest: dict, store: Transport, files_key: str, cache: Path) -> None:
    """Every shipped file (fetched by sha256, checked) in the venv, then the marker."""
    shas = sorted({sha for tree in manifest["trees"] for _p, _s, sha in tree["files"]})
    log(f"fetching {len(shas)} shipped file(s)")
    with ThreadPoolExecutor(8) as pool:
        blobs = dict(zip(shas, pool.map(lambda sha: fetch_file(store, files_key, cache, sha), shas)))
    site = site_packages(venv / "bin" / "python")
    roots = []
    for tree in manifest["trees"]:
        if tree["kind"] == "site":  # an installed distribution's own files: where its RECORD put them
            lay_out(site, tree["files"], blobs)
            continue
        base = venv / "sgpu" / "paths" / tree["name"]
        lay_out(base, tree["files"], blobs)
        roots.append(base / tree["root"] if tree.get("root") else base)
        if tree.get("dist"):
            name, version, entry_points = (list(tree["dist"]) + [""])[:3]
            info = site / f"{name.replace('-', '_')}-{version}.dist-info"
            info.mkdir(exist_ok=True)
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
            if entry_points:  # plugins (MLflow's tracking stores, ...) are found by their entry points
                (info / "entry_points.txt").write_text(entry_points)
            (info / "INSTALLER").write_text("prefect-sgpu\n")
    # relative to site-packages (site.py joins them to it): the venv stays relocatable
    (site / "prefect_sgpu_environment.pth").write_text("".join(f"{os.path.relpath(r, site)}\n" for r in roots))
    (venv / COMPLETE).write_text(manifest["digest"] + "\n")


def build(venv: Path, manifest: dict, store: Transport, files_key: str, cache: Path, index: dict | None = None) -> None:
    install(venv, manifest, index, lambda path: shipped_module(manifest, store, files_key, cache, path))
    lay_out_trees(venv, manifest, store, files_key, cache)


def platform_key() -> str:
    """What a built venv is bound to besides its digest: the OS and the machine."""
    return f"{sys.platform}-{platform.machine()}"


#: where this project's own code lies in its shipped tree: what the stage loads from there
PACK_MODULE = "prefect_sgpu/launch/node_pack.py"
UV_MODULE = "prefect_sgpu/launch/stage_uv.py"


def shipped_module(manifest: dict, store: Transport, files_key: str, cache: Path, path: str):
    """The module at ``path`` of this environment's own prefect-sgpu files (checked against the manifest's
    sha256, like every shipped file); None when the manifest has none."""
    for tree in manifest["trees"]:
        if tree["name"] != "prefect-sgpu":
            continue
        want = "/".join(p for p in (tree.get("root") or "", path) if p) if tree["kind"] == "path" else path
        for name, _size, sha in tree["files"]:
            if name == want:
                module = types.ModuleType("prefect_sgpu_" + path.rsplit("/", 1)[-1][:-3])
                code = fetch_file(store, files_key, cache, sha).read_bytes()
                exec(compile(code, path, "exec"), module.__dict__)  # noqa: S102 - checked by sha256
                return module
    return None


def pack_module(manifest: dict, store: Transport, files_key: str, cache: Path):
    """:mod:`prefect_sgpu.launch.node_pack`, from this environment's own prefect-sgpu files."""
    return shipped_module(manifest, store, files_key, cache, PACK_MODULE)


def ensure(manifest: dict, store: Transport, files_key: str, read_secret=None, packs: dict | None = None,
           offer_to=None, packs_key: str | None = None) -> tuple[Path, str]:
    """The venv of this manifest's digest on this node: (its folder, ``"reused"``, ``"unpacked"`` from
    the store's pack or ``"built"``). ``read_secret``: the job's secrets SecureString, read only when
    there is something to build. ``packs``: platform → (sha256, size) of the packs of this
    environment's packages the driver recorded, in the store under ``packs_key``
    (:mod:`prefect_sgpu.launch.node_pack`). ``offer_to(venv, node_pack)``: called once the packages
    are installed, before the shipped files are laid out, to offer a pack of them."""
    root = env_root()
    key = f"{manifest['digest']}-{platform_key()}"
    venv = root / key
    if (venv / COMPLETE).exists():
        return venv, "reused"
    cache = root / "files"
    cache.mkdir(exist_ok=True)
    with open(root / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second boot beside this one waits, then reuses
        if (venv / COMPLETE).exists():
            return venv, "reused"
        named = (packs or {}).get(platform_key())
        packing = None
        if named is not None or offer_to is not None:
            try:
                packing = pack_module(manifest, store, files_key, cache)
            except Exception as exc:  # noqa: BLE001 - a pack only saves time: build
                log(f"the pack code could not be loaded ({type(exc).__name__}: {exc})")
        if named is not None and packing is not None and packs_key:
            if venv.exists():
                shutil.rmtree(venv)
            try:
                packing.from_pack(store, packs_key, named[0], named[1], root, venv, manifest["python"])
                lay_out_trees(venv, manifest, store, files_key, cache)
                return venv, "unpacked"
            except Exception as exc:  # noqa: BLE001 - whatever is wrong with a pack, the node builds
                log(f"the store's pack {named[0][:16]} of these packages was not used "
                    f"({type(exc).__name__}: {exc}): building")
        index = revealed_index(manifest, read_secret) if read_secret is not None else None
        install(venv, manifest, index, lambda path: shipped_module(manifest, store, files_key, cache, path))
        if offer_to is not None and packing is not None:
            try:
                offer_to(venv, packing)
            except Exception as exc:  # noqa: BLE001 - a pack only saves later boots time
                log(f"the packages were not packed into the store: {type(exc).__name__}: {exc}")
        lay_out_trees(venv, manifest, store, files_key, cache)
    return venv, "built"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(this stage's arguments, the transport's, the bootstrap's: those after ``--``)."""
    split = argv.index("--") if "--" in argv else len(argv)
    own, rest = argv[:split], argv[split + 1:]
    p = argparse.ArgumentParser(prog="prefect-sgpu-node-env")
    p.add_argument("--store", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--environment", required=True, help="the environment's digest")
    p.add_argument("--manifest", required=True, help="sha256 of the environment's manifest")
    p.add_argument("--transport", default=None, help="the transport's module (default: by the store's scheme)")
    p.add_argument("--pack", action="append", default=[],
                   help="<platform>:<sha256>:<size> of a pack of this environment the driver recorded")
    p.add_argument("--offer-pack", action="store_true", help="node 0: pack what it builds into the store")
    args, transport_args = p.parse_known_args(own)
    return args, transport_args, rest


def secret(transport: Transport, name: str) -> str:
    try:
        return transport.read_secret(name)
    except Exception as exc:  # noqa: BLE001 - the stage ends, saying which secret it could not read
        raise SetupError(f"reading the secret {name}", f"{exc}") from None


def parse_packs(values: list[str]) -> dict[str, tuple[str, int]]:
    packs = {}
    for value in values:
        plat, sha, size = (value.rsplit(":", 2) + ["", ""])[:3]
        if not (NAME.match(plat) and SHA.match(sha) and size.isdigit()):
            raise SystemExit(f"--pack={value!r} is not allowed: <platform>:<sha256>:<size>")
        packs[plat] = (sha, int(size))
    return packs


def offers_pack(asked: bool, bootstrap: list[str], transport: Transport) -> bool:
    """Whether this node packs what it builds: node 0 of a gang's launch, when the driver asks. A machine
    launched alone to replace a lost node (``--node-index``, node 0's too) never does: the driver records
    only the offers of a gang's launch, so its pack would be uploaded and never used."""
    if not asked or any(arg.startswith("--node-index=") for arg in bootstrap):
        return False
    return transport.launch_index() == 0


def main(argv: list[str] | None = None) -> int:
    args, transport_args, bootstrap = parse_args(list(sys.argv[1:] if argv is None else argv))
    for name in ("environment", "manifest"):
        if not SHA.match(getattr(args, name)):
            raise SystemExit(f"--{name}={getattr(args, name)!r} is not allowed: a sha256 (64 hex digits)")
    module = args.transport or STAGE_TRANSPORTS.get(args.store.partition("://")[0])
    if module is None:
        raise SystemExit(f"--store={args.store!r}: no stage transport for its scheme (say --transport)")
    base = f".environments/{args.environment}"
    store = None
    started = time.monotonic()
    try:
        store = load_transport(module, args.store, transport_args)
        use_disk(getattr(store, "DISK_MOUNTS", ()))  # before anything is built, cached or unpacked
        manifest = check_manifest(read(store, f"{base}/manifest-{args.manifest}.json"), args.manifest)
        if manifest["digest"] != args.environment:
            raise SetupError("checking the manifest", f"it describes {manifest['digest']}, the user-data names "
                             f"{args.environment}")
        # jobfolder.ssm_secrets_parameter: under the store's scope (store.store_scope of its root URI)
        scope = hashlib.sha256(store.root_uri.rstrip("/").encode()).hexdigest()[:16]
        secrets = f"/prefect-sgpu/{scope}/{args.run_id}/secrets"
        # packs of the environment's packages, whatever its files (environment_ship.packages_folder)
        packs_key = f".environments/packages-{packages_digest(manifest)}"
        offer_to = None
        if offers_pack(args.offer_pack, bootstrap, store):
            instance = store.instance_id()
            key_parameter = f"/prefect-sgpu/{scope}/{args.run_id}/payload-key"
            offer_key = f"{args.run_id}/setup/pack-{instance}.json"
            offer_to = lambda venv, packing: packing.offer(  # noqa: E731
                store, packs_key, offer_key, venv, manifest, packages_digest(manifest), platform_key(),
                lambda: secret(store, key_parameter).strip(), args.run_id, instance)
        venv, how = ensure(manifest, store, f"{base}/files", lambda: secret(store, secrets),
                           parse_packs(args.pack), offer_to, packs_key)
    except Exception as exc:  # noqa: BLE001 - every failure ends this node, with its reason where the driver reads
        text = str(exc) if isinstance(exc, SetupError) else f"environment setup failed: {type(exc).__name__}: {exc}"
        text = mask(text)
        log(text)
        if store is not None:
            key = f"{args.run_id}/setup/{store.instance_id()}.log"
            try:
                store.put(key, text.encode()[-8000:])
            except Exception as put_exc:  # noqa: BLE001 - the console still has it
                log(f"could not write {key}: {put_exc}")
        return 3
    log(f"{how} environment {manifest['digest'][:16]} at {venv} "
        f"in {time.monotonic() - started:.1f}s")
    python = str(venv / "bin" / "python")
    os.environ.pop(UV_INDEX_ENV, None)  # the stage's own (it may hold a mirror's token): not the ranks'
    os.environ[READY_AT_ENV] = f"{time.time():.3f}"
    os.environ.update(getattr(store, "exec_env", dict)())  # the transport's own, for the bootstrap (its requests)
    os.execv(python, [python, *bootstrap])


if __name__ == "__main__":
    sys.exit(main())
