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

import contextlib
import copy
import functools
import logging
import os
import re
import threading
import time
from typing import Any, Callable, Iterable, Iterator, TypeVar

from typing_extensions import Unpack

from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import Task

from prefect_sgpu import payload as payload_mod
from prefect_sgpu import spec as spec_mod
from prefect_sgpu.driver import Job, JobResult
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.live import LiveStatus
from prefect_sgpu.logs import RankLogSink
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


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "task"


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
    name = f"{_slug(task_ctx.task_run.task_key)}-{call_digest}"
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
    spec = spec_mod.for_compute(compute, layer, runner.layer if runner else None)
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
    job.prepare()  # bad resources or payload fail here, before a quota slot is taken
    with gpu_quota(spec):
        if runner is not None:
            runner._track(cancel)
        started = time.time()
        _emit(job, "started")
        progress = _Progress(job)
        job.straggler_listeners.append(functools.partial(_report_straggler, job))
        try:
            with LiveStatus(job):
                result = job.run()
        except BaseException as exc:
            progress.stop(done=False)
            _emit(job, "failed", duration_s=time.time() - started, error=f"{type(exc).__name__}: {exc}"[:500])
            raise
        finally:
            if runner is not None:
                runner._untrack(cancel)
    progress.stop(done=True)
    _emit(job, "finished", duration_s=result.duration_s, cost=result.cost, world_size=result.plan.world_size)
    _report(job, result)
    return result.values if spec.return_all else result.values[0]


# --- progress, GPU quotas and lifecycle events ----------------------------------


class _Progress:
    """The task run's progress artifact (``sgpu-<task>-progress``), following rank 0's steps.

    Rank 0's ``runtime.progress(step, total=N)`` (the ``Checkpointer`` reports steps too) lands
    in the job folder (an EC2 node ships it with the logs); a thread of the task run reads it
    every ``every`` seconds and moves the artifact to ``step / total``. A job that finishes
    well ends at 100 %; a failed one stays where it got to.
    """

    def __init__(self, job: Job, every: float = 2.0) -> None:
        import contextvars

        self.job = job
        self.every = every
        self._stop = threading.Event()
        self._seen: tuple[int, int | None] | None = None
        self._id: Any = None
        try:
            from prefect.artifacts import create_progress_artifact

            self._id = create_progress_artifact(
                progress=0.0, key=f"sgpu-{_slug(job.call.name)}-progress",
                description=f"prefect-sgpu job {job.run_id}: starting")
        except Exception:  # noqa: BLE001 - a report, never the job's failure
            logger.debug("no progress artifact for %s", job.run_id, exc_info=True)
            return
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._follow,), daemon=True,
                                        name=f"sgpu-progress-{job.run_id}")
        self._thread.start()

    def _read(self) -> tuple[int, int | None] | None:
        from prefect_sgpu.live import read_step

        return read_step(self.job.store, self.job.run_id)

    def _update(self, progress: float, description: str) -> None:
        from prefect.artifacts import update_progress_artifact

        try:
            update_progress_artifact(self._id, progress=progress, description=description)
        except Exception:  # noqa: BLE001 - a report, never the job's failure
            logger.debug("could not update the progress of %s", self.job.run_id, exc_info=True)

    def _follow(self) -> None:
        while not self._stop.wait(self.every):
            seen = self._read()
            if seen is None or seen == self._seen:
                continue
            self._seen = seen
            step, total = seen
            pct = min(100.0, 100.0 * step / total) if total else 0.0
            self._update(pct, f"prefect-sgpu job {self.job.run_id}: step {step}" + (f" of {total}" if total else ""))

    def stop(self, done: bool) -> None:
        if self._id is None:
            return
        self._stop.set()
        self._thread.join(timeout=self.every + 5)
        seen = self._read() or self._seen
        step = f"step {seen[0]}" + (f" of {seen[1]}" if seen and seen[1] else "") if seen else "no steps reported"
        if done:
            self._update(100.0, f"prefect-sgpu job {self.job.run_id}: finished ({step})")
        else:
            pct = min(100.0, 100.0 * seen[0] / seen[1]) if seen and seen[1] else 0.0
            self._update(pct, f"prefect-sgpu job {self.job.run_id}: failed at {step}")


def quota_name(gpu_type: str) -> str:
    """The global concurrency limit that holds the GPUs of ``gpu_type`` (``gpu:A10``, ``gpu:H100``, ...)."""
    from prefect_sgpu.catalog import lookup

    return f"gpu:{lookup(gpu_type).name}"


@contextlib.contextmanager
def gpu_quota(spec: JobSpec) -> Iterator[str | None]:
    """Hold ``spec.gpus`` slots of the gpu type's global concurrency limit while the job runs.

    No gpu type, no such limit, or an inactive one: nothing to wait for. A job that needs
    more GPUs than the limit has could never start, and is refused.
    """
    if not spec.gpu_type:
        yield None
        return
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectNotFound

    name = quota_name(spec.gpu_type)
    try:
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        yield None
        return
    if not limit.active:
        yield None
        return
    if spec.gpus > limit.limit:
        raise SGPUConfigError("gpus", spec.gpus, f"at most {limit.limit}, the slots of the global concurrency "
                              f"limit {name!r} (the {spec.gpu_type} GPUs this workspace may hold at once)")
    logger.info("waiting for %d slot(s) of global concurrency limit %r", spec.gpus, name)
    with concurrency(name, occupy=spec.gpus, strict=True, raise_on_lease_renewal_failure=False):
        logger.info("holding %d slot(s) of global concurrency limit %r", spec.gpus, name)
        yield name


def _emit(job: Job, phase: str, labels: dict[str, str] | None = None, **payload: Any) -> None:
    """A Prefect event ``prefect-sgpu.job.<phase>`` about ``job`` (never fails the task); ``labels``
    go on its resource (``prefect-sgpu.rank``, ...), where automations can match them."""
    from prefect.events import emit_event

    spec = job.spec
    try:
        emit_event(
            event=f"prefect-sgpu.job.{phase}",
            resource={"prefect.resource.id": f"prefect-sgpu.job.{job.run_id}",
                      "prefect.resource.name": job.call.name, "prefect-sgpu.run-id": job.run_id, **(labels or {})},
            payload={"gpus": spec.gpus, "gpu_type": spec.gpu_type, "nodes": spec.nodes,
                     "compute": type(job.compute).__name__, **payload},
        )
    except Exception:  # noqa: BLE001 - events are a report, not part of the job
        logger.debug("could not emit prefect-sgpu.job.%s for %s", phase, job.run_id, exc_info=True)


def _report_straggler(job: Job, straggler: Any) -> None:
    """A straggler named while the job runs: the event ``prefect-sgpu.job.straggler`` and a new
    version of the task's ``sgpu-<task>-stragglers`` table (every straggler named so far)."""
    from prefect.artifacts import create_table_artifact

    where = {"node": straggler.node, "host": straggler.host, "instance_id": straggler.instance_id}
    labels = {"prefect-sgpu.rank": str(straggler.rank),
              **{f"prefect-sgpu.{k.replace('_', '-')}": str(v) for k, v in where.items() if v is not None}}
    _emit(job, "straggler", labels=labels, rank=straggler.rank, **where, step=straggler.step,
          rate=round(straggler.rate, 4), median_rate=round(straggler.median_rate, 4),
          straggler_factor=job.spec.straggler_factor, straggler_steps=job.spec.straggler_steps)
    try:
        create_table_artifact(table=[s.as_row() for s in job.stragglers], key=f"sgpu-{_slug(job.call.name)}-stragglers",
                              description=f"ranks named as stragglers in prefect-sgpu job {job.run_id}")
    except Exception:  # noqa: BLE001 - a report, never the job's failure
        logger.debug("could not write the stragglers table of %s", job.run_id, exc_info=True)


def mlflow_reference(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """Markdown that takes a reader to an MLflow run: a link for a tracking server, else the
    exact ``mlflow ui`` command for the local store and the address to open once it runs."""
    page = f"#/experiments/{experiment_id}/runs/{run_id}"
    if tracking_uri.startswith(("http://", "https://")):
        return f"MLflow run `{run_id}`: [open]({tracking_uri.rstrip('/')}/{page})"
    return (f"MLflow run `{run_id}` is in the local store `{tracking_uri}`. To open it, run\n\n"
            f"```bash\nmlflow ui --backend-store-uri {tracking_uri}\n```\n\n"
            f"and go to http://127.0.0.1:5000/{page}")


#: rows of the loss table artifact at most (longer histories are thinned evenly, the last step kept)
LOSS_ROWS = 100


def loss_table(tracking_uri: str, run_id: str, rows: int = LOSS_ROWS) -> list[dict[str, Any]]:
    """Every ``*loss*`` metric of an MLflow run by step (system metrics left out), at most ``rows`` rows."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    names = sorted(k for k in client.get_run(run_id).data.metrics if "loss" in k.lower()
                   and not k.startswith("system/"))
    by_step: dict[int, dict[str, Any]] = {}
    for name in names:
        for m in client.get_metric_history(run_id, name):
            by_step.setdefault(int(m.step), {"step": int(m.step)})[name] = round(float(m.value), 6)
    table = [by_step[s] for s in sorted(by_step)]
    if len(table) > rows:
        every = len(table) / rows
        table = [table[int(i * every)] for i in range(rows - 1)] + [table[-1]]
    return [{"step": r["step"], **{n: r.get(n) for n in names}} for r in table]


def _report(job: Job, result: JobResult) -> None:
    """Prefect artifacts for the task run, keyed by task (the latest is the key's newest version):
    ``sgpu-<task>-job`` (summary), ``sgpu-<task>-ranks`` (table) and ``sgpu-<task>-mlflow``."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    key = f"sgpu-{_slug(job.call.name)}"
    rows = "\n".join(
        f"| {r.rank} | {r.node} | {r.host} | {r.exit_code} | {r.duration_s:.1f} |" for r in result.ranks
    )
    rates = {rank: {"steps/s": round(rate, 3)} for rank, rate in result.step_rates.items()}
    create_table_artifact(
        table=[{"rank": r.rank, "node": r.node, "host": r.host, "exit code": r.exit_code,
                "duration (s)": round(r.duration_s, 1), **rates.get(r.rank, {})} for r in result.ranks],
        key=f"{key}-ranks", description=f"ranks of prefect-sgpu job {result.run_id}")
    mlflow_line = "MLflow: off"
    if result.mlflow_run_id and job.tracked and result.mlflow_tracking_uri:
        mlflow_line = mlflow_reference(result.mlflow_tracking_uri, job.tracked.experiment_id, result.mlflow_run_id)
        create_markdown_artifact(markdown=mlflow_line, key=f"{key}-mlflow",
                                 description=f"MLflow run of prefect-sgpu job {result.run_id}")
        try:
            losses = loss_table(result.mlflow_tracking_uri, result.mlflow_run_id)
        except Exception:  # noqa: BLE001 - a report, never the task's failure
            logger.debug("could not read the loss curve of %s", result.mlflow_run_id, exc_info=True)
            losses = []
        if losses:
            create_table_artifact(table=losses, key=f"{key}-loss",
                                  description=f"loss by step, MLflow run {result.mlflow_run_id}")
    cost = result.cost or {}
    cost_line = (
        f"Compute: {cost.get('instance_hours', 0):.4f} instance-hours, estimated "
        f"${cost.get('usd', 0):.4f}\n\n" if cost else ""
    )
    recoveries = ""
    if result.recoveries:
        lines = "\n".join(
            f"| {r.gang} | {r.reason} | {r.resumed_from_step if r.resumed_from_step is not None else 'start'} | "
            f"{r.reprovision_s:.1f} | {'?' if r.lost_work_s is None else f'{r.lost_work_s:.1f}'} |"
            for r in result.recoveries)
        recoveries = ("**Recovered from infrastructure loss** (relaunched on new capacity):\n\n"
                      "| relaunch | what was lost | resumed from step | re-provisioning (s) | work redone (s) |\n"
                      f"| --- | --- | --- | --- | --- |\n{lines}\n\n")
    stragglers = ""
    if result.stragglers:
        lines = "\n".join(f"| {s.rank} | {s.where()} | {s.step} | {s.rate:.3g} | {s.median_rate:.3g} |"
                          for s in result.stragglers)
        stragglers = ("**Stragglers** (step rate below the median's "
                      f"1/{job.spec.straggler_factor:g} for {job.spec.straggler_steps} step(s)):\n\n"
                      "| rank | where | named at step | rate (steps/s) | median rate (steps/s) |\n"
                      f"| --- | --- | --- | --- | --- |\n{lines}\n\n")
    create_markdown_artifact(
        markdown=(
            f"### {job.call.name}: {result.plan.world_size} rank(s) on {result.plan.nodes} node(s)\n\n"
            f"Job `{result.run_id}` finished in {result.duration_s:.1f} s on {result.plan.device}.\n\n"
            "| rank | node | host | exit code | duration (s) |\n| --- | --- | --- | --- | --- |\n"
            f"{rows}\n\n{recoveries}{stragglers}{cost_line}{mlflow_line}\n\nRank logs: `{result.logs_uri}`\n"
        ),
        key=f"{key}-job", description=f"prefect-sgpu job {result.run_id}",
    )


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
