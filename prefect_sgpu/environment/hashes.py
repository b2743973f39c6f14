"""The sha256 of each pinned distribution's files, as the environment's own indexes list them.

On the driver, when the manifest is made (:func:`prefect_sgpu.environment.ship.manifest`): for every pin
``name==version`` the project page of each index the environment names (``index_url``,
``extra_index_urls``: ``<index>/<name>/``; ``find_links``: the page itself) is read as the simple API
serves it (PEP 691 JSON ``hashes.sha256``, or PEP 503 HTML ``#sha256=`` fragments), and the sha256 of
every file of that exact version is kept. The node installs those pins with ``uv pip install
--require-hashes`` (:func:`prefect_sgpu.launch.node_env.install_hashed`): an index that serves other
bytes for a pinned version fails the build, naming the distribution, and nothing is installed.

A page that does not list the project (404) contributes nothing; an index the driver cannot read is a
warning naming its field, and the pins it serves install by version. Credentials in a URL go as Basic
auth to that URL only.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prefect_sgpu.environment.index import masked

LOGGER = logging.getLogger(__name__)
_SHA = re.compile(r"^[0-9a-f]{64}$")
#: the largest project page read (PyPI's largest pages are a few MiB)
PAGE_LIMIT = 32 << 20


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _version_of(filename: str, project: str) -> str | None:
    """The version in a wheel's or an sdist's file name, when the file is of ``project``."""
    if filename.endswith(".whl"):
        parts = filename[:-4].split("-")
        if len(parts) < 5:
            return None
        name, version = parts[0], parts[1]
    else:
        for suffix in (".tar.gz", ".zip", ".tar.bz2", ".tgz"):
            if filename.endswith(suffix):
                name, _, version = filename[: -len(suffix)].rpartition("-")
                break
        else:
            return None
    return version if _normalize(name) == project else None


def _same_version(found: str, wanted: str) -> bool:
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover - packaging comes with Prefect
        return found == wanted
    try:
        return Version(found) == Version(wanted)
    except InvalidVersion:
        return found == wanted


def _read(url: str, timeout: float) -> tuple[str, bytes] | None:
    """(content type, body) of ``url``; None when it answers 404 (the index has no such project)."""
    parts = urllib.parse.urlsplit(url)
    headers = {"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.5", "User-Agent": "prefect-sgpu"}
    if "@" in parts.netloc:
        userinfo, host = parts.netloc.rsplit("@", 1)
        user, _, password = userinfo.partition(":")
        token = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}".encode()
        url = urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, ""))
    request = urllib.request.Request(url, headers=headers)
    if "@" in parts.netloc:  # to this URL only, never onto a redirect
        request.add_unredirected_header("Authorization", "Basic " + base64.b64encode(token).decode())
    try:
        with urllib.request.urlopen(request, timeout=timeout) as page:
            return page.headers.get("Content-Type", ""), page.read(PAGE_LIMIT)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def page_files(kind: str, body: bytes) -> list[tuple[str, str]]:
    """(file name, sha256) of every file a simple-API or find-links page lists with a sha256."""
    found = []
    if "json" in kind:
        for entry in json.loads(body).get("files", ()):
            sha = str((entry.get("hashes") or {}).get("sha256", "")).lower()
            name = entry.get("filename") or urllib.parse.urlsplit(entry.get("url", "")).path.rsplit("/", 1)[-1]
            if _SHA.match(sha):
                found.append((urllib.parse.unquote(name), sha))
        return found
    for href in re.findall(r'href\s*=\s*["\']([^"\']+)', body.decode("utf-8", "replace")):
        link, _, fragment = href.partition("#")
        sha = fragment[len("sha256="):].lower() if fragment.startswith("sha256=") else ""
        if _SHA.match(sha):
            found.append((urllib.parse.unquote(urllib.parse.urlsplit(link).path.rsplit("/", 1)[-1]), sha))
    return found


def index_hashes(pins: list[str], indexes: list[tuple[str, str]], find_links: list[tuple[str, str]],
                 timeout: float = 30.0) -> dict[str, list[str]]:
    """pin -> the sha256s (sorted) of its version's files on the given pages, for the pins listed anywhere.

    ``indexes``/``find_links``: (revealed URL, field name for messages). An index the driver cannot read
    (the nodes may reach a mirror the driver cannot) is logged as a warning naming its field, URL masked,
    and its pins install by version, as before."""
    projects = sorted({_normalize(pin.split("==", 1)[0]) for pin in pins})
    listed: list[tuple[str | None, list[tuple[str, str]]]] = []  # (project or None: any), files
    sources = [(url, field, True) for url, field in indexes] + [(url, field, False) for url, field in find_links]
    for url, field, per_project in sources:
        pages = [(f"{url.rstrip('/')}/{p}/", p) for p in projects] if per_project else [(url, None)]
        try:  # the first page alone: an index that cannot be read is not asked once per pin
            first = _read(pages[0][0], timeout)
        except (OSError, ValueError) as exc:  # URLError, HTTPError and timeouts are OSErrors
            LOGGER.warning("environment.%s=%r could not be read (%s: %s): the pinned distributions it serves "
                           "install by version, without a sha256", field, masked(url), type(exc).__name__,
                           masked_reason(exc))
            continue
        listed.append((pages[0][1], [] if first is None else page_files(*first)))

        def fetch(page: tuple[str, str | None]) -> tuple[str | None, list[tuple[str, str]]]:
            try:
                got = _read(page[0], timeout)
            except (OSError, ValueError) as exc:
                LOGGER.warning("environment.%s: %s could not be read (%s): %s installs by version",
                               field, masked(page[0]), masked_reason(exc), page[1])
                return page[1], []
            return page[1], [] if got is None else page_files(*got)

        with ThreadPoolExecutor(max_workers=16) as pool:
            listed += list(pool.map(fetch, pages[1:]))
    hashes: dict[str, list[str]] = {}
    for pin in pins:
        name, _, version = pin.partition("==")
        project = _normalize(name)
        found = {sha for page_project, files in listed if page_project in (None, project)
                 for filename, sha in files
                 if (got := _version_of(filename, project)) is not None and _same_version(got, version)}
        if found:
            hashes[pin] = sorted(found)
    return hashes


def masked_reason(exc: BaseException) -> Any:
    """An error's text with the user info of every URL in it masked."""
    return re.sub(r"://[^/@\s\"]*@", "://***@", str(exc))
