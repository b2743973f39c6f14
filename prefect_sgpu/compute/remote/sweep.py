"""The sweeper: what a dead driver left behind, found and removed.

A driver that is SIGKILLed, loses its machine or its network never runs its cleanup.
Its EC2 nodes stop themselves once its heartbeat is older than their TTL (and the
user-data powers off a node whose bootstrap never started, or ended without it), but what a node
cannot remove stays: the run's security and placement groups, its SSM key parameter
when node 0 never got to delete it, the control files in the job store, and its MLflow
run, left RUNNING. The sweeper removes those, and terminates any instance still up.

**Which runs are dead.** A run counts as dead only on the evidence its nodes use: the
driver's heartbeat in the job store older than the run's heartbeat TTL (the
``sgpu:heartbeat-ttl`` tag, else the sweeper's own) plus a grace for a slow heartbeat write.
Both ends of that age are read on the store's own clock: the heartbeat's time as the store
stamped it (S3's ``LastModified``, a file's mtime) and "now" as the store tells it
(:meth:`Store.clock`: S3's ``Date``), read once a pass and carried forward on this machine's
monotonic clock. The sweeper's own wall clock is never used, so a sweeper whose clock runs
hours ahead takes no live run for dead. A run whose folder holds no heartbeat and no payload
has ended (the driver deletes them last), so whatever is left of it is a leftover.

**Whose runs.** A run of another store is never judged: EC2 resources and IAM roles carry
``sgpu:store``, MLflow runs ``sgpu.store``, and SSM parameters the ``sgpu:store`` tag the
driver gives them when it writes them; only parameters tagged with this store are listed at
all. A folder in this store named like another store's run (anyone who can write this store
can make one) therefore reaches none of that run's parameters. A parameter of this store whose
run has no folder here yet (a lease's key is written just before its first heartbeat) is left
for a later pass. A long healthy job outlives its launch-time ``sgpu:ttl`` tag, which is
therefore not used to decide.

**What is removed.** Instances (terminated), the run's tagged security and placement
groups, ``/prefect-sgpu/<store scope>/<run>/payload-key`` and ``.../secrets``, the run's control files (payload, results,
node documents, stop, heartbeat, relayed metrics; logs and checkpoints stay), and the
MLflow run, ended KILLED with the tag ``sgpu.swept`` saying why.

**Safe anywhere.** Every removal tolerates "already gone", so the sweeper is idempotent
and two sweepers (a scheduled flow and a job's start) can run at once. ``dry_run``
lists what would go and touches nothing.

Entry points: ``prefect-sgpu gc`` (:mod:`prefect_sgpu.cli`), the ``prefect-sgpu-gc``
flow (:func:`prefect_sgpu.adapters.sweep_flow.gc`), and a pass at the start of every EC2 job (non-blocking: it
never waits for instances to go, so a group still in use stays for the next pass).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from prefect_sgpu import aws
from prefect_sgpu.jobfolder import (CONTROL, HEARTBEAT, PAYLOAD, STOP, ssm_key_parameter, ssm_root,
                                    ssm_secrets_parameter)

if TYPE_CHECKING:
    from prefect_sgpu.compute.ec2.instances import EC2Provisioner
    from prefect_sgpu.store import Store

logger = logging.getLogger("prefect_sgpu.compute.remote.sweep")

#: seconds added to a run's TTL before it is judged dead (clock skew, a slow heartbeat write);
#: half the TTL when that is less
DEFAULT_GRACE_S = 60.0
_SSM_NAME = re.compile(r"^/prefect-sgpu/[0-9a-f]{16}/(?P<run>[^/]+)/(?:payload-key|secrets)$")
#: the files a live driver keeps in its job folder; none of them means the job has ended
_LIVE_FILES = (HEARTBEAT, PAYLOAD, STOP)
_LIVE_STATES = ["pending", "running", "stopping", "stopped"]


@dataclass(frozen=True)
class Leftover:
    """One thing of a dead run: ``kind`` is instance, security group, placement group,
    SSM parameter, store files or MLflow run."""

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
    instances: list[str] = field(default_factory=list)
    security_groups: list[str] = field(default_factory=list)
    placement_groups: list[str] = field(default_factory=list)
    ssm: list[str] = field(default_factory=list)
    mlflow_runs: list[str] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    tagged_ttl: float | None = None

    @property
    def cloud(self) -> bool:
        return bool(self.instances or self.security_groups or self.placement_groups or self.roles)


class Sweeper:
    """Finds and removes what dead runs of one job store left (see the module docstring).

    ``ec2`` (a provisioner) and ``ssm`` (a boto3 client) are the cloud side, absent for a
    local store; ``tracking_uri`` the MLflow store, if any; ``ttl_s`` the heartbeat TTL of
    runs whose resources do not say theirs.
    """

    def __init__(self, store: "Store", *, ttl_s: float, ec2: "EC2Provisioner | None" = None,
                 ssm: Any | None = None, tracking_uri: str | None = None, grace_s: float | None = None,
                 exclude: Iterable[str] = (), iam: Any | None = None) -> None:
        self.store, self.tracking_uri = store, tracking_uri
        self.ec2, self.ssm, self.iam = ec2, ssm, iam  # the cloud's side; None for a local store
        self.ttl_s, self.grace_s, self.exclude = ttl_s, grace_s, set(exclude)
        #: (the store's clock, this machine's monotonic clock) when the pass first read the store's
        self._store_clock: tuple[float, float] | None = None

    # -- the pass -------------------------------------------------------------------

    def sweep(self, dry_run: bool = False, scan_store: bool = True, wait: bool = True) -> SweepReport:
        """Find, judge, remove. ``scan_store=False`` skips listing every job folder of the store
        (the pass at job start: it judges the runs that have cloud resources or a RUNNING MLflow
        run); ``wait=False`` never waits for instances to terminate."""
        report = SweepReport(dry_run=dry_run)
        runs: dict[str, _Run] = {}
        self._store_clock = None

        def run(run_id: str) -> _Run:
            return runs.setdefault(run_id, _Run(run_id))

        for step in (self._find_cloud, self._find_roles, self._find_ssm, self._find_mlflow):
            try:
                step(run)
            except Exception as exc:  # noqa: BLE001 - one unreachable service must not stop the rest
                report.errors.append(f"{step.__name__.strip('_').replace('_', ' ')}: {type(exc).__name__}: {exc}")
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
        if not (found.cloud or found.ssm or found.mlflow_runs or control):
            return  # an ended job's logs and checkpoints: nothing to do
        if found.ssm and not found.cloud and not found.mlflow_runs and not (files or folders):
            report.live[found.run_id] = "an SSM parameter of a job with no folder in this store (yet)"
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
        items = [("instance", i) for i in found.instances]
        items += [("security group", g) for g in found.security_groups]
        items += [("placement group", g) for g in found.placement_groups]
        items += [("SSM parameter", p) for p in found.ssm]
        items += [("IAM role", r) for r in found.roles]
        if control:
            items.append(("store files", ", ".join(control)))
        items += [("MLflow run", r) for r in found.mlflow_runs]
        leftovers = [Leftover(found.run_id, kind, name, why) for kind, name in items]
        report.found += leftovers
        if dry_run:
            return
        removed: set[tuple[str, str]] = set()
        if found.cloud and self.ec2 is not None:
            gone = self.ec2.terminate(found.run_id, wait=wait)
            removed |= {("instance", i) for i in found.instances if i in gone}
            removed |= {("security group", g) for g in found.security_groups if f"security group {g}" in gone}
            removed |= {("placement group", g) for g in found.placement_groups if f"placement group {g}" in gone}
        for name in found.ssm:
            if self._delete_parameter(name):
                removed.add(("SSM parameter", name))
        if found.roles and self.iam is not None:
            from prefect_sgpu.compute.ec2 import roles

            if any(g.startswith("IAM role") for g in roles.delete(self.iam, found.run_id)):
                removed |= {("IAM role", r) for r in found.roles}
        if control:
            for key in CONTROL:
                self.store.delete(found.run_id, key)
            removed.add(("store files", ", ".join(control)))
        for mlflow_run in found.mlflow_runs:
            if self._kill_mlflow_run(mlflow_run, why):
                removed.add(("MLflow run", mlflow_run))
        report.removed += [x for x in leftovers if (x.kind, x.name) in removed]

    def store_now(self) -> float:
        """Now on the store's clock (:meth:`Store.clock`), read from the store once a pass and carried
        forward on this machine's monotonic clock, which measures only how long the pass has run."""
        if self._store_clock is None:
            self._store_clock = (self.store.clock(), time.monotonic())
        at, then = self._store_clock
        return at + (time.monotonic() - then)

    # -- finding ----------------------------------------------------------------------

    def _find_cloud(self, run: Any) -> None:
        if self.ec2 is None:
            return
        from prefect_sgpu.compute.ec2 import request as rq

        client = self.ec2.client("ec2")
        tagged = [{"Name": "tag-key", "Values": [rq.RUN_ID_TAG]}]

        def ours(tags: list[dict[str, str]]) -> str | None:
            values = {t["Key"]: t["Value"] for t in tags or []}
            if values.get(rq.STORE_TAG) != self.store.root_uri:
                return None
            found = run(values[rq.RUN_ID_TAG])
            try:
                found.tagged_ttl = float(values[rq.HEARTBEAT_TTL_TAG])
            except (KeyError, ValueError):
                pass
            return values[rq.RUN_ID_TAG]

        filters = [*tagged, {"Name": "instance-state-name", "Values": _LIVE_STATES}]
        for page in client.get_paginator("describe_instances").paginate(Filters=filters):
            for reservation in page["Reservations"]:
                for inst in reservation["Instances"]:
                    if (run_id := ours(inst.get("Tags", []))) is not None:
                        run(run_id).instances.append(inst["InstanceId"])
        for group in client.describe_security_groups(Filters=tagged).get("SecurityGroups", []):
            if group["GroupId"] != self.ec2.settings.security_group_id and (run_id := ours(group.get("Tags", []))):
                run(run_id).security_groups.append(group["GroupId"])
        for group in client.describe_placement_groups(Filters=tagged).get("PlacementGroups", []):
            if group.get("State") != "deleted" and (run_id := ours(group.get("Tags", []))):
                run(run_id).placement_groups.append(group["GroupName"])

    def _find_roles(self, run: Any) -> None:
        """Job roles (``job_roles=True``) of this store's runs."""
        if self.iam is None:
            return
        from prefect_sgpu.compute.ec2 import request as rq
        from prefect_sgpu.compute.ec2 import roles

        for run_id, tags in roles.job_role_runs(self.iam, self.store.scope).items():
            if tags.get(rq.STORE_TAG) == self.store.root_uri:
                found = run(run_id)
                found.roles.append(roles.role_name(run_id))
                if found.tagged_ttl is None and rq.HEARTBEAT_TTL_TAG in tags:
                    try:
                        found.tagged_ttl = float(tags[rq.HEARTBEAT_TTL_TAG])
                    except ValueError:
                        pass

    def _find_ssm(self, run: Any) -> None:
        """The job parameters tagged with this store (the driver tags them as it writes them): a
        parameter's name says its run, never its store, and a run's folder name can be made in any
        store by whoever writes it. Untagged parameters are never listed."""
        if self.ssm is None:
            return
        from prefect_sgpu.compute.ec2 import request as rq

        filters = [{"Key": "Name", "Option": "BeginsWith", "Values": [ssm_root(self.store.scope)]},
                   {"Key": f"tag:{rq.STORE_TAG}", "Values": [self.store.root_uri]}]
        for page in self.ssm.get_paginator("describe_parameters").paginate(ParameterFilters=filters):
            for parameter in page.get("Parameters", []):
                match = _SSM_NAME.match(parameter["Name"])
                if match and parameter["Name"] in (ssm_key_parameter(match["run"], self.store.scope),
                                                   ssm_secrets_parameter(match["run"], self.store.scope)):
                    run(match["run"]).ssm.append(parameter["Name"])

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

    def _delete_parameter(self, name: str) -> bool:
        try:
            self.ssm.delete_parameter(Name=name)
            return True
        except Exception as exc:  # noqa: BLE001
            if aws.error_code(exc) == "ParameterNotFound":
                return False
            raise

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
    """The sweeper of a compute (one that builds its own, as ``EC2InstanceCompute.sweeper`` does
    with its clients and TTL, or any compute with a store) or of a store alone; the default is
    this machine's local job store with the local heartbeat TTL."""
    own = compute.sweeper(tracking_uri, **options) if compute is not None else None
    if own is not None:
        return own
    if store is None:
        from prefect_sgpu.store import LocalStore

        store = (compute.default_store() if compute is not None else None) or LocalStore()
    from prefect_sgpu.compute.local import heartbeat_ttl

    options.setdefault("ttl_s", heartbeat_ttl())
    return Sweeper(store, tracking_uri=tracking_uri, **options)


def start_of_job_pass(compute: Any, run_id: str, tracking_uri: str | None) -> None:
    """The sweep a remote job makes before it launches (with ``compute.sweeper``, leaving the job
    itself out): never fails the job, never waits."""
    try:
        compute.sweeper(tracking_uri, exclude=[run_id]).sweep(scan_store=False, wait=False)
    except Exception:  # noqa: BLE001 - tidying up must not cost a job
        logger.warning("the sweep before job %s failed; the job goes on", run_id, exc_info=True)
