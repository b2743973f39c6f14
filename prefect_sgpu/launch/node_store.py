"""The job store a node's command line names, opened by its URL's scheme.

A node learns its store as a URL (``--store``). :data:`STORES` maps each scheme to the class that
opens it, as a ``"module:Class"`` string imported only when asked: this module imports no cloud.
A path without a scheme (or ``file://``) is a local folder. A new cloud's object store adds one line.
"""

from __future__ import annotations

import importlib
from typing import Any

from prefect_sgpu.store import LocalStore, Store

#: store URL scheme -> the class that opens it (called with the URL and the store's options)
STORES = {"s3": "prefect_sgpu.store_s3:S3Store"}


def open_store(uri: str, **options: Any) -> Store:
    """The store at ``uri``. ``options``: what the command line says of it (for S3: ``region``,
    ``endpoint_url``, ``kms_key_id``, ``bucket_owner``); None values are left out."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme == "file":
        return LocalStore(rest if sep else uri)
    if scheme not in STORES:
        raise ValueError(f"store {uri!r}: no store for scheme {scheme!r} (known: {sorted(STORES)})")
    module, _, cls = STORES[scheme].partition(":")
    return getattr(importlib.import_module(module), cls)(uri, **{k: v for k, v in options.items() if v is not None})
