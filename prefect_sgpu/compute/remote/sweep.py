"""The sweeper: what a dead driver left behind, found and removed.

A driver that is SIGKILLed, loses its machine or its network never runs its cleanup.
Its nodes stop themselves once its heartbeat is older than their TTL (on EC2 the user-data
also powers off a node whose bootstrap never started, or ended without it), but what a node
cannot remove stays: what the run's machines used in the cloud (on EC2 its security and
placement groups), its key when node 0 never got to delete it, the control files in the job
store, and its MLflow run, left RUNNING. The sweeper removes those, and ends any machine still up.

**Which runs are dead.** A run counts as dead only on the evidence its nodes use: the
driver's heartbeat in the job store older than the run's heartbeat TTL (as its cloud resources
record it, :attr:`CloudLeftover.heartbeat_ttl_s`, else the sweeper's own) plus a grace for a slow
heartbeat write.
Both ends of that age are read on the store's own clock: the heartbeat's time as the store
stamped it (S3's ``LastModified``, a file's mtime) and "now" as the store tells it
(:meth:`Store.clock`: S3's ``Date``), read once a pass and carried forward on this machine's
monotonic clock. The sweeper's own wall clock is never used, so a sweeper whose clock runs
hours ahead takes no live run for dead. A run whose folder holds no heartbeat and no payload
has ended (the driver deletes them last), so whatever is left of it is a leftover.

**Whose runs.** A run of another store is never judged: the cloud lists only what carries this
store's mark (:meth:`Provider.find_leftovers <prefect_sgpu.compute.remote.provider.Provider.find_leftovers>`;
on EC2 the ``sgpu:store`` tag of instances, groups, roles and SSM parameters, see
:mod:`prefect_sgpu.compute.ec2.leftovers`) and MLflow runs carry ``sgpu.store``. A folder in this
store named like another store's run (anyone who can write this store can make one) therefore
reaches none of that run's secrets. A secret of this store whose run has no folder here yet (a
lease's key is written just before its first heartbeat) is left for a later pass. A long healthy
job outlives its launch-time ``sgpu:ttl`` tag, which is therefore not used to decide.

**What is removed, in this order.** The run's leftovers in the cloud (machines first, then what
they used, then its secrets and identity: on EC2 instances, security and placement groups,
``/prefect-sgpu/<store scope>/<run>/payload-key`` and ``.../secrets``, the job role), then the
run's control files (payload, results, node documents, stop, heartbeat, relayed metrics; logs
and checkpoints stay), then the MLflow run, ended KILLED with the tag ``sgpu.swept`` saying why.
The sweeper knows no cloud: it asks the compute's provider
(:class:`~prefect_sgpu.compute.remote.provider.Provider`) what is left and to remove it.

**Safe anywhere.** Every removal tolerates "already gone", so the sweeper is idempotent
and two sweepers (a scheduled flow and a job's start) can run at once. ``dry_run``
lists what would go and touches nothing.

Entry points: ``prefect-sgpu gc`` (:mod:`prefect_sgpu.cli`), the ``prefect-sgpu-gc``
flow (:func:`prefect_sgpu.adapters.sweep_flow.gc`), and a pass at the start of every EC2 job
(:func:`start_of_job_pass`, non-blocking: it never waits for machines to go, so a group still in
use stays for the next pass).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from prefect_sgpu.compute.remote.provider import LEFTOVER_ORDER, CloudLeftover
from prefect_sgpu.protocol.liveness import local_heartbeat_ttl
from prefect_sgpu.protocol.jobfolder import CONTROL, HEARTBEAT, PAYLOAD, STOP

if TYPE_CHECKING:
    from prefect_sgpu.compute.remote.provider import Provider
    from prefect_sgpu.store import Store

logger = logging.getLogger("prefect_sgpu.compute.remote.sweep")

#: seconds added to a run's TTL before it is judged dead (clock skew, a slow heartbeat write);
#: half the TTL when that is less
DEFAULT_GRACE_S = 60.0
#: the files a live driver keeps in its job folder; none of them means the job has ended
_LIVE_FILES = (HEARTBEAT, PAYLOAD, STOP)


@dataclass(frozen=True)
class Leftover:
    """One thing of a dead run: ``kind`` is what its cloud calls it (instance, security group,
    placement group, SSM parameter, IAM role on EC2), store files or MLflow run."""

    run_id: str
    kind: str
    name: str
    why: str


@dataclass
class SweepReport:
    """What one pass found, removed, left (live runs) and could not do."""

    dry_run: bool
    found: list[Leftover] = field(default_factory=list)
    removed: list[Leftover] = field(default_factory=list)
    live: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "found": [asdict(x) for x in self.found],
                "removed": [asdict(x) for x in self.removed], "live": dict(self.live), "errors": list(self.errors)}

    def lines(self) -> list[str]:
        verb = "would remove" if self.dry_run else "removed"
        shown = self.found if self.dry_run else self.removed
        out = [f"{verb} {x.kind} {x.name} of job {x.run_id} ({x.why})" for x in shown]
        out += [f"left job {run}: {why}" for run, why in sorted(self.live.items())]
        out += [f"error: {e}" for e in self.errors]
        return out or ["nothing to remove"]


@dataclass
class _Run:
    """Everything found of one run before it is judged."""

    run_id: str
    cloud: list[CloudLeftover] = field(default_factory=list)
    mlflow_runs: list[str] = field(default_factory=list)

    @property
    def secrets_only(self) -> bool:
        """Only secrets in the cloud: a run that may not have written its folder yet."""
        return bool(self.cloud) and all(x.category == "secret" for x in self.cloud)

    @property
    def tagged_ttl(self) -> float | None:
        """The heartbeat TTL the run's cloud resources were made with (machines' first), if any says."""
        return next((x.heartbeat_ttl_s for x in self.cloud if x.heartbeat_ttl_s is not None), None)


class Sweeper:
    """Finds and removes what dead runs of one job store left (see the module docstring).

    ``cloud`` is the provider of the store's remote nodes (what it lists and removes:
    :meth:`~prefect_sgpu.compute.remote.provider.Provider.find_leftovers`), absent for a store
    whose runs use no cloud; ``tracking_uri`` the MLflow store, if any; ``ttl_s`` the heartbeat TTL
    of runs whose resources do not say theirs.
    """

    def __init__(self, store: "Store", *, ttl_s: float, cloud: "Provider | None" = None,
                 tracking_uri: str | None = None, grace_s: float | None = None,
                 exclude: Iterable[str] = ()) -> None:
        self.store, self.tracking_uri, self.cloud = store, tracking_uri, cloud
        self.ttl_s, self.grace_s, self.exclude = ttl_s, grace_s, set(exclude)
        #: (the store's clock, this machine's monotonic clock) when the pass first read the store's
        self._store_clock: tuple[float, float] | None = None

    # -- the pass -------------------------------------------------------------------

    def sweep(self, dry_run: bool = False, scan_store: bool = True, wait: bool = True) -> SweepReport:
        """Find, judge, remove. ``scan_store=False`` skips listing every job folder of the store
        (the pass at job start: it judges the runs that have cloud resources or a RUNNING MLflow
        run); ``wait=False`` never waits for machines to end."""
        report = SweepReport(dry_run=dry_run)
        runs: dict[str, _Run] = {}
        self._store_clock = None

        def run(run_id: str) -> _Run:
            return runs.setdefault(run_id, _Run(run_id))

        if self.cloud is not None:
            try:
                scan = self.cloud.find_leftovers(self.store)
                report.errors += scan.errors
                for leftover in sorted(scan.found, key=lambda x: LEFTOVER_ORDER.index(x.category)):
                    run(leftover.run_id).cloud.append(leftover)
            except Exception as exc:  # noqa: BLE001 - the store and MLflow are still swept
                report.errors.append(f"find cloud: {type(exc).__name__}: {exc}")
        try:
            self._find_mlflow(run)
        except Exception as exc:  # noqa: BLE001 - one unreachable service must not stop the rest
            report.errors.append(f"find mlflow: {type(exc).__name__}: {exc}")
        store_runs: set[str] | None = None
        if scan_store:
            try:
                store_runs = set(self.store.runs())
            except Exception as exc:  # noqa: BLE001
                report.errors.append(f"listing the store: {type(exc).__name__}: {exc}")
        for run_id in sorted(set(runs) | (store_runs or set())):
            if run_id in self.exclude:
                continue
            try:
                self._judge(run(run_id), report, dry_run, wait)
            except Exception as exc:  # noqa: BLE001 - the next run may still be swept
                report.errors.append(f"job {run_id}: {type(exc).__name__}: {exc}")
        for line in report.lines():
            logger.info("sweep of %s: %s", self.store.root_uri, line)
        return report

    def _judge(self, found: _Run, report: SweepReport, dry_run: bool, wait: bool) -> None:
        files, folders = self.store.top(found.run_id)
        control = sorted(k for k in CONTROL if k in files or k in folders)
        live_files = {k: files[k] for k in _LIVE_FILES if k in files}
        if not (found.cloud or found.mlflow_runs or control):
            return  # an ended job's logs and checkpoints: nothing to do
        if found.secrets_only and not found.mlflow_runs and not (files or folders):
            report.live[found.run_id] = f"{found.cloud[0].kind} of a job with no folder in this store (yet)"
            return
        if live_files:
            ttl = found.tagged_ttl if found.tagged_ttl is not None else self.ttl_s
            age = self.store_now() - max(live_files.values())
            grace = self.grace_s if self.grace_s is not None else min(DEFAULT_GRACE_S, ttl / 2)
            if age <= ttl + grace:
                report.live[found.run_id] = f"heartbeat {age:.0f}s old, TTL {ttl:g}s"
                return
            why = f"driver heartbeat {age:.0f}s old, past the TTL of {ttl:g}s"
        else:
            why = "the job has ended"
        cloud = [(x, Leftover(found.run_id, x.kind, x.name, why)) for x in found.cloud]
        files_left = Leftover(found.run_id, "store files", ", ".join(control), why) if control else None
        runs_left = [(r, Leftover(found.run_id, "MLflow run", r, why)) for r in found.mlflow_runs]
        report.found += [x for _, x in cloud] + ([files_left] if files_left else []) + [x for _, x in runs_left]
        if dry_run:
            return
        # the cloud first (a live machine could still write the folder), then the folder, then the MLflow run
        if cloud:
            assert self.cloud is not None
            gone = self.cloud.remove_leftovers(found.run_id, [c for c, _ in cloud], wait=wait)
            report.removed += [x for c, x in cloud if c in gone]
        if files_left is not None:
            for key in CONTROL:
                self.store.delete(found.run_id, key)
            report.removed.append(files_left)
        for mlflow_run, leftover in runs_left:
            if self._kill_mlflow_run(mlflow_run, why):
                report.removed.append(leftover)

    def store_now(self) -> float:
        """Now on the store's clock (:meth:`Store.clock`), read from the store once a pass and carried
        forward on this machine's monotonic clock, which measures only how long the pass has run."""
        if self._store_clock is None:
            self._store_clock = (self.store.clock(), time.monotonic())
        at, then = self._store_clock
        return at + (time.monotonic() - then)

    # -- finding ----------------------------------------------------------------------

    def _find_mlflow(self, run: Any) -> None:
        client = self._mlflow()
        if client is None:
            return
        from mlflow.entities import ViewType

        experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
        for start in range(0, len(experiments), 100):
            token = None
            while True:
                page = client.search_runs(experiments[start:start + 100], "attributes.status = 'RUNNING'",
                                          run_view_type=ViewType.ALL, max_results=1000, page_token=token)
                for found in page:
                    tags = found.data.tags
                    if tags.get("sgpu.run_id") and tags.get("sgpu.store") == self.store.root_uri:
                        run(tags["sgpu.run_id"]).mlflow_runs.append(found.info.run_id)
                token = page.token
                if not token:
                    break

    def _mlflow(self) -> Any | None:
        """A client of the tracking store, if there is one to sweep (a sqlite file that does not
        exist is not created just to be searched)."""
        if not self.tracking_uri:
            return None
        if self.tracking_uri.startswith("sqlite:///"):
            from pathlib import Path

            if not Path(self.tracking_uri[len("sqlite:///"):]).exists():
                return None
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.tracking_uri)

    # -- removing ---------------------------------------------------------------------

    def _kill_mlflow_run(self, mlflow_run: str, why: str) -> bool:
        client = self._mlflow()
        assert client is not None
        if client.get_run(mlflow_run).info.status != "RUNNING":
            return False  # ended meanwhile (its driver, or another sweeper)
        try:
            client.set_tag(mlflow_run, "sgpu.swept", why)
        except Exception:  # noqa: BLE001 - another sweeper tagged it first (a unique tag, set once)
            if client.get_run(mlflow_run).data.tags.get("sgpu.swept") is None:
                raise
            return False
        client.set_terminated(mlflow_run, status="KILLED")
        return True


def sweeper(compute: Any = None, store: Any = None, tracking_uri: str | None = None, **options: Any) -> Sweeper:
    """The sweeper of a compute (:meth:`Compute.sweeper <prefect_sgpu.compute.base.Compute.sweeper>`:
    one with a cloud builds its own, with its provider and TTL) or of a store alone: ``store``, else
    the compute's default store, else this machine's local job store, with the heartbeat TTL of
    nodes on this machine (:func:`prefect_sgpu.protocol.liveness.local_heartbeat_ttl`)."""
    made = compute.sweeper(tracking_uri, **options) if compute is not None else None
    if made is not None:
        return made
    if store is None:
        from prefect_sgpu.store import LocalStore

        store = (compute.default_store() if compute is not None else None) or LocalStore()
    options.setdefault("ttl_s", local_heartbeat_ttl())
    return Sweeper(store, tracking_uri=tracking_uri, **options)


def start_of_job_pass(compute: Any, run_id: str, tracking_uri: str | None) -> None:
    """The sweep a remote job makes before it launches (with ``compute.sweeper``, leaving the job
    itself out): never fails the job, never waits."""
    try:
        compute.sweeper(tracking_uri, exclude=[run_id]).sweep(scan_store=False, wait=False)
    except Exception:  # noqa: BLE001 - tidying up must not cost a job
        logger.warning("the sweep before job %s failed; the job goes on", run_id, exc_info=True)
