"""Index settings of an environment: where pinned distributions come from, credentials masked.

An index URL may carry credentials (``https://user:token@host/simple``). Whatever shows one
(``str``, ``repr``, ``model_dump``, ``describe()``, dry runs, logs, pickles) shows it masked:
literal user info and query strings become ``***``. The literal URL stays in the driver's
memory for :meth:`IndexURL.reveal` (the node's installer) and does not survive pickling.
A ``${VAR}`` in a URL is read from the driver's environment when revealed; it is not a
secret in itself, so it is shown as written and survives pickling.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Mapping
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer

from prefect_sgpu.errors import SGPUConfigError

_VAR = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")
MASK = "***"


def _is_reference(part: str | None) -> bool:
    return not part or bool(_VAR.fullmatch(part))


class IndexURL:
    """An index, extra index or find-links location: an http(s) or file URL, or a local path.

    ``str()``/``repr()`` give :attr:`shown`: literal credentials (user info, query) replaced
    by ``***``. :meth:`reveal` gives the full URL on the driver, where it was given.
    """

    __slots__ = ("_url", "shown", "has_secret")

    def __init__(self, url: str, field: str = "index_url", *, allow_path: bool = True) -> None:
        if not isinstance(url, str) or not url.strip():
            raise SGPUConfigError(field, url, "an http(s):// or file:// URL, or an existing local path")
        url = url.strip()
        parts = urlsplit(url)
        if parts.scheme in ("http", "https"):
            if not parts.hostname:
                raise SGPUConfigError(field, masked(url), "an http(s) URL with a host name")
        elif parts.scheme == "file":
            pass
        elif allow_path and not parts.scheme and Path(url).expanduser().exists():
            url = str(Path(url).expanduser().resolve())
        else:
            shown = masked(url) if parts.scheme else url
            raise SGPUConfigError(field, shown, "an http(s):// or file:// URL, or an existing local path")
        self._url: str | None = url
        self.shown = masked(url)
        self.has_secret = self.shown != url

    @classmethod
    def _unpickled(cls, shown: str) -> "IndexURL":
        new = object.__new__(cls)
        new._url, new.shown, new.has_secret = None, shown, True
        return new

    def reveal(self, environ: Mapping[str, str] | None = None) -> str:
        """The full URL (``${VAR}`` read from ``environ``): for the node's installer only, never to show."""
        if self._url is None:
            raise SGPUConfigError(
                "index_url", self.shown, "a URL whose credentials are on this machine",
                "literal credentials in an index URL are dropped when a job spec is pickled; "
                "write them as ${VAR} (read from the environment when the job starts)")
        environ = os.environ if environ is None else environ

        def expand(match: re.Match[str]) -> str:
            name = match.group(0)[2:-1]
            if name not in environ:
                raise SGPUConfigError("index_url", self.shown, f"a URL whose ${{{name}}} is set in the environment")
            return environ[name]

        return _VAR.sub(expand, self._url)

    def __reduce__(self) -> tuple[Any, ...]:
        if self._url is not None and not self.has_secret:
            return (IndexURL, (self._url,))
        return (IndexURL._unpickled, (self.shown,))

    def __str__(self) -> str:
        return self.shown

    def __repr__(self) -> str:
        return f"IndexURL({self.shown!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IndexURL) and (self.shown, self._url) == (other.shown, other._url)

    def __hash__(self) -> int:
        return hash(self.shown)


def masked(url: str) -> str:
    """``url`` with literal credentials (user info, query) replaced by ``***``; ``${VAR}`` stays."""
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        return url
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, sep, password = userinfo.partition(":")
        literal = (not _is_reference(password)) if password else not _is_reference(user)
        if literal:
            netloc = f"{MASK}@{host}"
    query = parts.query
    if query and not _VAR.fullmatch(query):
        query = MASK
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def _index_url(field: str) -> Any:
    def parse(value: Any) -> Any:
        if value is None or isinstance(value, IndexURL):
            return value
        return IndexURL(value, field)

    return BeforeValidator(parse)


def _index_urls(field: str) -> Any:
    def parse(value: Any) -> Any:
        if value is None:
            return ()
        if isinstance(value, (str, IndexURL)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise SGPUConfigError(field, value, "a list of URLs or paths")
        return tuple(v if isinstance(v, IndexURL) else IndexURL(v, f"{field}[{i}]") for i, v in enumerate(value))

    return BeforeValidator(parse)


_Shown = PlainSerializer(lambda v: None if v is None else str(v))
_ShownAll = PlainSerializer(lambda vs: [str(v) for v in vs])
IndexURLField = Annotated[IndexURL | None, _index_url("index_url"), _Shown]
ExtraIndexURLs = Annotated[tuple[IndexURL, ...], _index_urls("extra_index_urls"), _ShownAll]
FindLinks = Annotated[tuple[IndexURL, ...], _index_urls("find_links"), _ShownAll]


class IndexSettings(BaseModel):
    """Where pinned distributions come from: an index (or mirror), extra indexes, find-links."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    index_url: IndexURLField = None
    extra_index_urls: ExtraIndexURLs = ()
    find_links: FindLinks = ()

    def shown(self) -> dict[str, Any]:
        return {"index_url": None if self.index_url is None else str(self.index_url),
                "extra_index_urls": [str(u) for u in self.extra_index_urls],
                "find_links": [str(u) for u in self.find_links]}


def masked_text(text: str) -> str:
    """Any text with the user info of every URL in it masked (for errors that echo what was given)."""
    return re.sub(r"://[^/@\s\"]*@", f"://{MASK}@", text)
