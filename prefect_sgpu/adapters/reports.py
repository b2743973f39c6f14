"""What a Prefect user sees of a job run inside a flow or task run, whatever started it.

A ``@gpu_task``, a ``.distributed()``/``.run()``/``.submit()`` call of a ``@distributed`` or
``@ray_launch`` function in a flow, ``run_script``, the TorchDistributor classes and
``prefect-sgpu run`` all run their job through :func:`run_reported` when a flow or task run
is current: the job holds ``gpus`` slots of the ``gpu:<type>`` global concurrency limit while it
runs, emits the ``prefect-sgpu.job.*`` events, follows rank 0's steps in a progress artifact,
names stragglers, and leaves the job, ranks, MLflow and loss artifacts. A team's GPU quota
cannot be bypassed by calling the decorator instead of the task. Outside a run nothing here
is called: a script or notebook needs no Prefect server.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import sys
import threading
import time
from typing import Any, Iterator

from prefect_sgpu.driver.job import Job, JobResult
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.observe.live import LiveStatus
from prefect_sgpu.spec import JobSpec

logger = logging.getLogger("prefect_sgpu.task_runner")

__all__ = ["CostProgress", "gpu_quota", "in_prefect_run", "loss_table", "mlflow_reference", "quota_name", "run_reported",
           "slug", "timeline_table"]


def slug(text: str) -> str:
    """``text`` as an artifact key part: lower case, runs of other characters made one ``-``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "task"


def in_prefect_run() -> bool:
    """Whether a Prefect flow or task run is current in this thread (Prefect not even imported: no)."""
    if "prefect.context" not in sys.modules:
        return False
    from prefect.context import FlowRunContext, TaskRunContext

    return TaskRunContext.get() is not None or FlowRunContext.get() is not None


def run_reported(job: Job, live: bool = True) -> JobResult:
    """Run ``job`` (prepared or not) inside the current flow or task run, with its GPU quota,
    events, progress, stragglers, artifacts and (where ``live``) live status; return its result."""
    job.prepare()  # bad resources or payload fail here, before a quota slot is taken
    with gpu_quota(job.spec):
        started = time.time()
        _emit(job, "started")
        progress = _Progress(job)
        job.straggler_listeners.append(functools.partial(_report_straggler, job))
        job.membership_listeners.append(functools.partial(_report_membership, job))
        if job.spec.max_cost_usd is not None:
            job.cost_listeners.append(CostProgress(job).update)
        try:
            with LiveStatus(job) if live else contextlib.nullcontext():
                result = job.run()
        except BaseException as exc:
            progress.stop(done=False)
            _emit(job, "failed", duration_s=time.time() - started, error=f"{type(exc).__name__}: {exc}"[:500])
            raise
    progress.stop(done=True)
    _emit(job, "finished", duration_s=result.duration_s, cost=result.cost, world_size=result.plan.world_size)
    _report(job, result)
    return result


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
                progress=0.0, key=f"sgpu-{slug(job.call.name)}-progress",
                description=f"prefect-sgpu job {job.run_id}: starting")
        except Exception:  # noqa: BLE001 - a report, never the job's failure
            logger.debug("no progress artifact for %s", job.run_id, exc_info=True)
            return
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._follow,), daemon=True,
                                        name=f"sgpu-progress-{job.run_id}")
        self._thread.start()

    def _read(self) -> tuple[int, int | None] | None:
        from prefect_sgpu.observe.live import job_step

        return job_step(self.job)

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


class CostProgress:
    """The task run's cost artifact (``sgpu-<task>-cost``) of a job with a ``max_cost_usd``: a progress
    artifact at the share of the cap spent so far, its description the dollars spent, the hourly rate
    and the projection. Made at the job's first cost reading, then updated at most every ``every``
    seconds (a reading at the cap always): the driver reads the cost more often than a person needs."""

    def __init__(self, job: Job, every: float = 30.0, clock: Any = time.monotonic) -> None:
        self.job = job
        self.every = every
        self.clock = clock
        self.shown_at: float | None = None
        self.id: Any = None

    def due(self, reached: bool) -> bool:
        """Whether a reading now is shown: the first, one at the cap, or one ``every`` seconds after the last."""
        return self.shown_at is None or reached or self.clock() - self.shown_at >= self.every

    def update(self, reading: Any) -> None:
        if not self.due(reading.reached):
            return
        self.shown_at = self.clock()
        cap = reading.cap_usd or 0.0
        pct = min(100.0, 100.0 * reading.spent_usd / cap) if cap else 0.0
        text = (f"prefect-sgpu job {self.job.run_id}: {reading.describe()}"
                + ("; cap reached: final checkpoint, then stop" if reading.reached else ""))
        try:
            if self.id is None:
                from prefect.artifacts import create_progress_artifact

                self.id = create_progress_artifact(progress=pct, key=f"sgpu-{slug(self.job.call.name)}-cost",
                                                   description=text)
            else:
                from prefect.artifacts import update_progress_artifact

                update_progress_artifact(self.id, progress=pct, description=text)
        except Exception:  # noqa: BLE001 - a report, never the job's failure
            logger.debug("could not show the cost of %s", self.job.run_id, exc_info=True)


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
        create_table_artifact(table=[s.as_row() for s in job.stragglers], key=f"sgpu-{slug(job.call.name)}-stragglers",
                              description=f"ranks named as stragglers in prefect-sgpu job {job.run_id}")
    except Exception:  # noqa: BLE001 - a report, never the job's failure
        logger.debug("could not write the stragglers table of %s", job.run_id, exc_info=True)


def _report_membership(job: Job, change: Any) -> None:
    """An elastic job's membership change: the event ``prefect-sgpu.job.membership`` (round, world size,
    nodes joined and left) and a new version of the task's ``sgpu-<task>-membership`` table (every round
    so far: the nodes that served it and the checkpoint step it resumed from)."""
    from prefect.artifacts import create_table_artifact

    _emit(job, "membership", labels={"prefect-sgpu.round": str(change.round)}, round=change.round,
          world_size=change.world_size, nodes=change.nodes, joined=change.joined, left=change.left,
          from_step=change.from_step, step=change.step, reason=change.reason[:500])
    try:
        create_table_artifact(table=[c.as_row() for c in job.membership], key=f"sgpu-{slug(job.call.name)}-membership",
                              description=f"the nodes of elastic prefect-sgpu job {job.run_id}, round by round")
    except Exception:  # noqa: BLE001 - a report, never the job's failure
        logger.debug("could not write the membership table of %s", job.run_id, exc_info=True)


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


def timeline_table(result: JobResult) -> list[dict[str, Any]]:
    """The job's timeline as the rows of its ``sgpu-<task>-timeline`` table artifact, in time order."""
    return [phase.as_row() for phase in result.timeline]


def _report(job: Job, result: JobResult) -> None:
    """Prefect artifacts for the task run, keyed by task (the latest is the key's newest version):
    ``sgpu-<task>-job`` (summary), ``sgpu-<task>-ranks`` and ``sgpu-<task>-timeline`` (tables) and
    ``sgpu-<task>-mlflow``."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    key = f"sgpu-{slug(job.call.name)}"
    rows = "\n".join(
        f"| {r.rank} | {r.node} | {r.host} | {r.exit_code} | {r.duration_s:.1f} |" for r in result.ranks
    )
    rates = {rank: {"steps/s": round(rate, 3)} for rank, rate in result.step_rates.items()}
    create_table_artifact(
        table=[{"rank": r.rank, "node": r.node, "host": r.host, "exit code": r.exit_code,
                "duration (s)": round(r.duration_s, 1), **rates.get(r.rank, {})} for r in result.ranks],
        key=f"{key}-ranks", description=f"ranks of prefect-sgpu job {result.run_id}")
    if result.timeline:  # where the time went: one row per phase per node
        create_table_artifact(table=timeline_table(result), key=f"{key}-timeline",
                              description=f"phases of prefect-sgpu job {result.run_id} per node, "
                                          "seconds since the job began")
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
        f"${cost.get('usd', 0):.4f}" + (f" ({cost['price_source']})" if cost.get("price_source") else "")
        + "".join(f"; {name} ${part.get('usd', 0):.4f} ({part.get('source', '')})" for name, part in (
            ("S3 requests", cost.get("storage")), ("transfer", cost.get("transfer"))) if isinstance(part, dict))
        + (f"; total ${cost['total_usd']:.4f}" if "total_usd" in cost else "") + "\n\n" if cost else ""
    )
    recoveries = ""
    if result.recoveries:
        lines = "\n".join(
            f"| {r.gang} | {r.reason} | {_replaced_text(r)} | "
            f"{r.resumed_from_step if r.resumed_from_step is not None else 'start'} | "
            f"{r.reprovision_s:.1f} | {'?' if r.lost_work_s is None else f'{r.lost_work_s:.1f}'} |"
            for r in result.recoveries)
        recoveries = ("**Recovered from infrastructure loss** (new capacity for what was lost):\n\n"
                      "| relaunch | what was lost | replaced | resumed from step | re-provisioning (s) | "
                      "work redone (s) |\n"
                      f"| --- | --- | --- | --- | --- | --- |\n{lines}\n\n")
    stragglers = ""
    if result.stragglers:
        lines = "\n".join(f"| {s.rank} | {s.where()} | {s.step} | {s.rate:.3g} | {s.median_rate:.3g} |"
                          for s in result.stragglers)
        stragglers = ("**Stragglers** (step rate below the median's "
                      f"1/{job.spec.straggler_factor:g} for {job.spec.straggler_steps} step(s)):\n\n"
                      "| rank | where | named at step | rate (steps/s) | median rate (steps/s) |\n"
                      f"| --- | --- | --- | --- | --- |\n{lines}\n\n")
    checked = _gang_check_section(key, result)
    create_markdown_artifact(
        markdown=(
            f"### {job.call.name}: {result.plan.world_size} rank(s) on {result.plan.nodes} node(s)\n\n"
            f"Job `{result.run_id}` finished in {result.duration_s:.1f} s on {result.plan.device}.\n\n"
            "| rank | node | host | exit code | duration (s) |\n| --- | --- | --- | --- | --- |\n"
            f"{rows}\n\n{checked}{recoveries}{stragglers}{cost_line}{mlflow_line}\n\nRank logs: `{result.logs_uri}`\n"
        ),
        key=f"{key}-job", description=f"prefect-sgpu job {result.run_id}",
    )


def _gang_check_section(key: str, result: JobResult) -> str:
    """The gang check's part of the job summary, and its link table (``sgpu-<task>-links``)."""
    from prefect.artifacts import create_table_artifact

    report = result.gang_check
    if not report:
        return ""
    if report.get("links"):
        create_table_artifact(table=report["links"], key=f"{key}-links",
                              description=f"node links measured by the gang check of prefect-sgpu job {result.run_id}")
    lines = "\n".join(f"| {link['from node']} ({link['from']}) | {link['to node']} ({link['to']}) | {link['GB/s']:g} | "
                      f"{link['ms']:g} |" for link in report.get("links") or [])
    table = ("| from node | to node | GB/s | ms per exchange |\n| --- | --- | --- | --- |\n" + lines + "\n\n"
             if lines else "")
    notes = "".join(f"- {text}\n" for text in [*(f"slow link {t}" for t in report.get("slow_links") or []),
                                                *(f"node {n} is on every slow link" for n in report.get("slow_nodes") or []),
                                                *(report.get("warnings") or [])])
    return (f"**Gang check** passed in {report['seconds']:g} s over {report['backend']} "
            f"({report['bytes'] / 2**20:g} MiB per exchange):\n\n{table}" + (notes + "\n" if notes else ""))


def _replaced_text(recovery: Any) -> str:
    if recovery.replaced == "nodes":
        kept = ", ".join(f"{i} ({where})" for i, where in sorted(recovery.kept.items()))
        return f"the lost node(s) only; kept {kept}"
    return "the whole gang"
