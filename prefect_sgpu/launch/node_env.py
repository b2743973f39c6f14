"""The node's first stage: build (or reuse) the driver's environment, then start the bootstrap in it.

This file runs on a bare image *before* anything but the image's own Python exists: it imports
the standard library only, and the EC2 user-data carries it (compressed) rather than expecting
it installed. It is the node half of :mod:`prefect_sgpu.environment_ship`:

1. read the environment's manifest from the store (``<store>/.environments/<digest>/manifest-<sha256>.json``)
   and check it against the sha256 the user-data names (the user-data is the launcher's own:
   a store writer cannot change which environment a node builds);
2. if ``<root>/<digest>-<platform>/.complete`` exists, reuse that venv: nothing is installed;
3. otherwise, under a lock: ``uv venv`` with the driver's Python minor version, ``uv pip install
   --no-deps`` of the driver's pinned distributions (then the extra requirements, constrained by
   those pins) from the manifest's index settings (the image's uv settings, ``UV_OFFLINE`` and
   ``UV_CACHE_DIR`` included, apply); every shipped file (local packages, this project, the
   user's ``working_dir`` and ``py_modules``) fetched by sha256, checked, and laid out; then the
   marker. When the manifest's index settings carry credentials (it shows them masked), the real
   URLs come from the job's SSM SecureString (``/prefect-sgpu/<store scope>/<run id>/secrets``, GetParameter
   signed like S3) and reach uv only through its environment (``UV_INDEX_URL``,
   ``UV_EXTRA_INDEX_URL``, ``UV_FIND_LINKS``), never a command line; every line this stage
   prints or uploads has them masked;
4. ``exec`` the bootstrap with the venv's Python.

S3 is read with Signature V4 from the standard library (credentials from the environment or the
instance profile through IMDSv2). A failing step prints its output (the console) and writes it to
``<store>/<run id>/setup/<instance id>.log``, where the driver shows it, then exits non-zero: the
user-data's trap powers the instance off.
"""

from __future__ import annotations

import argparse
import base64
import datetime as _dt
import fcntl
import hashlib
import hmac
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import types
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FORMAT = 1
ENV_ROOT_ENV = "PREFECT_SGPU_ENV_ROOT"
DEFAULT_ROOTS = ("/var/lib/prefect-sgpu/envs", "~/.cache/prefect-sgpu/envs")
COMPLETE = ".complete"
SHA = re.compile(r"^[0-9a-f]{64}$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_UNRESERVED = "-_.~"


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
    """``url`` with its user info and query replaced by ``***`` (as the driver shows it)."""
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


# --- S3 with Signature V4, standard library only ------------------------------------------------


def _imds(path: str, token: str | None = None, method: str = "GET") -> str:
    """One IMDS read; tried three times (5, 10, 20 s): a busy machine can answer late, and a stage
    that gives up powers its instance off."""
    base = os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://169.254.169.254/").rstrip("/")
    headers = {"X-aws-ec2-metadata-token": token} if token else {"X-aws-ec2-metadata-token-ttl-seconds": "300"}
    for attempt, timeout in enumerate((5, 10, 20)):
        req = urllib.request.Request(base + path, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.read().decode()
        except urllib.error.HTTPError:
            raise
        except OSError:  # a timeout, a reset connection
            if attempt == 2:
                raise
            time.sleep(1)
    raise AssertionError("not reached")


def credentials() -> tuple[str, str, str | None]:
    """The environment's keys, else the instance profile's from IMDSv2 (as botocore finds them)."""
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return (os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"],
                os.environ.get("AWS_SESSION_TOKEN") or None)
    token = _imds("/latest/api/token", method="PUT")
    role = _imds("/latest/meta-data/iam/security-credentials/", token).strip().splitlines()[0]
    doc = json.loads(_imds(f"/latest/meta-data/iam/security-credentials/{role}", token))
    return doc["AccessKeyId"], doc["SecretAccessKey"], doc.get("Token")


def instance_id() -> str:
    try:
        return _imds("/latest/meta-data/instance-id", _imds("/latest/api/token", method="PUT")).strip()
    except (OSError, urllib.error.URLError):
        return "unknown-instance"


def signed(method: str, url: str, service: str, region: str, creds: tuple[str, str, str | None],
           body: bytes = b"", extra: dict[str, str] | None = None,
           query: dict[str, str] | None = None) -> urllib.request.Request:
    """A request signed with Signature V4 (``url`` already quoted, without its query: ``query``)."""
    parts = urllib.parse.urlsplit(url)
    canonical_query = "&".join(f"{urllib.parse.quote(k, safe=_UNRESERVED)}={urllib.parse.quote(v, safe=_UNRESERVED)}"
                               for k, v in sorted((query or {}).items()))
    now = _dt.datetime.now(_dt.timezone.utc)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload = hashlib.sha256(body).hexdigest()
    headers = {"host": parts.netloc, "x-amz-content-sha256": payload, "x-amz-date": stamp, **(extra or {})}
    access, secret, token = creds
    if token:
        headers["x-amz-security-token"] = token
    names = sorted(headers)
    canonical = "\n".join([method, parts.path or "/", canonical_query, *(f"{n}:{headers[n].strip()}" for n in names), "",
                           ";".join(names), payload])
    scope = f"{day}/{region}/{service}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key_bytes = ("AWS4" + secret).encode()
    for part in (day, region, service, "aws4_request"):
        key_bytes = hmac.new(key_bytes, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key_bytes, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access}/{scope}, "
                                f"SignedHeaders={';'.join(names)}, Signature={signature}")
    del headers["host"]
    return urllib.request.Request(url + (f"?{canonical_query}" if canonical_query else ""),
                                  data=body if method in ("PUT", "POST") else None, method=method, headers=headers)


def read_parameter(name: str, region: str, endpoint_url: str | None, creds: tuple[str, str, str | None]) -> str:
    """An SSM SecureString's value (GetParameter WithDecryption), signed with the node's credentials."""
    base = endpoint_url.rstrip("/") + "/" if endpoint_url else f"https://ssm.{region}.amazonaws.com/"
    body = json.dumps({"Name": name, "WithDecryption": True}).encode()
    req = signed("POST", base, "ssm", region, creds, body,
                 {"content-type": "application/x-amz-json-1.1", "x-amz-target": "AmazonSSM.GetParameter"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())["Parameter"]["Value"]
    except urllib.error.HTTPError as exc:
        raise SetupError(f"reading the SSM parameter {name}", f"HTTP {exc.code}: {exc.read()[:300]!r}") from None


class S3:
    """GET and PUT of one bucket's objects, signed (SigV4) with the node's credentials."""

    def __init__(self, bucket: str, region: str, endpoint_url: str | None, bucket_owner: str | None) -> None:
        self.bucket, self.region, self.owner = bucket, region, bucket_owner
        if endpoint_url:  # path style, as botocore uses against a custom endpoint
            self.base, self.path_prefix = endpoint_url.rstrip("/"), f"/{bucket}"
        else:
            self.base, self.path_prefix = f"https://{bucket}.s3.{region}.amazonaws.com", ""
        self.creds = credentials()

    def _request(self, method: str, key: str, body: bytes = b"", query: dict[str, str] | None = None,
                 headers: dict[str, str] | None = None) -> urllib.request.Request:
        path = self.path_prefix + "/" + urllib.parse.quote(key, safe="/" + _UNRESERVED)
        headers = dict(headers or {})
        if method in ("PUT", "POST"):  # else urllib says form data
            headers.setdefault("content-type", "application/octet-stream")
        if self.owner:
            headers["x-amz-expected-bucket-owner"] = self.owner
        return signed(method, self.base + path, "s3", self.region, self.creds, body, headers, query)

    def _call(self, what: str, request: urllib.request.Request, timeout: float = 60):
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                return resp.read(), resp.headers
        except urllib.error.HTTPError as exc:
            raise SetupError(what, f"HTTP {exc.code}: {exc.read()[:300]!r}") from None

    def get(self, key: str) -> bytes:
        return self._call(f"reading s3://{self.bucket}/{key}", self._request("GET", key))[0]

    def put(self, key: str, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self._call(f"writing s3://{self.bucket}/{key}", self._request("PUT", key, body,
                                                                      headers={"content-type": content_type}))

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


def fetch_file(s3: S3, files_key: str, cache: Path, sha: str) -> Path:
    """One shipped file, from this node's cache by sha256 or from the store, checked either way."""
    path = cache / sha
    if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == sha:
        return path
    data = s3.get(f"{files_key}/{sha}")
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


#: The uv this stage brings when the image has none: per machine, the wheel's file name and its
#: sha256 as PyPI lists it. Only this exact file is used, from whichever index serves it.
UV_VERSION = "0.13.9"
UV_WHEELS = {
    "x86_64": ("uv-0.13.9-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
               "d7f459fe4fd247d830351c75686d3996ace3c6f3f728eb0e85a30b7ada0cef19"),
    "aarch64": ("uv-0.13.9-py3-none-manylinux_2_17_aarch64.manylinux2014_aarch64.musllinux_1_1_aarch64.whl",
                "5435c5ce14a56431208ca0996416d310f1598e8c2c8ba707688985a16bb82dbe"),
}
#: an image's own package index (simple API) for uv's wheel, tried before the environment's and PyPI
UV_INDEX_ENV = "PREFECT_SGPU_UV_INDEX"
PYPI_SIMPLE = "https://pypi.org/simple"
_MACHINES = {"amd64": "x86_64", "arm64": "aarch64"}


def _open(url: str, accept: str = "*/*", timeout: float = 30):
    """GET ``url``; user info in it becomes Basic auth (urllib sends none of its own)."""
    parts = urllib.parse.urlsplit(url)
    auth = None
    if "@" in parts.netloc:
        userinfo, host = parts.netloc.rsplit("@", 1)
        user, _, password = userinfo.partition(":")
        auth = base64.b64encode(f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}".encode()).decode()
        url = urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, ""))
    request = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": "prefect-sgpu-node-env"})
    if auth:  # to this URL only: urllib copies a plain header onto a redirect, wherever it points
        request.add_unredirected_header("Authorization", f"Basic {auth}")
    return urllib.request.urlopen(request, timeout=timeout)


def _wheel_link(page_url: str, wheel: str) -> str:
    """The URL of file ``wheel`` on a simple-API project page (JSON, PEP 691, or HTML, PEP 503) or a
    find-links page."""
    with _open(page_url, "application/vnd.pypi.simple.v1+json, text/html;q=0.5") as page:
        kind, body = page.headers.get("Content-Type", ""), page.read(16 << 20)
        final = page.geturl()
    if "json" in kind:
        links = [f.get("url", "") for f in json.loads(body).get("files", ())]
    else:
        links = [urllib.parse.unquote(h) for h in re.findall(r'href\s*=\s*["\']([^"\']+)', body.decode("utf-8", "replace"))]
    for link in links:
        if urllib.parse.urlsplit(link).path.rsplit("/", 1)[-1] == wheel:
            # relative to the page as asked for (its credentials too), unless it was redirected elsewhere
            same = urllib.parse.urlsplit(final).netloc == urllib.parse.urlsplit(page_url).netloc.rsplit("@", 1)[-1]
            return urllib.parse.urljoin(page_url if same else final, link.split("#", 1)[0])
    raise FileNotFoundError(f"{wheel} is not listed there")


def uv(index: dict | None = None) -> str:
    """The image's ``uv``; else the pinned uv wheel, fetched once per node into the environments'
    root and checked against its sha256. From the index ``PREFECT_SGPU_UV_INDEX`` names (an image
    setting) alone; else from the environment's index settings (``index``: revealed or the
    manifest's) as uv would install from them: its ``index_url`` (else the image's ``UV_INDEX_URL``,
    else PyPI), its extra index URLs, its find-links pages."""
    found = shutil.which("uv")
    if found:
        return found
    machine = platform.machine().lower()
    machine = _MACHINES.get(machine, machine)
    if machine not in UV_WHEELS:
        raise SetupError("fetching uv", f"the image has no `uv` on PATH and no uv wheel is pinned for "
                         f"{machine} (only {', '.join(UV_WHEELS)}): install uv in the image")
    wheel, sha = UV_WHEELS[machine]
    tool = env_root() / "tools" / f"uv-{UV_VERSION}-{machine}" / "uv"
    if tool.exists():
        return str(tool)
    index = index or {}
    if os.environ.get(UV_INDEX_ENV):
        pages = [f"{os.environ[UV_INDEX_ENV].rstrip('/')}/uv/"]
    else:
        bases = [index.get("index_url") or os.environ.get("UV_INDEX_URL") or PYPI_SIMPLE,
                 *(index.get("extra_index_urls") or ())]
        pages = [f"{base.rstrip('/')}/uv/" for base in bases]
        pages += list(index.get("find_links") or ())  # pages that list files themselves
    tried = []
    for page in dict.fromkeys(pages):
        try:
            url = _wheel_link(page, wheel)
            with _open(url, timeout=120) as got:
                data = got.read(256 << 20)
        except (OSError, ValueError) as exc:  # URLError, HTTPError and timeouts are OSErrors
            tried.append(f"{masked_url(page)}: {exc}")
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest != sha:
            tried.append(f"{masked_url(url)}: its sha256 is {digest}, not the pinned {sha}")
            continue
        with zipfile.ZipFile(io.BytesIO(data)) as whl:
            binary = whl.read(f"uv-{UV_VERSION}.data/scripts/uv")
        tool.parent.mkdir(parents=True, exist_ok=True)
        part = tool.with_name(f".uv-{os.getpid()}")
        part.write_bytes(binary)
        part.chmod(0o755)
        part.replace(tool)  # whole or absent: a second boot beside this one reuses it
        log(f"fetched uv {UV_VERSION} ({wheel}) from {masked_url(url)}")
        return str(tool)
    raise SetupError("fetching uv", f"the image has no `uv` on PATH, and no index gave uv {UV_VERSION}'s "
                     f"wheel {wheel} (sha256 {sha}):\n" + "\n".join(tried) + f"\ninstall uv in the image, set "
                     f"{UV_INDEX_ENV} to an index (simple API) that serves it, or say environment='image' "
                     "if the image has every package")


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
    return hashlib.sha256(json.dumps({k: manifest.get(k) for k in keys}, sort_keys=True,
                                     separators=(",", ":")).encode()).hexdigest()


def install(venv: Path, manifest: dict, index: dict | None = None) -> None:
    """The venv with the driver's Python and packages, nothing shipped yet. ``index``: the revealed index
    settings (credentials only in uv's environment), else the manifest's.

    The venv is relocatable (uv's entry points find their Python beside them, the ``.pth`` of shipped
    trees names them relative to site-packages), and a Python uv downloads lands under the
    environments' root (``python/``, unless the image sets ``UV_PYTHON_INSTALL_DIR``): a pack of both
    works under another root."""
    tool = uv(manifest["index"] if index is None else index)
    if venv.exists():  # an earlier build that did not finish
        shutil.rmtree(venv)
    pythons = {} if os.environ.get("UV_PYTHON_INSTALL_DIR") else {"UV_PYTHON_INSTALL_DIR": str(venv.parent / "python")}
    run("creating the venv", [tool, "venv", "-q", "--relocatable", "--python", manifest["python"], str(venv)], pythons)
    python = venv / "bin" / "python"
    work = venv / "sgpu"
    work.mkdir()
    pins = work / "pins.txt"
    pins.write_text("\n".join(manifest["pins"]) + "\n")
    args, env = (index_args(manifest["index"]), None) if index is None else ([], index_env(index))
    common = [tool, "pip", "install", "-q", "--python", str(python), *args]
    if manifest["requirements"]:  # first: resolved against the pins, a bad one fails before the big install
        extra = work / "requirements.txt"
        extra.write_text("\n".join(manifest["requirements"]) + "\n")
        run("installing the extra requirements", [*common, "-c", str(pins), "-r", str(extra)], env)
    if manifest["pins"]:  # exactly the driver's set: nothing to resolve
        run("installing the driver's pinned distributions", [*common, "--no-deps", "-r", str(pins)], env)


def lay_out_trees(venv: Path, manifest: dict, s3: S3, files_key: str, cache: Path) -> None:
    """Every shipped file (fetched by sha256, checked) in the venv, then the marker."""
    shas = sorted({sha for tree in manifest["trees"] for _p, _s, sha in tree["files"]})
    log(f"fetching {len(shas)} shipped file(s)")
    with ThreadPoolExecutor(8) as pool:
        blobs = dict(zip(shas, pool.map(lambda sha: fetch_file(s3, files_key, cache, sha), shas)))
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


def build(venv: Path, manifest: dict, s3: S3, files_key: str, cache: Path, index: dict | None = None) -> None:
    install(venv, manifest, index)
    lay_out_trees(venv, manifest, s3, files_key, cache)


def platform_key() -> str:
    """What a built venv is bound to besides its digest: the OS and the machine."""
    return f"{sys.platform}-{platform.machine()}"


#: where this project's own code lies in its shipped tree (the pack code, loaded from there)
PACK_MODULE = "prefect_sgpu/launch/node_pack.py"


def pack_module(manifest: dict, s3: S3, files_key: str, cache: Path):
    """:mod:`prefect_sgpu.launch.node_pack`, from this environment's own prefect-sgpu files (checked
    against the manifest's sha256, like every shipped file); None when the manifest has none."""
    for tree in manifest["trees"]:
        if tree["name"] != "prefect-sgpu":
            continue
        want = "/".join(p for p in (tree.get("root") or "", PACK_MODULE) if p) if tree["kind"] == "path" else PACK_MODULE
        for path, _size, sha in tree["files"]:
            if path == want:
                module = types.ModuleType("prefect_sgpu_node_pack")
                code = fetch_file(s3, files_key, cache, sha).read_bytes()
                exec(compile(code, PACK_MODULE, "exec"), module.__dict__)  # noqa: S102 - checked by sha256
                return module
    return None


def ensure(manifest: dict, s3: S3, files_key: str, read_secret=None, packs: dict | None = None,
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
                packing = pack_module(manifest, s3, files_key, cache)
            except Exception as exc:  # noqa: BLE001 - a pack only saves time: build
                log(f"the pack code could not be loaded ({type(exc).__name__}: {exc})")
        if named is not None and packing is not None and packs_key:
            if venv.exists():
                shutil.rmtree(venv)
            try:
                packing.from_pack(s3, packs_key, named[0], named[1], root, venv, manifest["python"])
                lay_out_trees(venv, manifest, s3, files_key, cache)
                return venv, "unpacked"
            except Exception as exc:  # noqa: BLE001 - whatever is wrong with a pack, the node builds
                log(f"the store's pack {named[0][:16]} of these packages was not used "
                    f"({type(exc).__name__}: {exc}): building")
        index = revealed_index(manifest, read_secret) if read_secret is not None else None
        install(venv, manifest, index)
        if offer_to is not None and packing is not None:
            try:
                offer_to(venv, packing)
            except Exception as exc:  # noqa: BLE001 - a pack only saves later boots time
                log(f"the packages were not packed into the store: {type(exc).__name__}: {exc}")
        lay_out_trees(venv, manifest, s3, files_key, cache)
    return venv, "built"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    split = argv.index("--") if "--" in argv else len(argv)
    own, rest = argv[:split], argv[split + 1:]
    p = argparse.ArgumentParser(prog="prefect-sgpu-node-env")
    p.add_argument("--store", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--region", required=True)
    p.add_argument("--environment", required=True, help="the environment's digest")
    p.add_argument("--manifest", required=True, help="sha256 of the environment's manifest")
    p.add_argument("--endpoint-url", default=None)
    p.add_argument("--bucket-owner", default=None)
    p.add_argument("--pack", action="append", default=[],
                   help="<platform>:<sha256>:<size> of a pack of this environment the driver recorded")
    p.add_argument("--offer-pack", action="store_true", help="node 0: pack what it builds into the store")
    return p.parse_args(own), rest


def parse_packs(values: list[str]) -> dict[str, tuple[str, int]]:
    packs = {}
    for value in values:
        plat, sha, size = (value.rsplit(":", 2) + ["", ""])[:3]
        if not (NAME.match(plat) and SHA.match(sha) and size.isdigit()):
            raise SystemExit(f"--pack={value!r} is not allowed: <platform>:<sha256>:<size>")
        packs[plat] = (sha, int(size))
    return packs


def node_index(bootstrap: list[str]) -> int:
    """This node's index: the bootstrap's ``--node-index`` (a machine launched alone), else its launch index."""
    for arg in bootstrap:
        if arg.startswith("--node-index="):
            return int(arg.split("=", 1)[1])
    try:
        return int(_imds("/latest/meta-data/ami-launch-index", _imds("/latest/api/token", method="PUT")).strip())
    except (OSError, ValueError, urllib.error.URLError):
        return -1


def main(argv: list[str] | None = None) -> int:
    args, bootstrap = parse_args(list(sys.argv[1:] if argv is None else argv))
    for name in ("environment", "manifest"):
        if not SHA.match(getattr(args, name)):
            raise SystemExit(f"--{name}={getattr(args, name)!r} is not allowed: a sha256 (64 hex digits)")
    bucket, _, prefix = args.store[len("s3://"):].partition("/")
    prefix = prefix.strip("/")
    base = "/".join(p for p in (prefix, ".environments", args.environment) if p)
    s3 = None
    started = time.monotonic()
    try:
        s3 = S3(bucket, args.region, args.endpoint_url, args.bucket_owner)
        manifest = check_manifest(s3.get(f"{base}/manifest-{args.manifest}.json"), args.manifest)
        if manifest["digest"] != args.environment:
            raise SetupError("checking the manifest", f"it describes {manifest['digest']}, the user-data names "
                             f"{args.environment}")
        # jobfolder.ssm_secrets_parameter: under the store's scope (sha256 of its URI, as S3Store.root_uri writes it)
        scope = hashlib.sha256(f"s3://{bucket}/{prefix}".rstrip("/").encode()).hexdigest()[:16]
        secrets = f"/prefect-sgpu/{scope}/{args.run_id}/secrets"
        # packs of the environment's packages, whatever its files (environment_ship.packages_folder)
        packs_key = "/".join(p for p in (prefix, ".environments", f"packages-{packages_digest(manifest)}") if p)
        offer_to = None
        if args.offer_pack and node_index(bootstrap) == 0:
            instance = instance_id()
            key_parameter = f"/prefect-sgpu/{scope}/{args.run_id}/payload-key"
            offer_key = "/".join(p for p in (prefix, args.run_id, "setup", f"pack-{instance}.json") if p)
            offer_to = lambda venv, packing: packing.offer(  # noqa: E731
                s3, packs_key, offer_key, venv, manifest, packages_digest(manifest), platform_key(),
                lambda: read_parameter(key_parameter, args.region, args.endpoint_url, s3.creds).strip(),
                args.run_id, instance)
        venv, how = ensure(manifest, s3, f"{base}/files",
                           lambda: read_parameter(secrets, args.region, args.endpoint_url, s3.creds),
                           parse_packs(args.pack), offer_to, packs_key)
    except Exception as exc:  # noqa: BLE001 - every failure ends this node, with its reason where the driver reads
        text = str(exc) if isinstance(exc, SetupError) else f"environment setup failed: {type(exc).__name__}: {exc}"
        text = mask(text)
        log(text)
        if s3 is not None:
            key = "/".join(p for p in (prefix, args.run_id, "setup", f"{instance_id()}.log") if p)
            try:
                s3.put(key, text.encode()[-8000:])
            except Exception as put_exc:  # noqa: BLE001 - the console still has it
                log(f"could not write {key}: {put_exc}")
        return 3
    log(f"{how} environment {manifest['digest'][:16]} at {venv} "
        f"in {time.monotonic() - started:.1f}s")
    python = str(venv / "bin" / "python")
    os.environ.pop(UV_INDEX_ENV, None)  # the stage's own (it may hold a mirror's token): not the ranks'
    os.execv(python, [python, *bootstrap])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
