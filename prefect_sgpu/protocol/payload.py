"""What travels between the driver and the ranks: cloudpickle of the call, and result envelopes.

The driver pickles the function and its arguments once; every rank loads the same
bytes from the store. Each rank writes one *envelope* back: its return value, or
its exception with the remote traceback. This module only pickles and explains what
cannot be pickled; :mod:`prefect_sgpu.protocol.jobfolder` seals both directions with the job's
key, bound to the job and the rank, before anything is unpickled.
"""

from __future__ import annotations

import inspect
import io
import os
import pickle
import threading
import types
from collections import ChainMap
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from prefect_sgpu.errors import PayloadError, PayloadImportError, ResultRefused
from prefect_sgpu.protocol import safe_pickle

_BY_VALUE_LOCK = threading.RLock()
DEFAULT_MAX_PAYLOAD_BYTES = 64 * 1024 * 1024


def max_payload_bytes() -> int:
    mb = os.environ.get("PREFECT_SGPU_MAX_PAYLOAD_MB")
    return int(float(mb) * 1024 * 1024) if mb else DEFAULT_MAX_PAYLOAD_BYTES


#: the file name cloudpickle >= 3.1.3 gives every code object it ships by value
DYNAMIC_CODE = "<dynamic-code>"


def _code_reduce_keeping_filename(code: types.CodeType) -> Any:
    """cloudpickle's reduction of a code object, with the code's own file name.

    cloudpickle >= 3.1.3 writes ``<dynamic-code>`` for every function shipped by value
    (to make payloads deterministic); a rank's traceback then names no file and shows no
    source line. The file name is put back, so a user's traceback reads as it would locally.
    """
    from cloudpickle import cloudpickle as cp

    rebuild, args = cp._code_reduce(code)
    return rebuild, tuple(code.co_filename if isinstance(a, str) and a == DYNAMIC_CODE else a for a in args)


@lru_cache(maxsize=1)
def _pickler_class() -> type:
    """Built once per process (every payload and every result envelope goes through it)."""
    import cloudpickle

    class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
        dispatch_table = ChainMap({types.CodeType: _code_reduce_keeping_filename}, cloudpickle.Pickler.dispatch_table)

    return _Pickler


def _dumps(obj: Any) -> bytes:
    import cloudpickle

    if not hasattr(getattr(cloudpickle, "cloudpickle", None), "_code_reduce"):
        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buffer = io.BytesIO()
    _pickler_class()(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _referenced_globals(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _referenced_globals(const)
    return names


def _culprit_in_function(fn: Callable[..., Any]) -> str | None:
    """Name the captured variable or global that makes ``fn`` unpicklable."""
    target = inspect.unwrap(fn)
    code = getattr(target, "__code__", None)
    if code is None:
        return None
    qual = getattr(target, "__qualname__", repr(target))
    for name, cell in zip(code.co_freevars, getattr(target, "__closure__", None) or ()):
        try:
            _dumps(cell.cell_contents)
        except Exception as exc:  # noqa: BLE001 - any pickling failure names the culprit
            return f"variable {name!r} captured by {qual} ({type(cell.cell_contents).__name__}: {exc})"
    fn_globals = getattr(target, "__globals__", {})
    for name in sorted(_referenced_globals(code)):
        if name not in fn_globals:
            continue
        value = fn_globals[name]
        if isinstance(value, types.ModuleType):
            continue
        try:
            _dumps(value)
        except Exception as exc:  # noqa: BLE001
            return f"global {name!r} used by {qual} ({type(value).__name__}: {exc})"
    return None


@dataclass
class FunctionCall:
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", getattr(self.fn, "__name__", "function"))


@dataclass
class ScriptCall:
    path: str
    source: bytes
    argv: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return Path(self.path).name


def _user_module(fn: Any) -> types.ModuleType | None:
    """The module of ``fn`` when it is the user's own code rather than an installed package.

    Such modules may not exist on the nodes (a notebook folder, a test directory), so
    their functions travel by value instead of as an import reference.
    """
    import sys
    import sysconfig

    name = getattr(inspect.unwrap(fn), "__module__", None)
    module = sys.modules.get(name or "")
    path = getattr(module, "__file__", None)
    if module is None or name == "__main__" or not path or name.startswith("prefect_sgpu"):
        return None
    installed = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    resolved = str(Path(path).resolve())
    if any(resolved.startswith(str(Path(p).resolve())) for p in installed if p):
        return None
    return module


def build(call: FunctionCall | ScriptCall, limit: int | None = None) -> bytes:
    """Pickle a call, or explain exactly what cannot be shipped."""
    import cloudpickle

    limit = max_payload_bytes() if limit is None else limit
    module = _user_module(call.fn) if isinstance(call, FunctionCall) else None
    with _BY_VALUE_LOCK:  # cloudpickle's by-value registry is process-wide
        if module is not None:
            cloudpickle.register_pickle_by_value(module)
        try:
            body = _dumps(call)
        except Exception as exc:  # noqa: BLE001
            raise PayloadError(_explain_unpicklable(call, exc)) from exc
        finally:
            if module is not None:
                cloudpickle.unregister_pickle_by_value(module)
    if len(body) > limit:
        raise PayloadError(_explain_too_large(call, len(body), limit))
    return body


def load(body: bytes) -> FunctionCall | ScriptCall:
    """The call from a payload body that the job folder has already verified.

    A module the payload refers to that this process cannot import is a :class:`PayloadImportError`
    naming it; the driver, reading it back, adds where it imports that module from and how to ship it.
    """
    try:
        return pickle.loads(body)
    except ModuleNotFoundError as exc:
        if not exc.name:
            raise
        raise PayloadImportError(exc.name, str(exc)) from exc


def _explain_unpicklable(call: FunctionCall | ScriptCall, exc: Exception) -> str:
    if isinstance(call, FunctionCall):
        parts: list[tuple[str, Any]] = [(f"argument {i}", a) for i, a in enumerate(call.args)]
        parts += [(f"argument {k!r}", v) for k, v in call.kwargs.items()]
        try:
            bound = inspect.signature(call.fn).bind_partial(*call.args, **call.kwargs)
            parts = [(f"argument {k!r}", v) for k, v in bound.arguments.items()]
        except (TypeError, ValueError):
            pass
        for label, value in parts:
            try:
                _dumps(value)
            except Exception as inner:  # noqa: BLE001
                return (
                    f"{label} of {call.name} cannot be pickled ({type(value).__name__}: {inner}); "
                    "pass something picklable (a path, a config) and build the object inside the function"
                )
        culprit = _culprit_in_function(call.fn)
        if culprit:
            return (
                f"function {call.name} cannot be pickled: {culprit}; "
                "create that object inside the function instead of capturing it"
            )
    return f"{call.name} cannot be pickled with cloudpickle: {exc}"


def _explain_too_large(call: FunctionCall | ScriptCall, size: int, limit: int) -> str:
    mib = 1024 * 1024
    text = (
        f"payload of {call.name} is {size / mib:.1f} MiB, over the {limit / mib:.0f} MiB limit "
        "(PREFECT_SGPU_MAX_PAYLOAD_MB): load data inside the function (from files, S3 or a "
        "dataset) instead of passing it as an argument or capturing it"
    )
    if isinstance(call, FunctionCall):
        sizes = [(f"argument {i}", a) for i, a in enumerate(call.args)]
        sizes += [(f"argument {k!r}", v) for k, v in call.kwargs.items()]
        measured = [(len(_dumps(v)), label) for label, v in sizes]
        measured.append((len(_dumps(call.fn)), f"the function {call.name} and what it captures"))
        biggest = max(measured)
        text += f"; the largest part is {biggest[1]} ({biggest[0] / mib:.1f} MiB)"
    return text


# --- result envelopes ---------------------------------------------------------


@dataclass
class Envelope:
    """One rank's outcome, written by the rank, read by the driver.

    The value and the exception are pickled separately so that an exception class
    the driver cannot import still leaves rank, host and traceback readable.
    """

    rank: int
    node: int
    local_rank: int
    host: str
    ok: bool
    value_blob: bytes | None = None
    exception_blob: bytes | None = None
    exc_type: str | None = None
    exc_message: str | None = None
    traceback: str | None = None
    exit_code: int = 0
    started: float = 0.0
    finished: float = 0.0
    #: rank 0's report of the gang check (:mod:`prefect_sgpu.observe.gang_check`), where it ran
    gang_check: dict[str, Any] | None = None
    #: the world size the rank ran in (an elastic job's changes between rounds); 0: not told
    world_size: int = 0

    def value(self, trusted: bool = False) -> Any:
        """The rank's return value: plain data only (:mod:`prefect_sgpu.protocol.safe_pickle`), unless the
        job trusts its ranks; a refused global is a :class:`ResultRefused` naming the rank, and never runs."""
        if self.value_blob is None:
            return None
        try:
            return safe_pickle.loads(self.value_blob, trusted)
        except safe_pickle.GlobalRefused as exc:
            raise ResultRefused(self.rank, exc.global_name, "result") from None

    def exception(self, trusted: bool = False) -> BaseException | None:
        """The rank's own exception where its class loads here (builtins' and prefect_sgpu's by default,
        any with ``trusted``); else None, and the caller rebuilds it from type name, message and traceback."""
        if self.exception_blob is None:
            return None
        try:
            exc = safe_pickle.loads(self.exception_blob, trusted)
        except Exception:  # noqa: BLE001 - class refused or not importable here
            return None
        return exc if isinstance(exc, BaseException) else None

    def refused_exception_global(self) -> str | None:
        """The global that kept the rank's exception from loading by default, where one did."""
        if self.exception_blob is None:
            return None
        try:
            safe_pickle.restricted_loads(self.exception_blob)
        except safe_pickle.GlobalRefused as exc:
            return exc.global_name
        except Exception:  # noqa: BLE001 - not a refusal
            return None
        return None


def success_envelope(base: dict[str, Any], value: Any) -> Envelope:
    try:
        blob = _dumps(value)
    except Exception as exc:  # noqa: BLE001
        return Envelope(
            **base, ok=False, exit_code=1, exc_type="prefect_sgpu.errors.PayloadError",
            exc_message=f"the return value of rank {base['rank']} ({type(value).__name__}) "
            f"cannot be pickled: {exc}",
        )
    return Envelope(**base, ok=True, value_blob=blob)


def failure_envelope(base: dict[str, Any], exc: BaseException, tb: str, exit_code: int) -> Envelope:
    try:
        blob: bytes | None = _dumps(exc)
    except Exception:  # noqa: BLE001 - keep type, message and traceback
        blob = None
    cls = type(exc)
    return Envelope(
        **base, ok=False, exception_blob=blob, exc_type=f"{cls.__module__}.{cls.__qualname__}",
        exc_message=str(exc), traceback=tb, exit_code=exit_code,
    )


#: a rank's exception as the driver's own class, from type name and message (no code of the class runs)
rebuild_exception = safe_pickle.rebuild_exception


def dump_envelope(env: Envelope) -> bytes:
    return pickle.dumps(env, protocol=pickle.HIGHEST_PROTOCOL)


def load_envelope(body: bytes, rank: int | None = None) -> Envelope:
    """An envelope from a body the job folder has already verified (sealed by a rank of this job).

    Any rank holds the job's key, so the envelope itself loads with the allow-list of plain data plus
    :class:`Envelope`; its value and exception load later, by :meth:`Envelope.value`/:meth:`Envelope.exception`.
    """
    try:
        env = safe_pickle.restricted_loads(body, extra=(Envelope,))
    except safe_pickle.GlobalRefused as exc:
        raise ResultRefused(rank, exc.global_name, "envelope") from None
    if not isinstance(env, Envelope):
        raise ResultRefused(rank, f"{type(env).__module__}.{type(env).__qualname__}", "envelope")
    return env
