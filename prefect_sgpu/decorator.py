"""``@distributed``: one function, every rank, results in rank order.

Mirrors Databricks' serverless GPU API (``@distributed(gpus=8, gpu_type="H100",
remote=True)`` then ``fn.distributed(...)``) on compute the user owns. Resources and
options are validated when the decorator is applied; arguments are bound against
the signature before anything starts.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import inspect
import os
import threading
from pathlib import Path
from typing import Any, Callable, Generic, ParamSpec, TypeVar, overload

from prefect_sgpu import payload as payload_mod
from prefect_sgpu.compute import Compute
from prefect_sgpu.driver import Job, JobResult
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.logs import RankLogSink
from prefect_sgpu.spec import DEFAULT_TIMEOUT_S, JobOptions, Resources, make_options, make_resources, plan_remote
from prefect_sgpu.store import LocalStore, Store

P = ParamSpec("P")
R = TypeVar("R")

REMOTE_COMPUTE_ENV = "PREFECT_SGPU_REMOTE_COMPUTE"
_RESOURCE_FIELDS = ("gpus", "gpu_type", "nodes", "remote")
_OPTION_FIELDS = ("timeout", "max_restarts", "env", "mlflow")


def resolve_compute(remote: bool, compute: Any | None) -> Compute:
    """The compute to run on: given, a saved block for remote runs, or local processes."""
    if compute is not None:
        return compute.get_compute() if hasattr(compute, "get_compute") else compute
    if not remote:
        from prefect_sgpu.compute.local import LocalCompute

        return LocalCompute()
    ref = os.environ.get(REMOTE_COMPUTE_ENV)
    if ref:
        from prefect.blocks.core import Block

        return Block.load(ref).get_compute()  # type: ignore[attr-defined,no-any-return]
    raise SGPUConfigError(
        "remote", True, "only with a remote compute",
        f"pass compute=EC2Compute.load('NAME') (or RayCompute) or set {REMOTE_COMPUTE_ENV}="
        "'<block-type-slug>/<block-name>'; remote=False runs on this machine",
    )


def resolve_store(compute: Compute, store: Store | None) -> Store:
    if store is not None:
        return store.get_store() if hasattr(store, "get_store") else store
    return compute.default_store() or LocalStore()


class DistributedFuture(Generic[R]):
    """A running ``.submit()``: ``result()`` blocks, ``cancel()`` stops every rank."""

    def __init__(self, future: cf.Future[JobResult], cancel_event: threading.Event) -> None:
        self._future = future
        self._cancel = cancel_event

    def result(self, timeout: float | None = None) -> list[R]:
        return self._future.result(timeout).values

    def job_result(self, timeout: float | None = None) -> JobResult:
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        self._cancel.set()
        return self._future.cancel() or not self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)


_executor: cf.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _pool() -> cf.ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = cf.ThreadPoolExecutor(max_workers=32, thread_name_prefix="sgpu-submit")
        return _executor


class DistributedFunction(Generic[P, R]):
    """A function that runs on every rank; call ``.distributed(...)`` to run it."""

    def __init__(
        self,
        fn: Callable[P, R],
        resources: Resources,
        options: JobOptions,
        compute: Any | None = None,
        store: Store | None = None,
    ) -> None:
        if not callable(fn):
            raise SGPUConfigError("fn", fn, "a function")
        self.func = fn
        self.resources = resources
        self.options = options
        self.compute = compute
        self.store = store
        if resources.remote and compute is None:
            plan_remote(resources)  # whole nodes of a known type, checked now
        functools.update_wrapper(self, fn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        name = getattr(self.func, "__name__", "function")
        raise TypeError(
            f"{name} is a distributed function: call {name}.distributed(...) to run it on "
            f"{self.resources.gpus} rank(s), or {name}.func(...) to call the plain function here"
        )

    def __repr__(self) -> str:
        return f"<DistributedFunction {getattr(self.func, '__qualname__', self.func)} {self.resources!r}>"

    def with_options(self, **changes: Any) -> "DistributedFunction[P, R]":
        """A copy with some resources/options changed (validated like the decorator)."""
        unknown = set(changes) - set(_RESOURCE_FIELDS) - set(_OPTION_FIELDS) - {"compute", "store"}
        if unknown:
            raise SGPUConfigError(
                ", ".join(sorted(unknown)), changes[sorted(unknown)[0]],
                "one of " + ", ".join((*_RESOURCE_FIELDS, *_OPTION_FIELDS, "compute", "store")),
            )
        res = {**self.resources.model_dump(), **{k: v for k, v in changes.items() if k in _RESOURCE_FIELDS}}
        opt = {**self.options.model_dump(), **{k: v for k, v in changes.items() if k in _OPTION_FIELDS}}
        return DistributedFunction(
            self.func, make_resources(**res), make_options(**opt),
            compute=changes.get("compute", self.compute), store=changes.get("store", self.store),
        )

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            inspect.signature(self.func).bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{getattr(self.func, '__name__', 'function')}(): {exc}") from None

    def job(self, *args: Any, cancel_event: threading.Event | None = None,
            sink: RankLogSink | None = None, **kwargs: Any) -> Job:
        """The job a call would run (validated, nothing started)."""
        self._bind(args, kwargs)
        compute = resolve_compute(self.resources.remote, self.compute)
        return Job(
            payload_mod.FunctionCall(self.func, args, kwargs), self.resources, self.options,
            compute, resolve_store(compute, self.store), sink=sink, cancel_event=cancel_event,
        )

    def run(self, *args: P.args, **kwargs: P.kwargs) -> JobResult:
        """Run on every rank and return the full report (values, ranks, MLflow run)."""
        return self.job(*args, **kwargs).run()

    def distributed(self, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run on every rank; return each rank's value in rank order."""
        return self.run(*args, **kwargs).values

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> DistributedFuture[R]:
        """Start the job in the background (sweeps run side by side)."""
        cancel = threading.Event()
        job = self.job(*args, cancel_event=cancel, **kwargs)
        job.prepare()  # bad resources or payload raise here, not in the future
        return DistributedFuture(_pool().submit(job.run), cancel)

    def dry_run(self, *args: P.args, **kwargs: P.kwargs) -> dict[str, Any]:
        """What ``.distributed()`` would start: plan and each node's command. Spends nothing."""
        return self.job(*args, **kwargs).dry_run()


@overload
def distributed(fn: Callable[P, R]) -> DistributedFunction[P, R]: ...


@overload
def distributed(
    fn: None = None, *, gpus: int = 1, gpu_type: str | None = None, remote: bool = False,
    nodes: int | None = None, timeout: float = DEFAULT_TIMEOUT_S, max_restarts: int = 0,
    env: dict[str, str] | None = None, mlflow: bool = True, compute: Any | None = None,
    store: Store | None = None,
) -> Callable[[Callable[P, R]], DistributedFunction[P, R]]: ...


def distributed(
    fn: Callable[P, R] | None = None,
    *,
    gpus: int = 1,
    gpu_type: str | None = None,
    remote: bool = False,
    nodes: int | None = None,
    timeout: Any = DEFAULT_TIMEOUT_S,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
    mlflow: bool = True,
    compute: Any | None = None,
    store: Store | None = None,
) -> Any:
    """Make ``fn`` run on ``gpus`` ranks (``nodes`` x GPUs per node) with torch elastic.

    ``remote=False`` runs on this machine (CPU ranks with gloo when it has no GPU);
    ``remote=True`` runs on the remote compute (an ``EC2Compute`` or ``RayCompute``).
    """
    resources = make_resources(gpus=gpus, gpu_type=gpu_type, nodes=nodes, remote=remote)
    options = make_options(timeout=timeout, max_restarts=max_restarts, env=env or {}, mlflow=mlflow)

    def wrap(f: Callable[P, R]) -> DistributedFunction[P, R]:
        return DistributedFunction(f, resources, options, compute=compute, store=store)

    return wrap(fn) if fn is not None else wrap


def run_script(
    path: str | os.PathLike[str],
    args: list[str] | tuple[str, ...] = (),
    *,
    gpus: int = 1,
    gpu_type: str | None = None,
    remote: bool = False,
    nodes: int | None = None,
    timeout: Any = DEFAULT_TIMEOUT_S,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
    mlflow: bool = True,
    compute: Any | None = None,
    store: Store | None = None,
) -> JobResult:
    """Run an unmodified torchrun script on every rank; raise if any rank exits non-zero."""
    script = Path(path)
    if not script.is_file() or script.suffix != ".py":
        raise SGPUConfigError("path", str(path), "an existing Python file (*.py)")
    resources = make_resources(gpus=gpus, gpu_type=gpu_type, nodes=nodes, remote=remote)
    options = make_options(timeout=timeout, max_restarts=max_restarts, env=env or {}, mlflow=mlflow)
    if remote and compute is None:
        plan_remote(resources)
    resolved = resolve_compute(remote, compute)
    call = payload_mod.ScriptCall(str(script.resolve()), script.read_bytes(), [str(a) for a in args])
    return Job(call, resources, options, resolved, resolve_store(resolved, store)).run()
