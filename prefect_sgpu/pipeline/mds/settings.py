"""The conversion settings (``columns``, ``compression``, ``size_limit``) and the fingerprint they make.

Settings are checked before any row is read, so a wrong one fails at once rather than
after a long conversion. With the source's content they make a set's fingerprint: the
completion marker records it, a later ``write_mds`` that finds the same one reuses the
set, and ``mds_cache_key`` builds Prefect's cache key from it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.pipeline import sources
from prefect_sgpu.pipeline.mds.storage import FORMAT_VERSION


def check_settings(columns: dict[str, str] | None, compression: str | None,
                    size_limit: int | str | None) -> int | None:
    """Validate settings before any row is read; return the size limit in bytes."""
    from streaming.base.compression import get_compressions
    from streaming.base.format.mds.encodings import get_mds_encodings, is_mds_encoding
    from streaming.base.util import bytes_to_int

    if columns is not None:
        if not isinstance(columns, dict) or not columns:
            raise SGPUConfigError("columns", columns, "None (inferred) or a dict of column name -> MDS encoding")
        for name, encoding in columns.items():
            if not isinstance(name, str) or not isinstance(encoding, str) or not is_mds_encoding(encoding):
                raise SGPUConfigError(f"columns[{name!r}]", encoding,
                                      "an MDS encoding: " + ", ".join(sorted(get_mds_encodings())))
    if compression is not None and compression not in get_compressions():
        raise SGPUConfigError("compression", compression,
                              "None or one of br, bz2, gz, snappy, zstd (optionally with a level, e.g. zstd:7)")
    if size_limit is None:
        return None
    try:
        limit = bytes_to_int(size_limit)
    except (ValueError, TypeError):
        limit = -1
    if not 0 < limit < 2**32:
        raise SGPUConfigError("size_limit", size_limit, "a size between 1 byte and 4 GiB, e.g. '64mb' or 1 << 26")
    return limit


def settings_fingerprint(source_fp: str | None, columns: dict[str, str] | None, compression: str | None,
                          size_limit: int | None) -> str | None:
    """What a finished shard set records of its source and settings, so that a rerun with the same
    ones skips the conversion; None when the source has no fingerprint."""
    if source_fp is None:
        return None
    settings = {"format": FORMAT_VERSION, "source": source_fp, "columns": columns,
                "compression": compression, "size_limit": size_limit}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def set_fingerprint(source: Any, *, columns: dict[str, str] | None = None, compression: str | None = "zstd",
                    size_limit: int | str | None = "64mb") -> str | None:
    """The fingerprint a shard set of ``source`` with these settings gets (None: not hashable)."""
    limit = check_settings(columns, compression, size_limit)
    return settings_fingerprint(sources.fingerprint(source), columns, compression, limit)
