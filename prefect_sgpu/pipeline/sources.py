"""Source data for MDS conversion: read rows and fingerprint content.

A source is a file path (``.parquet``, ``.jsonl``/``.ndjson``, ``.json``, ``.csv``,
``.npy``, ``.npz``), a pandas DataFrame, numpy data (a structured array, or a dict
mapping column names to equal-length arrays/lists), or an iterable of dicts. Every
form is read as dict rows in a fixed order, so errors can name the row number.

The fingerprint hashes the *content* (not a path's mtime), so the same data gives
the same cache key wherever it lives; a one-shot iterator cannot be hashed without
consuming it, so it has no fingerprint (and no cache hit).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prefect_sgpu.errors import SGPUConfigError

FILE_SUFFIXES = (".parquet", ".jsonl", ".ndjson", ".json", ".csv", ".npy", ".npz")
Row = dict[str, Any]


def _is_dataframe(source: Any) -> bool:
    return type(source).__name__ == "DataFrame" and hasattr(source, "itertuples")


def _is_ndarray(source: Any) -> bool:
    return type(source).__module__ == "numpy" and type(source).__name__ == "ndarray"


def describe(source: Any) -> str:
    """A short human name for a source, for progress bars and errors."""
    if isinstance(source, (str, Path)):
        return Path(source).name
    if _is_dataframe(source):
        return f"DataFrame[{len(source)} rows]"
    return type(source).__name__


def _check_path(source: str | Path) -> Path:
    path = Path(source)
    if path.suffix.lower() not in FILE_SUFFIXES:
        raise SGPUConfigError("source", str(source), "a file ending in " + ", ".join(FILE_SUFFIXES))
    if not path.is_file():
        raise SGPUConfigError("source", str(source), "an existing file")
    return path


def _load_file(path: Path) -> Any:
    """Tabular files become a DataFrame or numpy data; JSONL stays a row iterator."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _iter_jsonl(path)
    if suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, list):
            raise SGPUConfigError("source", str(path), "a JSON list of objects (or JSONL)")
        return data
    import pandas as pd

    if suffix == ".parquet":
        return pd.read_parquet(path)
    if suffix == ".csv":
        return pd.read_csv(path)
    import numpy as np

    if suffix == ".npy":
        return np.load(path, allow_pickle=False)
    with np.load(path, allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


def _iter_jsonl(path: Path) -> Iterator[Row]:
    with path.open() as fh:
        for line_no, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise SGPUConfigError(f"{path.name} line {line_no + 1}", line[:80], "valid JSON",
                                      str(exc)) from None


def _columnar_rows(columns: Mapping[str, Any]) -> Iterator[Row]:
    for name, values in columns.items():
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or getattr(values, "ndim", 1) == 0:
            raise SGPUConfigError(f"source column {name!r}", type(values).__name__,
                                  "an array or list (a dict source maps column names to equal-length columns)")
    lengths = {str(name): len(values) for name, values in columns.items()}
    if len(set(lengths.values())) > 1:
        raise SGPUConfigError("source", lengths, "columns of equal length")
    names = [str(name) for name in columns]
    for values in zip(*columns.values()):  # iterating arrays side by side, not indexing each
        yield dict(zip(names, values))


def row_count(source: Any) -> int | None:
    """Number of rows when it can be known without reading everything (for progress)."""
    if isinstance(source, (str, Path)):
        path = _check_path(source)
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(path).metadata.num_rows)
        return None
    try:
        if _is_dataframe(source) or _is_ndarray(source) or isinstance(source, (list, tuple)):
            return len(source)
        if isinstance(source, Mapping):
            return len(next(iter(source.values()), []))
    except TypeError:  # a malformed source: iter_rows names the problem
        return None
    return None


def open_rows(source: Any) -> tuple[int | None, Iterator[Row], bool]:
    """The rows of ``source``, their number where it is known, and whether every row has the same
    columns with values of the same type by construction (:func:`typed_columns`), reading a
    file only once."""
    if isinstance(source, (str, Path)):
        path = _check_path(source)
        if path.suffix.lower() in (".jsonl", ".ndjson"):
            with path.open() as fh:  # a cheap pass over the lines gives progress a total
                total = sum(1 for line in fh if line.strip())
            return total, iter_rows(_iter_jsonl(path)), False
        source = _load_file(path)
    return row_count(source), iter_rows(source), typed_columns(source)


def typed_columns(source: Any) -> bool:
    """True when the source is columns of fixed numpy dtypes (no ``object`` dtype): a dict of numpy
    arrays, a structured array, or a DataFrame. Every row then has the same columns, and each
    column's values have one type (and, for array cells, one dtype), so the first rows stand for
    all of them and no row needs checking on its own."""
    if _is_dataframe(source):
        return not any(getattr(dtype, "hasobject", True) for dtype in source.dtypes)
    if _is_ndarray(source):
        return source.dtype.names is not None and not source.dtype.hasobject
    if isinstance(source, Mapping):
        return bool(source) and all(_is_ndarray(v) and v.ndim >= 1 and not v.dtype.hasobject
                                    for v in source.values())
    return False


def iter_rows(source: Any) -> Iterator[Row]:
    """Every row of ``source`` as a dict of column -> value, in order."""
    if isinstance(source, (str, Path)):
        source = _load_file(_check_path(source))
    if _is_dataframe(source):
        names = [str(c) for c in source.columns]
        if len(set(names)) != len(names):
            duplicated = sorted({n for n in names if names.count(n) > 1})
            raise SGPUConfigError("source columns", duplicated, "unique column names")
        for values in source.itertuples(index=False, name=None):
            yield dict(zip(names, values))
        return
    if _is_ndarray(source):
        if source.dtype.names is None:
            raise SGPUConfigError("source", f"ndarray{source.shape}", "a structured array with named "
                                  "fields, or a dict of column name -> array")
        names = list(source.dtype.names)
        for record in source:
            yield {name: record[name] for name in names}
        return
    if isinstance(source, Mapping):
        yield from _columnar_rows(source)
        return
    if isinstance(source, (str, bytes)) or not isinstance(source, Iterable):
        raise SGPUConfigError("source", type(source).__name__, "a file path, DataFrame, numpy data "
                              "or an iterable of dicts")
    for i, row in enumerate(source):
        if not isinstance(row, Mapping):
            raise SGPUConfigError(f"source row {i}", type(row).__name__, "a dict of column -> value")
        yield dict(row)


def _feed(digest: Any, tag: str, data: bytes) -> None:
    """Length-prefixed, so neighbouring values can never run into each other."""
    digest.update(f"{tag}{len(data)}:".encode())
    digest.update(data)


def _update_with(digest: Any, value: Any) -> None:
    """Feed one value to the hash in a type-stable way (arrays by bytes, not repr)."""
    if _is_ndarray(value):
        _feed(digest, "nd", f"{value.dtype.str}{value.shape}".encode())
        _feed(digest, "b", repr(value.tolist()).encode() if value.dtype.hasobject else value.tobytes())
    elif isinstance(value, Mapping):
        _feed(digest, "m", str(len(value)).encode())
        for key in value:
            _feed(digest, "k", str(key).encode())
            _update_with(digest, value[key])
    elif isinstance(value, (list, tuple)):
        _feed(digest, "l", str(len(value)).encode())
        for item in value:
            _update_with(digest, item)
    else:
        _feed(digest, type(value).__name__, repr(value).encode())


def fingerprint(source: Any) -> str | None:
    """A content hash of ``source``; None for one-shot iterators (they cannot be re-read)."""
    digest = hashlib.sha256()
    if isinstance(source, (str, Path)):
        path = _check_path(source)
        digest.update(path.suffix.lower().encode())
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()
    if _is_dataframe(source):
        import pandas as pd

        digest.update(repr(list(source.columns)).encode() + repr(list(source.dtypes)).encode())
        try:
            digest.update(pd.util.hash_pandas_object(source, index=False).to_numpy().tobytes())
        except TypeError:  # unhashable cells (arrays, dicts): hash row by row
            for row in iter_rows(source):
                _update_with(digest, row)
        return digest.hexdigest()
    if _is_ndarray(source) or isinstance(source, (Mapping, list, tuple)):
        _update_with(digest, source)
        return digest.hexdigest()
    return None
