"""The driver half of building a captured :class:`~prefect_sgpu.environment.Environment` on bare nodes.

:func:`manifest` turns an environment into what a node's first stage
(:mod:`prefect_sgpu.launch.node_env`) needs: the Python minor version, the pinned index
distributions, the extra requirements, the index settings, and every file that travels
(local and editable packages, this project itself, ``working_dir``, ``py_modules``) by path
and sha256. :func:`ship` puts the files in the store content-addressed, in a folder of the
environment's own digest (``<store>/.environments/<digest>/files/<sha256>``, skipped when
there; one folder per environment, so a job's role may read its own environment and no other)
and the manifest last (``.environments/<digest>/manifest-<sha256 of the manifest>.json``); the
user-data names that sha256, so the node checks the manifest against what the launcher wrote
and every file against the manifest. :func:`stage_lines` renders the user-data lines that run the stage.

The first node to install an environment's packages cold packs them into the store
(``.environments/packages-<packages digest>/<sha256>.tar``, :func:`packages_folder`) and offers the
pack in a document sealed with the job key; :func:`take_offers`
reads the offers before any rank starts and records each pack, sealed with a key only drivers
hold (:func:`pack_records_key`); :func:`recorded_packs` names the recorded packs to the next
launch's nodes, which download, check and unpack one instead of building.

Nothing here is installed by an unpinned name, and prefect-sgpu itself always travels as files
(its editable source, or its installed files), never as a name from an index.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shlex
import threading
import zlib
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect_sgpu.errors import SGPUConfigError

if TYPE_CHECKING:
    from prefect_sgpu.environment import Environment
    from prefect_sgpu.environment.files import Tree
    from prefect_sgpu.store import Store

#: the store "run" the shared environment objects live under (a leading dot: never a job, never swept)
STORE_FOLDER = ".environments"
#: installer tools the image brings itself (they are not packages a function imports)
IMAGE_TOOLS = frozenset({"pip", "uv"})
THIS_PROJECT = "prefect-sgpu"
#: EC2 refuses user-data over 16 KiB
USER_DATA_LIMIT = 16 * 1024
#: the name, in a job's ``secrets=`` SecureString, of the revealed index settings (never a rank's variable)
INDEX_SECRET = "PREFECT_SGPU_INDEX_URLS"


def builds_on_node(environment: "Environment | None") -> bool:
    """True when nodes build this environment themselves (``mode="driver"``); ``"image"`` and no
    environment keep the image's Python and packages."""
    return environment is not None and environment.mode == "driver"


def environment_key(environment: "Environment | None") -> str:
    """What tells two jobs' node environments apart (a warm lease serves only its own): the digest of
    an environment built on the node, else its mode."""
    if environment is None:
        return ""
    return environment.digest if builds_on_node(environment) else environment.mode


def has_index_credentials(environment: "Environment | None") -> bool:
    """Whether a node-built environment's index settings carry credentials (literal or ``${VAR}``)."""
    if not builds_on_node(environment):
        return False
    assert environment is not None
    urls = [environment.index_url] if environment.index_url else []
    return any(u.has_secret or "${" in u.shown for u in [*urls, *environment.extra_index_urls,
                                                           *environment.find_links])


def index_secret(environment: "Environment | None", environ: Any = None) -> dict[str, str]:
    """What travels beside ``secrets=`` (one SSM SecureString per job) when the index settings carry
    credentials: ``{INDEX_SECRET: JSON of the revealed index settings}``; empty otherwise. Raises
    ``SGPUConfigError`` (masked) when a ``${VAR}`` is not set or literal credentials were lost in a pickle."""
    if not has_index_credentials(environment):
        return {}
    assert environment is not None
    revealed = {
        "index_url": environment.index_url.reveal(environ) if environment.index_url else None,
        "extra_index_urls": [u.reveal(environ) for u in environment.extra_index_urls],
        "find_links": [u.reveal(environ) for u in environment.find_links],
    }
    return {INDEX_SECRET: json.dumps(revealed, separators=(",", ":"))}


def _index(environment: "Environment") -> dict[str, Any]:
    """The index settings as the manifest shows them: URLs the nodes can reach, credentials masked (the
    node reads the real URLs from the job's SecureString when ``credentials`` says so)."""
    def url(value: Any, field: str) -> str:
        shown = value.shown
        if not shown.startswith(("http://", "https://")):
            raise SGPUConfigError(f"environment.{field}", shown, "an http(s):// URL the nodes can reach "
                                  "(a local path or file:// URL names this machine)")
        return shown

    return {
        "index_url": url(environment.index_url, "index_url") if environment.index_url else None,
        "extra_index_urls": [url(u, "extra_index_urls") for u in environment.extra_index_urls],
        "find_links": [url(u, "find_links") for u in environment.find_links],
        **({"credentials": True} if has_index_credentials(environment) else {}),
    }


def _import_root(tree: "Tree", name: str) -> str:
    """Where an editable distribution's code is imported from, relative to its source folder: the
    path its own ``.pth`` names (flat layout: ""), else ``src`` when the folder has one."""
    from importlib import metadata

    source = Path(tree.source).resolve()
    try:
        dist = metadata.distribution(name)
        pths = [f for f in (dist.files or ()) if str(f).endswith(".pth")]
    except metadata.PackageNotFoundError:
        pths = []
    for pth in pths:
        try:
            lines = Path(dist.locate_file(pth)).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            line = line.strip()
            if not line or line.startswith(("#", "import")):
                continue
            path = Path(line).resolve()
            if path == source or source in path.parents:
                return path.relative_to(source).as_posix().strip(".")
    return "src" if any(f.path.startswith("src/") for f in tree.files) else ""


def _files(tree: "Tree", prefix: str = "") -> list[list[Any]]:
    return [[prefix + f.path, f.size, f.sha256] for f in tree.files]


def _own_files() -> "Tree":
    """prefect-sgpu's installed files (it was installed by name: it still travels as files)."""
    from importlib import metadata

    from prefect_sgpu.environment.files import installed_files

    dist = metadata.distribution(THIS_PROJECT)
    rels = [str(f) for f in (dist.files or ()) if ".." not in Path(str(f)).parts]
    return installed_files(THIS_PROJECT, Path(dist.locate_file("")), rels, f"environment ({THIS_PROJECT})")


def _trees(environment: "Environment") -> tuple[list[dict[str, Any]], dict[str, Path]]:
    """The manifest's trees and, for shipping, where each sha256's bytes are on this machine."""
    sources: dict[str, Path] = {}
    trees: list[dict[str, Any]] = []
    versions = {d.name: d for d in environment.distributions}

    def add(tree: "Tree", entry: dict[str, Any], prefix: str = "") -> None:
        source = Path(tree.source)
        for f in tree.files:
            sources[f.sha256] = source if source.is_file() else source / f.path
        trees.append({**entry, "files": _files(tree, prefix)})

    for tree in environment.local_packages:
        dist = versions.get(tree.name)
        if dist is not None and dist.source == "editable":
            add(tree, {"name": tree.name, "kind": "path", "root": _import_root(tree, tree.name),
                       "dist": [dist.name, dist.version, dist.entry_points]})
        else:
            add(tree, {"name": tree.name, "kind": "site", "root": ""})
    own = versions.get(THIS_PROJECT)
    if own is not None and own.source == "index":
        add(_own_files(), {"name": THIS_PROJECT, "kind": "site", "root": ""})
    if environment.working_dir is not None:
        add(environment.working_dir, {"name": "working_dir", "kind": "path", "root": ""})
    for tree in environment.py_modules:
        single = Path(tree.source).is_file()
        add(tree, {"name": f"py-{tree.name}", "kind": "path", "root": ""}, "" if single else f"{tree.name}/")
    return trees, sources


def manifest(environment: "Environment") -> dict[str, Any]:
    """What a node builds, with nothing of this machine's paths in it (see the module doc)."""
    return _manifest(environment)[0]


def _manifest(environment: "Environment") -> tuple[dict[str, Any], dict[str, Path]]:
    if not builds_on_node(environment):
        raise SGPUConfigError("environment.mode", environment.mode, "'driver' to build the environment on nodes")
    shipped = {t.name for t in environment.local_packages} | {THIS_PROJECT}
    pins = [f"{d.name}=={d.version}" for d in environment.distributions
            if d.source == "index" and d.name not in IMAGE_TOOLS and d.name not in shipped]
    trees, sources = _trees(environment)
    data = {"format": 1, "digest": environment.digest, "python": environment.python.minor,
            "implementation": environment.python.implementation, "pins": pins,
            "requirements": list(environment.requirements), "index": _index(environment), "trees": trees}
    hashes = pin_hashes(environment, pins)
    if hashes:
        data["hashes"] = hashes
    return data, sources


def pin_hashes(environment: "Environment", pins: list[str]) -> dict[str, list[str]]:
    """pin -> sha256s of its files, as the indexes the environment names list them
    (:mod:`prefect_sgpu.environment.hashes`): the node installs those pins by hash. None named: none."""
    from prefect_sgpu.environment.hashes import index_hashes

    indexes = [(environment.index_url.reveal(), "index_url")] if environment.index_url else []
    indexes += [(u.reveal(), f"extra_index_urls[{i}]") for i, u in enumerate(environment.extra_index_urls)]
    find_links = [(u.reveal(), f"find_links[{i}]") for i, u in enumerate(environment.find_links)]
    if not pins or not (indexes or find_links):
        return {}
    return index_hashes(pins, indexes, find_links)


def manifest_bytes(environment: "Environment") -> bytes:
    return _manifest_cached(environment)[0]


_RENDERED: dict[str, tuple[bytes, str]] = {}


def _manifest_cached(environment: "Environment") -> tuple[bytes, str]:
    """The manifest's bytes and sha256, once per digest (plan and acquire both ask)."""
    key = environment.digest
    if key not in _RENDERED:
        data, _ = _manifest(environment)
        raw = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        if len(_RENDERED) > 16:
            _RENDERED.clear()
        _RENDERED[key] = (raw, hashlib.sha256(raw).hexdigest())
    return _RENDERED[key]


def manifest_sha256(environment: "Environment") -> str:
    """What the user-data names: a node builds only the manifest with this sha256."""
    return _manifest_cached(environment)[1]


#: (store root, object key) -> the listing token of a stored file this process checked against its sha256
#: or uploaded itself: a later ship reads it again only when it was written since (its token changed)
_VERIFIED: dict[tuple[str, str], str] = {}
_VERIFIED_LOCK = threading.Lock()
_VERIFIED_MAX = 100_000


def ship(store: "Store", environment: "Environment") -> dict[str, int]:
    """Put the environment's files and manifest in ``store`` (files first, manifest last: a manifest
    in the store means every file it names is there). What was uploaded, skipped and repaired.

    What is already there is checked, not trusted: one bad write (a cut or changed object, by anyone
    who can write the store) would otherwise fail every later job of the environment, since nodes
    check every file and the manifest against their sha256. The manifest is read and hashed; the
    files are listed once (sizes), and a file whose size is right is read and hashed unless this
    process already checked that very version of it (its listing token). A bad one is uploaded again."""
    import logging

    raw = manifest_bytes(environment)
    sha = manifest_sha256(environment)
    folder = environment.digest
    manifest_key = f"{folder}/manifest-{sha}.json"
    data, sources = _manifest(environment)
    stored = store.get(STORE_FOLDER, manifest_key)
    manifest_ok = stored is not None and hashlib.sha256(stored).hexdigest() == sha
    listed = store.listing(STORE_FOLDER, f"{folder}/files")

    def stored_ok(item: tuple[str, Path]) -> bool:
        """Whether ``files/<sha>`` is in the store with exactly the bytes of that sha256."""
        file_sha, path = item
        key = f"{folder}/files/{file_sha}"
        found = listed.get(key)
        if found is None or found.size != path.stat().st_size:
            return False
        with _VERIFIED_LOCK:
            if _VERIFIED.get((store.root_uri, key)) == found.token:
                return True
        blob = store.get(STORE_FOLDER, key)
        if blob is None or hashlib.sha256(blob).hexdigest() != file_sha:
            return False
        with _VERIFIED_LOCK:
            if len(_VERIFIED) >= _VERIFIED_MAX:  # a long-lived driver of many environments: start over
                _VERIFIED.clear()
            _VERIFIED[(store.root_uri, key)] = found.token
        return True

    def upload(item: tuple[str, Path]) -> int:
        file_sha, path = item
        blob = path.read_bytes()
        if hashlib.sha256(blob).hexdigest() != file_sha:
            raise SGPUConfigError("environment", str(path), "files unchanged between capture and launch",
                                  "the file changed after the environment was captured; run the job again")
        store.put(STORE_FOLDER, f"{folder}/files/{file_sha}", blob)
        return len(blob)

    from concurrent.futures import ThreadPoolExecutor

    items = sorted(sources.items())
    with ThreadPoolExecutor(max_workers=8) as pool:  # many small files: the round trips dominate
        checked = list(pool.map(stored_ok, items))
        missing = [item for item, ok in zip(items, checked) if not ok]
        bad = [file_sha for file_sha, _ in missing if f"{folder}/files/{file_sha}" in listed]
        if stored is not None and not manifest_ok:
            bad.append(manifest_key)
        if bad:
            logging.getLogger("prefect_sgpu.environment").warning(
                "environment %s: %d stored object(s) did not match their sha256 (%s): uploading them again",
                folder[:16], len(bad), ", ".join(b.rsplit("/", 1)[-1][:16] for b in bad[:5]))
        sizes = list(pool.map(upload, missing))
    if missing:
        _remember_written(store, folder, [(file_sha, n) for (file_sha, _), n in zip(missing, sizes)])
    size = sum(sizes)
    if missing or not manifest_ok:
        store.put(STORE_FOLDER, manifest_key, raw)
    return {"uploaded": len(missing), "skipped": len(sources) - len(missing), "bytes": size, "repaired": len(bad)}


def _remember_written(store: "Store", folder: str, written: list[tuple[str, int]]) -> None:
    """Record the listing tokens of the files this process has just uploaded (one listing), as if it had
    read them back: the next ship of the environment from this process skips them instead of reading
    every file it wrote again. A file whose listed size is not what was written (another writer's since)
    is left to be checked."""
    listed = store.listing(STORE_FOLDER, f"{folder}/files")
    with _VERIFIED_LOCK:
        for file_sha, size in written:
            key = f"{folder}/files/{file_sha}"
            found = listed.get(key)
            if found is not None and found.size == size:
                if len(_VERIFIED) >= _VERIFIED_MAX:
                    _VERIFIED.clear()
                _VERIFIED[(store.root_uri, key)] = found.token


#: the name the stage's main module has on the node
STAGE_MAIN = "prefect_sgpu_node_env.py"


@lru_cache(maxsize=None)
def stage_text(module: str = "node_env") -> str:
    """A module of the node stage (:mod:`prefect_sgpu.launch.node_env` and its siblings; ``retry``: the
    package's :mod:`prefect_sgpu.retry`) as the user-data carries it: the same code without its docstrings,
    comments and its functions' annotations (about a quarter of its size; each of these modules imports
    ``annotations`` from ``__future__``: no annotation is evaluated)."""
    import ast

    package = Path(__file__).parent.parent
    tree = ast.parse((package / f"{module}.py" if module in STAGE_SHARED else package / "launch" / f"{module}.py")
                     .read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
            arguments = node.args
            for arg in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg,
                        arguments.kwarg):
                if arg is not None:
                    arg.annotation = None
    return ast.unparse(tree) + "\n"


#: modules of the package itself (not of ``launch/``) the stage's transport imports, carried beside it
STAGE_SHARED = ("retry",)


def stage_files(transport: str) -> dict[str, str]:
    """File name -> text of what the user-data writes into the stage's folder: the stage, the transport
    module ``transport`` (a module of ``prefect_sgpu/launch/``) it imports from there, and the retry helper
    the transport waits for a late or busy cloud with (:data:`STAGE_SHARED`). What else the stage
    needs comes from the environment's shipped files (:func:`prefect_sgpu.launch.node_env.shipped_module`)."""
    return {STAGE_MAIN: stage_text("node_env"), f"{transport}.py": stage_text(transport),
            **{f"{name}.py": stage_text(name) for name in STAGE_SHARED}}


@lru_cache(maxsize=None)
def _stage_source(transport: str) -> str:
    """The node stage's files, compressed together for the user-data."""
    raw = json.dumps(stage_files(transport), separators=(",", ":")).encode()
    return base64.b85encode(zlib.compress(raw, 9)).decode()  # a sixteenth smaller than base64


def stage_lines(python: str, digest: str, manifest_sha: str, store_uri: str, run_id: str, region: str,
                endpoint_url: str | None, bucket_owner: str | None, packs: list[str] | tuple[str, ...] = (),
                offer_pack: bool = False, *, transport: str) -> tuple[list[str], str]:
    """User-data lines that write the stage out, and the shell words that run it (the bootstrap's
    own arguments, without its Python, follow them). ``transport``: the module under ``launch/`` of the
    stage's transport to the store (:class:`prefect_sgpu.launch.node_env.Transport`), carried beside it."""
    unpack = ("import base64,json,os,sys,zlib;[open(os.path.join(sys.argv[1],n),'w').write(t) for n,t in "
              "json.loads(zlib.decompress(base64.b85decode(sys.argv[2]))).items()]")
    lines = [
        "# the environment stage: build or reuse the driver's environment (a venv by digest), then the bootstrap",
        'stage="$(mktemp -d)"',
        f'{shlex.quote(python)} -c {shlex.quote(unpack)} "$stage" {shlex.quote(_stage_source(transport))}',
    ]
    args = [f"--store={store_uri}", f"--run-id={run_id}", f"--region={region}", f"--environment={digest}",
            f"--manifest={manifest_sha}", f"--transport={transport}"]
    if endpoint_url:
        args.append(f"--endpoint-url={endpoint_url}")
    if bucket_owner:
        args.append(f"--bucket-owner={bucket_owner}")
    args += [f"--pack={value}" for value in packs]
    if offer_pack:
        args.append("--offer-pack")
    return lines, f'{shlex.quote(python)} "$stage/{STAGE_MAIN}" {shlex.join(args)} --'


# --- packs of built environments ----------------------------------------------------------------

#: what the stage seals its offer with: the job key's own purpose (``jobfolder.derive_key``)
OFFER_PURPOSE = b"env-pack"
_RECORD_PURPOSE = b"sgpu-env-pack\0"


def packages_folder(environment: "Environment") -> str:
    """Where the packs of ``environment``'s packages live, under :data:`STORE_FOLDER`: one folder per
    packages digest (the Python, pins, requirements and index settings, not the shipped files)."""
    from prefect_sgpu.launch import node_env

    return f"packages-{node_env.packages_digest(json.loads(manifest_bytes(environment)))}"


def pack_records_key(store: "Store", environment: "Environment", create: bool = False) -> str | None:
    """The key that seals the records of ``environment``'s packs in ``store``: derived from the driver's
    secret (the checkpoint secret: a store writer does not hold it) and the packs' folder.
    None when this process has no secret (and ``create`` is false): no record can be checked."""
    from prefect_sgpu.checkpoints import manifest as checkpoint_manifest

    secret = checkpoint_manifest.driver_secret() if create else checkpoint_manifest.read_secret()
    if secret is None:
        return None
    return checkpoint_manifest.derive(secret, _RECORD_PURPOSE,
                                      f"{store.root_uri}/{STORE_FOLDER}/{packages_folder(environment)}")


def _pack_body(raw: bytes, environment: "Environment") -> dict[str, Any]:
    """A pack's description (from an offer or a record), refused unless well formed and of ``environment``."""
    from prefect_sgpu.errors import DocumentRefused
    from prefect_sgpu.launch import node_env, node_pack

    try:
        body = json.loads(raw)
        ok = (body["format"] == node_pack.PACK_FORMAT and body["packages"] == packages_folder(environment)[9:]
              and node_env.NAME.match(body["platform"]) and node_env.SHA.match(body["sha256"])
              and isinstance(body["size"], int) and body["size"] > 0 and body["python"] == environment.python.minor)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise DocumentRefused(f"pack description {raw[:200]!r} is not one of the packages of environment "
                              f"{environment.digest[:16]}")
    return body


def recorded_packs(store: "Store", environment: "Environment | None") -> list[str]:
    """The ``--pack`` values (``<platform>:<sha256>:<size>``) of every pack recorded for ``environment``
    whose record this driver can check; a record that does not check out is logged and passed over."""
    import logging

    from prefect_sgpu.errors import DocumentRefused
    from prefect_sgpu.protocol.jobfolder import unseal

    if not builds_on_node(environment):
        return []
    assert environment is not None
    key = pack_records_key(store, environment)
    if key is None:
        return []
    found = []
    folder = packages_folder(environment)
    for name in store.list(STORE_FOLDER, folder):
        if not name.endswith(".json"):
            continue
        blob = store.get(STORE_FOLDER, name)
        try:
            body = _pack_body(unseal(blob or b"", key, "envpack", folder, what=f"pack record {name}"), environment)
        except DocumentRefused as exc:
            logging.getLogger("prefect_sgpu.environment").warning("%s: not used", exc)
            continue
        found.append(f"{body['platform']}:{body['sha256']}:{body['size']}")
    return sorted(found)


def take_offers(store: "Store", environment: "Environment | None", folder_id: str, job_key: str,
                machines: list[str]) -> list[str]:
    """Record the packs ``machines`` offered in job folder ``folder_id`` (``setup/pack-<machine>.json``,
    sealed with the job key's pack key and bound to the machine). Call it before any rank runs: the
    ranks hold the job key. What was recorded, as :func:`recorded_packs` names it."""
    import logging

    from prefect_sgpu.errors import DocumentRefused
    from prefect_sgpu.protocol.jobfolder import derive_key, seal, unseal

    if not builds_on_node(environment) or not machines:
        return []
    assert environment is not None
    offer_key = derive_key(job_key, OFFER_PURPOSE)
    recorded = []
    there = set(store.list(folder_id, "setup"))
    for machine in machines:
        if f"setup/pack-{machine}.json" not in there:
            continue
        try:
            raw = unseal(store.get(folder_id, f"setup/pack-{machine}.json") or b"", offer_key, "envpack", folder_id,
                         instance_id=machine, what=f"environment pack offer of {machine}")
            body = _pack_body(raw, environment)
        except DocumentRefused as exc:
            logging.getLogger("prefect_sgpu.environment").warning("%s", exc)
            continue
        folder = packages_folder(environment)
        if f"{folder}/{body['sha256']}.tar" not in store.list(STORE_FOLDER, folder):
            continue
        canonical = json.dumps(body, sort_keys=True).encode()
        record_key = pack_records_key(store, environment, create=True)
        assert record_key is not None
        store.put(STORE_FOLDER, f"{folder}/{body['platform']}.json", seal(record_key, "envpack", folder, canonical))
        recorded.append(f"{body['platform']}:{body['sha256']}:{body['size']}")
    return recorded
