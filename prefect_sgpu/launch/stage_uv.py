"""The uv the environment stage (:mod:`prefect_sgpu.launch.node_env`) runs: the image's, else a pinned wheel.

Standard library only: it runs on a bare image, loaded by the stage from the environment's own shipped
files only when the image has no uv or the manifest records the pins' sha256s
(:func:`prefect_sgpu.launch.node_env.shipped_module`). It knows no cloud: the wheel comes from a package
index (simple API) or a find-links page.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import platform
import re
import shutil
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path
from typing import Callable


class UvMissing(Exception):
    """The image has no uv and none of the pinned wheel could be fetched: the text says where it was tried."""


def masked_url(url: str) -> str:
    """``url`` with its user info and query replaced by ``***`` (as the driver shows it)."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    netloc = f"***@{netloc}" if "@" in parts.netloc else netloc
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "***" if parts.query else "", ""))


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


def this_machine() -> str:
    """This machine's name as :data:`UV_WHEELS` keys it."""
    machine = platform.machine().lower()
    return _MACHINES.get(machine, machine)


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


def uv(index: dict | None, root: Path, log: Callable[[str], None]) -> str:
    """The image's ``uv``; else the pinned uv wheel, fetched once per node into the environments'
    root and checked against its sha256. From the index ``PREFECT_SGPU_UV_INDEX`` names (an image
    setting) alone; else from the environment's index settings (``index``: revealed or the
    manifest's) as uv would install from them: its ``index_url`` (else the image's ``UV_INDEX_URL``,
    else PyPI), its extra index URLs, its find-links pages."""
    found = shutil.which("uv")
    if found:
        return found
    machine = this_machine()
    if machine not in UV_WHEELS:
        raise UvMissing(f"the image has no `uv` on PATH and no uv wheel is pinned for "
                         f"{machine} (only {', '.join(UV_WHEELS)}): install uv in the image")
    wheel, sha = UV_WHEELS[machine]
    tool = root / "tools" / f"uv-{UV_VERSION}-{machine}" / "uv"
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
    raise UvMissing(f"the image has no `uv` on PATH, and no index gave uv {UV_VERSION}'s "
                     f"wheel {wheel} (sha256 {sha}):\n" + "\n".join(tried) + f"\ninstall uv in the image, set "
                     f"{UV_INDEX_ENV} to an index (simple API) that serves it, or say environment='image' "
                     "if the image has every package")


def install_hashed(common: list, work: Path, pins: list, hashes: dict, env, run: Callable, error: type) -> None:
    """The pinned distributions ``pins``, each only as a file whose sha256 the driver recorded (``hashes``:
    pin -> sha256s, from the index at capture): ``uv pip install --require-hashes`` refuses other bytes for
    a pinned version and installs nothing. ``run``/``error``: the stage's step runner and its error."""
    lines = []
    for pin in pins:
        digests = hashes.get(pin) or []
        if not digests or not all(re.match(r"^[0-9a-f]{64}$", str(d)) for d in digests):
            raise error("checking the manifest", f"the sha256s of {pin}: {digests!r}")
        lines.append(" ".join([pin, *(f"--hash=sha256:{d}" for d in digests)]))
    hashed = work / "pins-hashed.txt"
    hashed.write_text("\n".join(lines) + "\n")
    step = "installing the driver's pinned distributions (sha256 checked)"
    try:
        run(step, [*common, "--no-deps", "--require-hashes", "-r", str(hashed)], env)
    except error as exc:
        named = [pin for pin in pins if re.search(rf"(?i)\b{re.escape(pin.split('==')[0])}\b", str(exc))]
        raise error(f"{step}: {', '.join(named) or 'a pinned distribution'} did not install as the driver "
                    "recorded it", str(exc).split(":", 1)[-1]) from None
