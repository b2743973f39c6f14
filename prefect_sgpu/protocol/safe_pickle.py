"""Loading what a rank sends back without running the rank's code in the driver.

Every rank of a job holds the job's key, so a sealed result only proves that *some* rank of the job
wrote it. ``pickle.loads`` of such a body would call whatever global the body names (``os.system``,
``subprocess.Popen``, a user class's ``__reduce__``) inside the driver, the process that holds the
store-wide driver policy, the Prefect API key and the checkpoint secret. Results, exceptions and the
envelope around them are therefore loaded with :class:`RestrictedUnpickler`, whose ``find_class`` resolves
only the globals of plain data:

- builtins' plain types (int, float, complex, bool, str, bytes, bytearray, list, tuple, dict, set,
  frozenset, slice, range) and builtins' exception classes;
- ``collections`` OrderedDict, defaultdict, deque and Counter (a defaultdict's factory is a global too,
  and is checked the same way);
- ``datetime`` (date, time, datetime, timedelta, timezone), ``decimal.Decimal``, ``fractions.Fraction``,
  ``uuid.UUID``, ``pathlib`` paths (constructing one does no I/O);
- numpy arrays, dtypes and scalars (the reconstructors of numpy 1 and 2);
- torch tensors, storages, dtypes, devices and sizes: torch's own ``weights_only`` allow-list
  (``torch._weights_only_unpickler``), and any class the driver registered with
  ``torch.serialization.add_safe_globals`` (of any module: the driver's own choice). A
  storage inside a pickled tensor is torch's legacy save format, which torch loads with
  ``weights_only=False``; it is loaded here with ``weights_only=True`` instead;
- the exception classes of :mod:`prefect_sgpu` itself (:mod:`prefect_sgpu.errors` and its other modules).

Classes made with ``collections.namedtuple``, dataclasses and every other user-defined class are refused:
they live in the job's own modules, which is exactly where a hostile ``__reduce__`` would. A job whose
ranks return such objects, and whose ranks the caller trusts as much as the driver, opts in with
``trusted_results=True`` (docs/security.md), which loads with plain :mod:`pickle`.
"""

from __future__ import annotations

import builtins
import importlib
import io
import pickle
import sys
from functools import lru_cache
from typing import Any, Iterable

#: exact ``module.name`` globals that load as plain data
_PLAIN = frozenset({
    *(f"builtins.{n}" for n in ("int", "float", "complex", "bool", "str", "bytes", "bytearray", "list", "tuple",
                                "dict", "set", "frozenset", "slice", "range")),
    "collections.OrderedDict", "collections.defaultdict", "collections.deque", "collections.Counter",
    "datetime.date", "datetime.time", "datetime.datetime", "datetime.timedelta", "datetime.timezone",
    "decimal.Decimal", "fractions.Fraction", "uuid.UUID", "uuid.SafeUUID",
    *(f"{m}.{n}" for m in ("pathlib", "pathlib._local")
      for n in ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath")),
    # ``copyreg._reconstructor`` is left out: protocol 2 and later (what the ranks write) never need it;
    # ``_codecs.encode`` is how protocol 2 writes bytes, and only encodes
    "_codecs.encode",
    *(f"{m}.{n}" for m in ("numpy.core.multiarray", "numpy._core.multiarray") for n in ("_reconstruct", "scalar")),
    "numpy.core.numeric._frombuffer", "numpy._core.numeric._frombuffer",
    "numpy.ndarray", "numpy.dtype",
})

#: what a refusal names as allowed
ALLOWED_SUMMARY = ("builtins' plain types and exceptions, collections, datetime, decimal, fractions, uuid, "
                   "pathlib, numpy arrays, torch tensors and prefect_sgpu's errors")


class GlobalRefused(pickle.UnpicklingError):
    """A body named a global outside the allow-list; nothing of it was called."""

    def __init__(self, global_name: str) -> None:
        self.global_name = global_name
        super().__init__(f"{global_name} is not on the allow-list of plain data ({ALLOWED_SUMMARY})")


def _load_storage_from_bytes(data: bytes) -> Any:
    """``torch.storage._load_from_bytes`` with torch's own restricted unpickler."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


@lru_cache(maxsize=1)
def _torch_allowed() -> dict[str, Any]:
    """torch's ``weights_only`` allow-list as ``module.name`` -> object, imported only when a body names torch."""
    import torch

    allowed: dict[str, Any] = {}
    rules = importlib.import_module("torch._weights_only_unpickler")
    get_allowed = getattr(rules, "_get_allowed_globals", None)
    if callable(get_allowed):
        allowed.update(get_allowed())
    allowed.update({"torch.Size": torch.Size, "torch.device": torch.device})
    # a pickled tensor's storage: torch's legacy save format, loaded with torch's own restricted unpickler
    allowed["torch.storage._load_from_bytes"] = _load_storage_from_bytes
    return allowed


def _torch_safe_globals() -> Iterable[tuple[str, Any]]:
    """What the user registered with ``torch.serialization.add_safe_globals`` (read at every load)."""
    import torch.serialization

    for entry in getattr(torch.serialization, "get_safe_globals", lambda: [])():
        obj, name = (entry if isinstance(entry, tuple) else (entry, None))
        yield name or f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}", obj


def _resolve(module: str, name: str) -> Any:
    __import__(module)
    obj: Any = sys.modules[module]
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose globals are only those of plain data; ``extra`` adds exact classes."""

    def __init__(self, file: Any, extra: Iterable[type] = ()) -> None:
        super().__init__(file)
        self._extra = {f"{c.__module__}.{c.__qualname__}": c for c in extra}

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in self._extra:
            return self._extra[full]
        if full in _PLAIN:
            return _resolve(module, name)
        if module == "builtins":
            obj = getattr(builtins, name, None)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                return obj
        elif module.startswith("prefect_sgpu.") and "." not in name:  # this package's own error classes
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                return obj
        elif module == "torch" or module.startswith("torch."):
            allowed = _torch_allowed()
            if full in allowed:
                return allowed[full]
        if "torch.serialization" in sys.modules:  # what the driver registered for torch.load, of any module
            for known, obj in _torch_safe_globals():
                if known == full:
                    return obj
        raise GlobalRefused(full)


def restricted_loads(body: bytes, extra: Iterable[type] = ()) -> Any:
    """``pickle.loads`` that refuses (:class:`GlobalRefused`) every global outside the allow-list."""
    return RestrictedUnpickler(io.BytesIO(body), extra).load()


def loads(body: bytes, trusted: bool = False) -> Any:
    """A rank's value or exception: restricted by default, plain :mod:`pickle` where the job trusts its ranks."""
    return pickle.loads(body) if trusted else restricted_loads(body)


def rebuild_exception(type_name: str | None, message: str | None) -> Exception | None:
    """A rank's exception rebuilt from its type name and message, as the class the driver itself imported.

    Only a class already in this process's ``sys.modules`` (nothing is imported for it), reached by its
    qualified name (no ``<locals>``) and an :class:`Exception` subclass, is used; the instance is made with
    ``BaseException.__new__`` and its ``args`` set to the message, so none of the class's own code (its
    ``__new__``, ``__init__``, ``__setstate__``) runs. Attributes beyond the message are not rebuilt (they
    travel only with ``trusted_results=True``). None where no such class is found.
    """
    if not type_name or "<" in type_name:
        return None
    module_name, cls = "", None
    parts = type_name.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest module prefix this process has imported
        module_name = ".".join(parts[:cut])
        module = sys.modules.get(module_name)
        if module is None:
            continue
        obj: Any = module
        for part in parts[cut:]:
            obj = getattr(obj, part, None) if isinstance(obj, (type, type(sys))) else None
        cls = obj
        break
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return None
    try:
        exc = BaseException.__new__(cls)
        exc.args = (message or "",)
    except Exception:  # noqa: BLE001 - a class whose layout BaseException cannot fill
        return None
    return exc
