"""Prefect tasks that run as gang-launched multi-node jobs.

Prefect's own task engine stays in charge: a GPU task is an ordinary Prefect task
whose body, on the driver, launches the distributed job and waits for it. States,
retries (a retry relaunches the whole gang), caching (a hit launches nothing),
result persistence, ``wait_for`` and ``.map()`` are Prefect's; the ranks run only the
user's function and never see the Prefect API or its key. The task runner decides
*where* jobs run (its compute) and runs every other task in threads, as Prefect's
thread-pool runner does.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import threading
from typing import Any, Callable, Iterable, TypeVar

from typing_extensions import Unpack

from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import Task

from prefect_sgpu.protocol import payload as payload_mod
from prefect_sgpu import spec as spec_mod
from prefect_sgpu.adapters import reports
from prefect_sgpu.adapters.reports import slug
from prefect_sgpu.driver.job import Job
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.observe.logs import RankLogSink
from prefect_sgpu.resolve import COMPUTE_ENV, STORE_ENV, as_compute, resolve
from prefect_sgpu.spec import FIELDS, JobSpec, SpecLayer, TaskArgs
from prefect_sgpu.store import LocalStore, Store

R = TypeVar("R")
logger = logging.getLogger("prefect_sgpu.task_runner")

__all__ = ["COMPUTE_ENV", "STORE_ENV", "GPUTask", "GPUTaskRunner", "gpu_task", "run_gpu_call", "run_gpu_job"]


class GPUTask(Task):  # type: ignore[type-arg]
    """A Prefect task that carries GPU resources (``task.sgpu``)."""

    #: what the task itself gave (the task layer of its job spec)
    sgpu: SpecLayer

    def with_options(self, **changes: Any) -> "GPUTask":  # type: ignore[override]
        """Prefect's options plus GPU ones: ``gpus``, ``gpu_type``, ``nodes``, ``strategy``, ..."""
        gpu_changes = {k: changes.pop(k) for k in list(changes) if k in FIELDS}
        new = super().with_options(**changes)
        new.task_key = self.task_key  # the same user function, whatever Prefect hashed
        return _as_gpu_task(new, spec_mod.layer("task", **{**self.sgpu.given(), **gpu_changes}))


def _as_gpu_task(task: Task, layer: SpecLayer) -> GPUTask:
    new = copy.copy(task)
    new.__class__ = GPUTask
    if not getattr(new.fn, "__sgpu_launcher__", False):
        new.fn = _launcher(task.fn)
    new.sgpu = layer
    return new  # type: ignore[return-value]


def _launcher(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The body Prefect's engine runs on the driver: launch ``fn`` on every rank, wait."""

    @functools.wraps(fn)
    def launch_distributed(*args: Any, **kwargs: Any) -> Any:
        from prefect.context import TaskRunContext

        ctx = TaskRunContext.get()
        layer = getattr(ctx.task, "sgpu", None) if ctx else None
        return run_gpu_job(fn, args, kwargs, layer)

    launch_distributed.__sgpu_launcher__ = True  # type: ignore[attr-defined]
    return launch_distributed


def gpu_task(fn: Callable[..., R] | None = None, **options: Any) -> Any:
    """A Prefect task whose function runs on every rank of a multi-node job.

    GPU keywords are those of :class:`~prefect_sgpu.spec.TaskArgs` (``gpus``, ``gpu_type``,
    ``nodes``, ``remote``, ``strategy``, ``timeout``, ``max_restarts``, ``env``, ``mlflow``,
    ``environment``, ``return_all``). Accepts every ``@task`` keyword (retries, cache_policy, persist_result, ...). The
    task's value is rank 0's result, or every rank's with ``return_all=True``.
    ``strategy`` is handed to the ranks as ``SGPU_STRATEGY`` for the training helpers.
    What the task does not give comes from the task runner, then ``PREFECT_SGPU_<FIELD>``,
    then the built-in defaults (see :mod:`prefect_sgpu.spec`).
    """
    from prefect import task as prefect_task

    layer = spec_mod.layer("task", **{k: options.pop(k) for k in list(options) if k in FIELDS})
    task_kwargs = options

    def wrap(f: Callable[..., R]) -> GPUTask:
        return _as_gpu_task(prefect_task(f, **task_kwargs), layer)

    return wrap(fn) if fn is not None else wrap


# --- running one GPU task -------------------------------------------------------


def _current_runner() -> "GPUTaskRunner | None":
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    runner = getattr(ctx, "task_runner", None) if ctx else None
    return runner if isinstance(runner, GPUTaskRunner) else None


def _checkpoint_dir(store: Store, spec_env: dict[str, str], call_digest: str) -> dict[str, str]:
    """A checkpoint location stable across retries of the same task in the same flow run.

    Task retries keep the task run; a flow-run retry (the UI's Retry) keeps the flow run
    id but makes new task runs, so the location is keyed by flow run, task and inputs. It
    is on the job's store: a folder next to the local store's jobs, or ``s3://`` for EC2.
    """
    from prefect.context import FlowRunContext, TaskRunContext

    from prefect_sgpu.checkpoints import DIR_ENV, URI_ENV

    if URI_ENV in spec_env or DIR_ENV in spec_env:
        return {}
    task_ctx = TaskRunContext.get()
    flow_ctx = FlowRunContext.get()
    if task_ctx is None:
        return {}
    flow_run_id = str(flow_ctx.flow_run.id) if flow_ctx and flow_ctx.flow_run else "no-flow-run"
    name = f"{slug(task_ctx.task_run.task_key)}-{call_digest}"
    if isinstance(store, LocalStore):
        return {URI_ENV: str(store.root.parent / "checkpoints" / flow_run_id / name)}
    return {URI_ENV: store.uri("checkpoints", f"{flow_run_id}/{name}")}


def _digest(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    from prefect.utilities.hashing import hash_objects

    return (hash_objects(args, kwargs) or "unhashable")[:12]


def task_spec(layer: SpecLayer | None, runner: "GPUTaskRunner | None") -> JobSpec:
    """The job spec of one GPU task run: task > runner > environment > built-in."""
    return spec_mod.build(layer, runner.layer if runner else None)


def run_gpu_job(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                layer: SpecLayer | None) -> Any:
    """Launch ``fn`` on the task's resources (merged over the runner's defaults) and wait."""
    return run_gpu_call(payload_mod.FunctionCall(fn, args, kwargs), layer, _digest(args, kwargs),
                        getattr(fn, "__name__", "task"))


def run_gpu_call(call: "payload_mod.FunctionCall | payload_mod.ScriptCall", layer: SpecLayer | None,
                 digest: str, name: str) -> Any:
    """Run ``call`` (a function or a script) as this task run's job, with the GPU quota, the events, the
    progress and the artifacts of a ``@gpu_task``; ``digest`` keys its checkpoint location."""
    from prefect.context import FlowRunContext, TaskRunContext

    from prefect_sgpu.adapters import run_logs

    run_logs.attach()
    runner = _current_runner()
    spec = task_spec(layer, runner)
    compute, store = runner.compute_and_store(spec) if runner else resolve(spec)
    script = call.path if isinstance(call, payload_mod.ScriptCall) else None
    spec = spec_mod.for_compute(compute, layer, runner.layer if runner else None, script=script)
    checkpoint = _checkpoint_dir(store, spec.env, digest)
    if checkpoint:
        spec = spec.replace(env={**spec.env, **checkpoint})

    task_ctx = TaskRunContext.get()
    flow_ctx = FlowRunContext.get()
    tags = {}
    if task_ctx is not None:
        tags["prefect.task_run_id"] = str(task_ctx.task_run.id)
    if flow_ctx is not None and flow_ctx.flow_run is not None:
        tags["prefect.flow_run_id"] = str(flow_ctx.flow_run.id)
    cancel = threading.Event()
    job = Job(call, spec, compute, store, sink=RankLogSink(name), cancel_event=cancel, tags=tags)
    if runner is not None:
        runner._track(cancel)
    try:
        result = reports.run_reported(job)
    finally:
        if runner is not None:
            runner._untrack(cancel)
    return result.values if spec.return_all else result.values[0]


# --- the task runner -------------------------------------------------------------


class GPUTaskRunner(ThreadPoolTaskRunner):  # type: ignore[type-arg]
    """Runs GPU tasks as multi-node jobs on ``compute``; every other task in threads.

    ``compute`` is a compute block (``LocalCompute``, ``EC2Compute``, ``RayCompute``), a
    compute object, or None for the ``PREFECT_SGPU_COMPUTE`` block / local processes.
    Runner-level ``gpus``/``gpu_type``/... are defaults for GPU tasks; with
    ``distribute_all_tasks=True`` every submitted task becomes a GPU task.
    Nothing is provisioned in ``__enter__``: compute is resolved on the first GPU task,
    and everything still running is stopped in ``__exit__`` (which also runs when the
    flow run is cancelled).
    """

    def __init__(
        self,
        compute: Any | None = None,
        store: Any | None = None,
        *,
        distribute_all_tasks: bool = False,
        max_workers: int | None = None,
        **defaults: Unpack[TaskArgs],
    ) -> None:
        super().__init__(max_workers=max_workers)
        self.compute = compute
        self.store = store
        self.layer = spec_mod.layer("runner", **defaults)
        if distribute_all_tasks and "gpus" not in self.layer.given():
            raise SGPUConfigError("gpus", None, "a number of GPUs when distribute_all_tasks=True")
        self.distribute_all_tasks = distribute_all_tasks
        self._compute: Any | None = None
        self._local: Any | None = None
        self._jobs: set[threading.Event] = set()
        self._jobs_lock = threading.Lock()

    def duplicate(self) -> "GPUTaskRunner":
        return type(self)(
            self.compute, self.store, distribute_all_tasks=self.distribute_all_tasks,
            max_workers=self._max_workers, **self.layer.given(),
        )

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, GPUTaskRunner) and self.layer == other.layer
                and self.compute == other.compute and self.distribute_all_tasks == other.distribute_all_tasks)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for key in ("_jobs_lock", "_compute", "_local", "_jobs"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._jobs_lock = threading.Lock()
        self._jobs = set()
        self._compute = None
        self._local = None

    def compute_and_store(self, spec: JobSpec) -> tuple[Any, Store]:
        """The compute and store of one task's job: the runner's compute (or the work pool's,
        ``PREFECT_SGPU_COMPUTE``) is loaded once per runner; the resolver checks it fits ``spec``."""
        with self._jobs_lock:
            if self._compute is None:
                source = self.compute if self.compute is not None else os.environ.get(COMPUTE_ENV)
                if source is not None:
                    self._compute = as_compute(source, "compute" if self.compute is not None else COMPUTE_ENV)
            compute = self._compute
            if compute is None and not spec.remote:
                if self._local is None:
                    # the flow's own local compute: its GPU tasks share warm nodes, closed when the flow ends
                    from prefect_sgpu.compute.local import LocalProcessCompute

                    self._local = LocalProcessCompute()
                compute = self._local
        return resolve(spec, compute, self.store)

    def _track(self, event: threading.Event) -> None:
        with self._jobs_lock:
            self._jobs.add(event)

    def _untrack(self, event: threading.Event) -> None:
        with self._jobs_lock:
            self._jobs.discard(event)

    def submit(self, task: Task, parameters: dict[str, Any], wait_for: Iterable[Any] | None = None,
               dependencies: dict[str, Any] | None = None) -> Any:
        if self.distribute_all_tasks and not isinstance(task, GPUTask):
            task = _as_gpu_task(task, spec_mod.layer("task"))
        return super().submit(task, parameters, wait_for, dependencies)

    def cancel_all(self) -> None:
        with self._jobs_lock:
            jobs = list(self._jobs)
        for event in jobs:  # every running job stops its ranks and ends its MLflow run KILLED
            event.set()
        super().cancel_all()

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        try:
            super().__exit__(exc_type, exc_value, traceback)  # cancels jobs, waits for their threads
        finally:
            computes, self._compute, self._local = (self._compute, self._local), None, None
            for compute in computes:
                if compute is not None:
                    compute.close()
