"""``@distributed``: one function, every rank, results in rank order.

Mirrors Databricks' serverless GPU API (``@distributed(gpus=8, gpu_type="H100",
remote=True)`` then ``fn.distributed(...)``) on compute the user owns. Resources and
options are validated when the decorator is applied; arguments are bound against
the signature before anything starts.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import contextvars
import functools
import inspect
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Generic, ParamSpec, TypeVar, overload

from typing_extensions import Unpack

from prefect_sgpu.protocol import payload as payload_mod
from prefect_sgpu import spec as spec_mod
from prefect_sgpu.driver.job import Job, JobResult
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.observe.logs import RankLogSink
from prefect_sgpu.resolve import REMOTE_COMPUTE_ENV, resolve
from prefect_sgpu.spec import JobArgs, JobSpec, SpecLayer
from prefect_sgpu.store import Store

P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["REMOTE_COMPUTE_ENV", "DistributedFunction", "DistributedFuture", "distributed", "run_job", "run_script"]


class DistributedFuture(Generic[R]):
    """A running ``.submit()``: ``result()`` blocks, ``cancel()`` stops every rank."""

    def __init__(self, future: cf.Future[JobResult], cancel_event: threading.Event) -> None:
        self._future = future
        self._cancel = cancel_event

    def result(self, timeout: float | None = None) -> list[R]:
        return self.job_result(timeout).values

    def job_result(self, timeout: float | None = None) -> JobResult:
        try:
            return self._future.result(timeout)
        except KeyboardInterrupt:  # Ctrl-C (or SIGTERM) while waiting: stop every job of this driver
            from prefect_sgpu.driver import interrupts

            interrupts.cancel_all("interrupted while waiting for a job")
            raise

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        self._cancel.set()
        return self._future.cancel() or not self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)


def run_job(job: Job, live: bool = True) -> JobResult:
    """Run ``job`` and wait, with its live status line where ``live``. Inside a flow or task run it
    counts as that run's GPU job (quota slots, ``prefect-sgpu.job.*`` events, progress and
    artifacts: :mod:`prefect_sgpu.adapters.reports`)."""
    from prefect_sgpu.adapters import reports

    if reports.in_prefect_run():
        return reports.run_reported(job, live=live)
    from prefect_sgpu.observe.live import LiveStatus

    with LiveStatus(job) if live else contextlib.nullcontext():
        return job.run()


def _start(job: Job) -> cf.Future[JobResult]:
    """Run ``job`` in a thread of its own: no pool cap that would queue a sweep's jobs unseen.

    The thread is not a daemon: at interpreter exit Python waits for it, after the exit
    hook of :mod:`prefect_sgpu.driver.interrupts` has cancelled the job (so the wait is its cleanup).
    """
    future: cf.Future[JobResult] = cf.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(run_job(job, live=False))  # jobs side by side: no live line each
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)

    # the caller's context (a flow or task run's) goes along: the job's log lines reach that run
    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(run,), name=f"sgpu-submit-{job.run_id}").start()
    return future


def describe_environment(spec: JobSpec) -> dict[str, Any]:
    """The environment of a job's nodes for a dry run: captured for remote nodes (no secrets, no file
    lists), or a line saying that local nodes run in the driver's own environment."""
    from prefect_sgpu.environment import Environment

    if isinstance(spec.environment, Environment):
        return spec.environment.describe()
    return {"mode": "local", "note": "local nodes run in this driver's own Python environment"}


def _check_remote_fit(layer: SpecLayer, compute: Any | None) -> None:
    """``remote=True`` without a compute: whole catalog instances must fit, checked at decoration."""
    if layer.given().get("remote") and compute is None:
        spec_mod.plan_remote(spec_mod.build(layer))


class DistributedFunction(Generic[P, R]):
    """A function that runs on every rank; call ``.distributed(...)`` to run it."""

    def __init__(
        self,
        fn: Callable[P, R],
        layer: SpecLayer,
        compute: Any | None = None,
        store: Store | Any | None = None,
    ) -> None:
        if not callable(fn):
            raise SGPUConfigError("fn", fn, "a function")
        self.func = fn
        self.layer = layer
        self.compute = compute
        self.store = store
        _check_remote_fit(layer, compute)
        functools.update_wrapper(self, fn)

    @property
    def spec(self) -> JobSpec:
        """The job spec a call would run with now (the environment layer included)."""
        return spec_mod.build(self.layer)

    #: what the function is, and what ``.distributed(...)`` does with it, for the error of a plain call
    _kind = "distributed function"

    def _runs(self) -> str:
        return f"run it on {self.spec.gpus} rank(s)"

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        name = getattr(self.func, "__name__", "function")
        raise TypeError(f"{name} is a {self._kind}: call {name}.distributed(...) to {self._runs()}, "
                        f"or {name}.func(...) to call the plain function here")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {getattr(self.func, '__qualname__', self.func)} {self.layer.given()!r}>"

    def _changed(self, changes: dict[str, Any]) -> tuple[SpecLayer, Any, Any]:
        compute = changes.pop("compute", self.compute)
        store = changes.pop("store", self.store)
        layer = spec_mod.layer("call", **{**self.layer.given(), **changes})
        return layer, compute, store

    def with_options(self, **changes: Any) -> "DistributedFunction[P, R]":
        """A copy with some resources/options changed (validated like the decorator)."""
        layer, compute, store = self._changed(changes)
        return DistributedFunction(self.func, layer, compute=compute, store=store)

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            inspect.signature(self.func).bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{getattr(self.func, '__name__', 'function')}(): {exc}") from None

    def job(self, *args: Any, cancel_event: threading.Event | None = None,
            sink: RankLogSink | None = None, **kwargs: Any) -> Job:
        """The job a call would run (validated, nothing started)."""
        if "prefect" in sys.modules:  # else no flow or task run can be current here: Prefect's import is not paid
            from prefect_sgpu.adapters import run_logs

            run_logs.attach()
        self._bind(args, kwargs)
        compute, store = resolve(self.spec, self.compute, self.store)
        spec = spec_mod.for_compute(compute, self.layer)  # the block's environment=, captured for remote nodes
        return Job(payload_mod.FunctionCall(self.func, args, kwargs), spec, compute, store, sink=sink,
                   cancel_event=cancel_event)

    def run(self, *args: P.args, **kwargs: P.kwargs) -> JobResult:
        """Run on every rank and return the full report (values, ranks, MLflow run)."""
        return run_job(self.job(*args, **kwargs))

    def distributed(self, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run on every rank; return each rank's value in rank order."""
        return self.run(*args, **kwargs).values

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> DistributedFuture[R]:
        """Start the job in the background (sweeps run side by side)."""
        from prefect_sgpu.driver import interrupts

        cancel = threading.Event()
        job = self.job(*args, cancel_event=cancel, **kwargs)
        job.prepare()  # bad resources or payload raise here, not in the future
        job.secret_values()  # and so does a Secret block that cannot be read
        interrupts.install()  # from the caller's (main) thread: signal handlers and the exit hook
        return DistributedFuture(_start(job), cancel)

    def dry_run(self, *args: P.args, **kwargs: P.kwargs) -> dict[str, Any]:
        """What ``.distributed()`` would start: the request, each node's command and the environment the
        nodes need (digest, Python, counts, index URLs masked). Spends nothing."""
        job = self.job(*args, **kwargs)
        return {**job.dry_run(), "environment": describe_environment(job.spec)}


@overload
def distributed(fn: Callable[P, R]) -> DistributedFunction[P, R]: ...


@overload
def distributed(
    fn: None = None, *, compute: Any | None = None, store: Any | None = None, **given: Unpack[JobArgs]
) -> Callable[[Callable[P, R]], DistributedFunction[P, R]]: ...


def distributed(
    fn: Callable[P, R] | None = None,
    *,
    compute: Any | None = None,
    store: Any | None = None,
    **given: Unpack[JobArgs],
) -> Any:
    """Make ``fn`` run on ``gpus`` ranks (``nodes`` x GPUs per node) with torch elastic.

    ``remote=False`` runs on this machine (CPU ranks with gloo when it has no GPU);
    ``remote=True`` runs on the remote compute (an ``EC2Compute`` or ``RayCompute``).
    Arguments not given come from ``PREFECT_SGPU_<FIELD>`` or the built-in defaults
    (1 GPU, 3 h timeout; see :mod:`prefect_sgpu.spec`).
    """
    layer = spec_mod.layer("call", **given)

    def wrap(f: Callable[P, R]) -> DistributedFunction[P, R]:
        return DistributedFunction(f, layer, compute=compute, store=store)

    return wrap(fn) if fn is not None else wrap


def run_script(
    path: str | os.PathLike[str],
    args: list[str] | tuple[str, ...] = (),
    *,
    compute: Any | None = None,
    store: Any | None = None,
    **given: Unpack[JobArgs],
) -> JobResult:
    """Run an unmodified torchrun script on every rank; raise if any rank exits non-zero."""
    script = Path(path)
    if not script.is_file() or script.suffix != ".py":
        raise SGPUConfigError("path", str(path), "an existing Python file (*.py)")
    call_layer = spec_mod.layer("call", **given)
    resolved, resolved_store = resolve(spec_mod.build(call_layer), compute, store)
    spec = spec_mod.for_compute(resolved, call_layer, script=str(script.resolve()))
    call = payload_mod.ScriptCall(str(script.resolve()), script.read_bytes(), [str(a) for a in args])
    return run_job(Job(call, spec, resolved, resolved_store))
