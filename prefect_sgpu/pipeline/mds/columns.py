"""Column types: MDS encodings inferred from a source's first rows, and every row held to them.

Bad data must fail as :class:`SGPUConfigError` naming the column and the row, not as a
streaming stack trace halfway through a conversion: so the first rows are checked when
types are inferred, every later row is checked against those types, and a value
``MDSWriter`` rejects is traced back to its column.
"""

from __future__ import annotations

from typing import Any

from prefect_sgpu.errors import SGPUConfigError

#: rows looked at to infer column types when ``columns`` is not given
INFER_ROWS = 100

#: Python/numpy kind of a value -> the MDS encoding used when inferring
ENCODING_OF_KIND = {
    "int": "int64",
    "float": "float64",
    "bool": "uint8",
    "str": "str",
    "bytes": "bytes",
    "ndarray": "ndarray",
    "json": "json",
}
#: kinds an inferred column accepts in later rows (an int fits a float column)
_ACCEPTS = {
    "int64": {"int", "bool"},
    "float64": {"float", "int", "bool"},
    "uint8": {"bool"},
    "str": {"str"},
    "bytes": {"bytes"},
    "ndarray": {"ndarray"},
    "json": {"json"},
}
_KINDS_HELP = "an int, float, bool, str, bytes, numpy array, or list/dict (JSON)"


def kind_of(value: Any) -> str:
    """The kind of a value, as far as MDS encodings are concerned."""
    if value is None:
        return "null"
    module = type(value).__module__
    if isinstance(value, bool) or (module == "numpy" and type(value).__name__ == "bool"):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (bytes, bytearray)):
        return "bytes"
    if isinstance(value, (list, dict)):
        return "json"
    if module == "numpy":
        import numpy as np

        if isinstance(value, np.ndarray):
            return "ndarray"
        if isinstance(value, np.integer):
            return "int"
        if isinstance(value, np.floating):
            return "float"
        if isinstance(value, np.str_):
            return "str"
        if isinstance(value, np.bytes_):
            return "bytes"
    return type(value).__name__


def _bad_value(name: str, row: int, value: Any, allowed: str, hint: str | None = None) -> SGPUConfigError:
    text = repr(value)
    return SGPUConfigError(f"column {name!r} at row {row}", text if len(text) <= 80 else text[:77] + "...",
                           allowed, hint)


def infer_columns(rows: list[dict[str, Any]]) -> dict[str, str]:
    """MDS encodings for the columns of ``rows`` (the first rows of a source).

    A column that mixes ints and floats is a float column; any other mix, a null, or a
    value MDS cannot encode is an error naming the column and the row.
    """
    if not rows:
        raise SGPUConfigError("source", "no rows", "at least one row")
    names = list(rows[0])
    kinds: dict[str, str] = {}
    for i, row in enumerate(rows):
        check_row_columns(row, i, names)
        for name in names:
            value = row[name]
            kind = kind_of(value)
            if kind == "null":
                raise _bad_value(name, i, value, f"a value: nulls cannot be encoded; give columns={{{name!r}: "
                                 "'json'}} to keep them, or fill them")
            if kind not in ENCODING_OF_KIND:
                raise _bad_value(name, i, value, _KINDS_HELP,
                                 f"a {type(value).__name__} cannot be encoded; convert it or give columns=")
            if kind == "ndarray":
                _check_ndarray(name, i, value)
            seen = kinds.setdefault(name, kind)
            if seen == kind:
                continue
            if {seen, kind} <= {"int", "float", "bool"}:
                kinds[name] = "float" if "float" in (seen, kind) else "int"
                continue
            first = next(j for j, r in enumerate(rows) if kind_of(r[name]) == seen)
            raise _bad_value(name, i, value, f"a {seen} like row {first} (a column holds one type)")
    return {name: ENCODING_OF_KIND[kinds[name]] for name in names}


def check_row_columns(row: dict[str, Any], i: int, names: list[str]) -> None:
    """Row ``i`` has exactly the columns ``names`` (the writer checks every row before encoding it)."""
    if len(row) != len(names) or any(name not in row for name in names):
        missing = [n for n in names if n not in row]
        extra = [n for n in row if n not in names]
        raise SGPUConfigError(f"row {i}", sorted(row), f"the columns of row 0: {names}",
                              f"missing {missing}" if missing else f"unexpected {extra}")


_NDARRAY_DTYPES = ("uint8", "int8", "uint16", "int16", "float16", "uint32", "int32", "float32",
                   "uint64", "int64", "float64")


def _check_ndarray(name: str, i: int, value: Any) -> None:
    if value.dtype.name not in _NDARRAY_DTYPES:
        raise _bad_value(name, i, value, "a numpy array of dtype " + ", ".join(_NDARRAY_DTYPES),
                         f"its dtype is {value.dtype.name}; convert it with .astype()")


def check_value(name: str, encoding: str, i: int, value: Any) -> None:
    """An inferred column must keep its type in every row (not only the first ones)."""
    kind = kind_of(value)
    if kind not in _ACCEPTS[encoding]:
        raise _bad_value(name, i, value, f"a value of the column's type ({encoding}, inferred from the first "
                         f"rows)", "give columns= to set types explicitly" if kind != "null" else
                         "nulls cannot be encoded")
    if kind == "ndarray":
        _check_ndarray(name, i, value)


def encoding_error(row: dict[str, Any], i: int, columns: dict[str, str], exc: Exception) -> SGPUConfigError:
    """Find which column of a row MDSWriter could not encode."""
    from streaming.base.format.mds.encodings import mds_encode

    for name, encoding in columns.items():
        if name not in row:
            return SGPUConfigError(f"row {i}", sorted(row), f"a value for every column in columns: missing {name!r}")
        try:
            mds_encode(encoding, row[name])
        except Exception as col_exc:  # noqa: BLE001 - every encoder failure is the user's value
            return _bad_value(name, i, row[name], f"a value MDS can encode as {encoding!r}",
                              f"{type(col_exc).__name__}: {col_exc}")
    return SGPUConfigError(f"row {i}", "a row", "a row MDS can encode", f"{type(exc).__name__}: {exc}")
