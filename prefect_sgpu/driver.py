"""Run one distributed job from start to finish, and clean up on every path.

Order matters: everything that can be checked (spec, plan, payload) is checked
before the store, MLflow or any process is touched; once anything exists, a
``finally`` stops every rank, releases the compute and ends the MLflow run. The
driver speaks to every compute through the same contract
(:mod:`prefect_sgpu.compute.base`) and to nodes only through sealed documents in the
job folder (:mod:`prefect_sgpu.jobfolder`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from prefect_sgpu import interrupts
from prefect_sgpu import payload as payload_mod
from prefect_sgpu import progress_watch
from prefect_sgpu.compute.base import (Allocation, Compute, JobLaunch, NodeCommand, NodeExited, NodeLost, NodeNotice,
                                       NodeUp, Released, Request, rank_prefect_environment, total_cost)
from prefect_sgpu.errors import (EnvironmentMismatch, GangCheckFailed, HeartbeatExpired, InfrastructureLost, JobCancelled, JobHung,
                                 LaunchTimeout, ProvisioningError, RankFailedError, SGPUConfigError, SGPUError)
from prefect_sgpu.heartbeat import HEARTBEAT_INTERVAL_S, DriverHeartbeat, Outage
from prefect_sgpu.jobfolder import GANG_ENV, HEARTBEAT_STOP, RANK_STARTS, JobFolder, NodeStatus, new_key
from prefect_sgpu.logs import LogTailer, RankLogSink
from prefect_sgpu.spec import JobSpec, Plan
from prefect_sgpu.store import Store
from prefect_sgpu.tracking import TrackedRun, active_parent, mlflow_available, start_run

logger = logging.getLogger("prefect_sgpu.driver")

RELAY_INTERVAL_S = 5.0
POLL_INTERVAL_S = 0.05


@dataclass
class RankReport:
    rank: int
    node: int
    host: str
    exit_code: int
    duration_s: float


@dataclass
class Recovery:
    """One relaunch after infrastructure loss: what was lost, from where the new gang resumed."""

    gang: int
    nodes: dict[int, str]
    reason: str
    #: the newest complete checkpoint step the new gang found (None: it started from scratch)
    resumed_from_step: int | None
    #: seconds from the loss being noticed to the new gang's launch (stop, release, provisioning)
    reprovision_s: float
    #: seconds of the lost gang's run after its last complete checkpoint (work redone)
    lost_work_s: float | None
    #: "nodes": only the lost nodes were replaced, the others kept; "gang": the whole gang was
    replaced: str = "gang"
    #: the nodes kept (index -> instance or host) when only the lost ones were replaced
    kept: dict[int, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"gang": self.gang, "nodes": {str(k): v for k, v in self.nodes.items()}, "reason": self.reason,
                "resumed_from_step": self.resumed_from_step, "reprovision_s": round(self.reprovision_s, 1),
                "lost_work_s": None if self.lost_work_s is None else round(self.lost_work_s, 1),
                "replaced": self.replaced, "kept": {str(k): v for k, v in self.kept.items()}}


@dataclass
class _GangEnd:
    codes: dict[int, int]
    statuses: dict[int, NodeStatus]
    lost: dict[int, str]
    notices: dict[int, str]

    @property
    def ok(self) -> bool:
        return not any(self.codes.values())

    def infrastructure(self) -> dict[int, str]:
        """Nodes whose end was the infrastructure's doing (lost, or reclaimed after a notice)."""
        found = dict(self.lost)
        for node, notice in self.notices.items():
            found.setdefault(node, f"reclaim notice: {notice}")
        for node, status in self.statuses.items():
            if status.notice and node not in found:
                found[node] = f"reclaim notice: {status.notice}"
        return found


def _stopped_for_heartbeat(statuses: dict[int, NodeStatus]) -> dict[int, NodeStatus]:
    """The nodes that stopped themselves because no new driver heartbeat reached them."""
    return {i: s for i, s in sorted(statuses.items()) if (s.stopped or "").startswith(HEARTBEAT_STOP)}


@dataclass
class JobResult:
    """What a finished job leaves behind, beyond the values."""

    run_id: str
    values: list[Any]
    plan: Plan
    ranks: list[RankReport] = field(default_factory=list)
    mlflow_run_id: str | None = None
    mlflow_tracking_uri: str | None = None
    logs_uri: str = ""
    duration_s: float = 0.0
    #: what the compute charged for, when it knows (EC2: instance-hours and estimated USD)
    cost: dict[str, Any] | None = None
    #: what release removed (instances, groups, parameters, processes)
    released: list[str] = field(default_factory=list)
    #: relaunches after infrastructure loss (spot reclaim, lost node), oldest first
    recoveries: list[Recovery] = field(default_factory=list)
    #: ranks named as stragglers (:mod:`prefect_sgpu.stragglers`), in the order they were named
    stragglers: list[Any] = field(default_factory=list)
    #: each rank's latest step rate (steps per second) as the straggler watch measured it, where it did
    step_rates: dict[int, float] = field(default_factory=dict)
    #: the gang check's report (:mod:`prefect_sgpu.gang_check`): seconds, each node link's bandwidth,
    #: slow links and nodes, GPU warnings; None where it did not run
    gang_check: dict[str, Any] | None = None


#: how cold node agents start their ranks: auto (the default: fork where ranks use no GPU), spawn or fork
RANK_START_ENV = "PREFECT_SGPU_RANK_START"


def rank_start() -> str:
    """``PREFECT_SGPU_RANK_START``, checked: ``auto`` (the default), ``spawn`` or ``fork``."""
    raw = os.environ.get(RANK_START_ENV, "").strip().lower() or "auto"
    if raw not in RANK_STARTS:
        raise SGPUConfigError(RANK_START_ENV, raw, " or ".join(RANK_STARTS))
    return raw


class Launcher:
    """What each node of a node compute runs. The default: torch elastic with ``procs_per_node`` ranks."""

    name = "torchrun"

    def node_argv(self, job: "Job", request: Request, node: int, address: str, endpoint: str) -> list[str]:
        plan = request.plan
        return [
            sys.executable, "-m", "prefect_sgpu.launch.node_agent",
            f"--run-id={job.run_id}", f"--job-dir={job.store.uri(job.run_id)}",
            f"--node-index={node}", f"--nnodes={plan.nodes}",
            f"--nproc-per-node={plan.procs_per_node}", f"--rdzv-endpoint={endpoint}",
            f"--local-addr={address}", f"--max-restarts={job.spec.max_restarts}",
            f"--heartbeat-ttl={request.heartbeat_ttl_s:g}", f"--join-timeout={min(job.spec.timeout, 600):g}",
            f"--hang-timeout={job.spec.hang_timeout or 0:g}", f"--rank-start={rank_start()}",
        ]

    def result_ranks(self, plan: Plan) -> list[int]:
        """The ranks whose envelopes make up the job's values, in order."""
        return list(range(plan.world_size))


TorchrunLauncher = Launcher


def new_run_id(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:32] or "job"
    return f"{slug}-{uuid.uuid4().hex[:10]}"


class Job:
    """One call of a distributed function or script."""

    def __init__(
        self,
        call: payload_mod.FunctionCall | payload_mod.ScriptCall,
        spec: JobSpec,
        compute: Compute,
        store: Store,
        sink: RankLogSink | None = None,
        cancel_event: threading.Event | None = None,
        tags: dict[str, str] | None = None,
        launcher: "Launcher | None" = None,
    ) -> None:
        self.call = call
        self.spec = spec
        self.compute = compute
        self.store = store
        self.sink = sink or RankLogSink(call.name)
        self.cancel_event = cancel_event or threading.Event()
        self.tags = tags or {}
        self.launcher = launcher or TorchrunLauncher()
        self.run_id = new_run_id(call.name)
        self.plan: Plan | None = None
        self.tracked: TrackedRun | None = None
        self.allocation: Allocation | None = None
        self.folder: JobFolder | None = None
        self.heartbeat: DriverHeartbeat | None = None
        self.started_at = 0.0
        self._prepared: tuple[Request, bytes, str] | None = None
        self._secrets: dict[str, str] | None = None
        self.recoveries: list[Recovery] = []
        self.stragglers: list[Any] = []
        #: called with each straggler as it is named (the task runner's event and artifact)
        self.straggler_listeners: list[Any] = []
        self.straggler_watch: progress_watch.StragglerWatch | None = None
        self._released: list[Released] = []
        self._reprovision_started: float | None = None
        self.relay: Any = None
        self.mlflow_parent = active_parent() if spec.mlflow else None

    # -- preparation (nothing spent) ---------------------------------------------

    def prepare(self) -> tuple[Request, bytes, str]:
        """Request and payload, checked and built once; raises before anything is started."""
        if self._prepared is None:
            rank_start()  # a bad setting fails here, before anything is spent
            request = self.compute.plan(self.spec, self.run_id)
            self._prepared = (request, payload_mod.build(self.call), new_key())
        return self._prepared

    def launch(self, request: Request, addresses: list[str], endpoint: str) -> JobLaunch:
        env = {
            **self.spec.rank_env(),
            "SGPU_RUN_ID": self.run_id,
            "SGPU_JOB_DIR": self.store.uri(self.run_id),
            "PYTHONUNBUFFERED": "1",
            **({GANG_ENV: str(self.folder.gang)} if self.folder is not None and self.folder.gang else {}),
            **self._checkpoint_env(),
            **self._tracking_env(),
            **rank_prefect_environment(),  # last: no Prefect credential reaches a rank, not even via env=
        }
        commands = [NodeCommand(i, self.launcher.node_argv(self, request, i, address, endpoint))
                    for i, address in enumerate(addresses)]
        return JobLaunch(env=env, commands=commands, rendezvous=endpoint,
                         secrets={**self.secret_values(), **self._checkpoint_key(), **self._index_secret()})

    def secret_values(self) -> dict[str, str]:
        """The ``secrets=`` of the spec, read from their Prefect Secret blocks once (in memory only);
        a block that cannot be read fails the job before anything is started."""
        if self._secrets is None:
            values: dict[str, str] = {}
            for name, block in sorted(self.spec.secrets.items()):
                try:
                    from prefect.blocks.system import Secret

                    value = Secret.load(block, _sync=True).get()
                except Exception as exc:  # noqa: BLE001 - named, with the block, for the user
                    raise SGPUConfigError(f"secrets[{name}]", block, "the name of a Prefect Secret block this "
                                          f"driver can read ({type(exc).__name__}: {exc})") from None
                values[name] = value if isinstance(value, str) else json.dumps(value)
            self._secrets = values
        return self._secrets

    def _relays_mlflow(self) -> bool:
        """Remote nodes cannot write the driver's tracking file: they relay through the job store."""
        from prefect_sgpu.mlflow_relay import relays

        return (self.tracked is not None and self.compute.remote and self.compute.runs_node_agents
                and relays(self.tracked.tracking_uri))

    def _tracking_env(self) -> dict[str, str]:
        if self.tracked is None:
            return {}
        env = dict(self.tracked.env)
        if self._relays_mlflow():
            from prefect_sgpu.mlflow_relay import SCHEME

            env["MLFLOW_TRACKING_URI"] = f"{SCHEME}:"
        return env

    def _checkpoint_env(self) -> dict[str, str]:
        """Checkpoints on the job's store (they outlive nodes and relaunches), unless the caller chose."""
        from prefect_sgpu.checkpoints import DIR_ENV, URI_ENV

        if URI_ENV in self.spec.env or DIR_ENV in self.spec.env:
            return {}
        return {URI_ENV: self.store.uri(self.run_id, "checkpoints")}

    def _checkpoint_key(self) -> dict[str, str]:
        """The checkpoint location's key, for the ranks: it travels as ``secrets=`` do (never in the store)
        and, derived from the driver's checkpoint secret per location, is the same for every retry of a
        task (:mod:`prefect_sgpu.checkpoint_manifest`)."""
        from prefect_sgpu.checkpoint_manifest import KEY_ENV, location_key
        from prefect_sgpu.checkpoints import DIR_ENV, URI_ENV

        env = {**self._checkpoint_env(), **self.spec.env}
        uri = env.get(URI_ENV) or env.get(DIR_ENV)
        return {KEY_ENV: location_key(uri)} if uri else {}

    def _index_secret(self) -> dict[str, str]:
        """The environment's index URLs with their credentials, for a compute whose nodes build it: they
        travel as ``secrets=`` do (the manifest shows them masked), and are never a rank's variable."""
        from prefect_sgpu import environment_ship

        if not getattr(self.compute, "ships_environment", False):
            return {}
        return environment_ship.index_secret(self.spec.environment)

    def dry_run(self) -> dict[str, Any]:
        """The request and each node's command, without starting anything."""
        request, _body, _key = self.prepare()
        addresses = [f"<node-{i}>" for i in range(request.plan.nodes)]
        launch = self.launch(request, addresses, "<node-0>:<port>")
        return {"plan": request.plan, **request.describe(), "nodes": launch.describe(self.compute, request)}

    # -- run ------------------------------------------------------------------

    def run(self) -> JobResult:
        """Run the job to its end; Ctrl-C, SIGTERM/SIGHUP and interpreter exit stop it cleanly."""
        interrupts.install()
        with interrupts.running(self.cancel_event):
            return self._run()

    def _run(self) -> JobResult:
        request, body, key = self.prepare()
        # unreadable or undeliverable: fails before spending; sized as they travel (the checkpoint key too)
        self.compute.check_secrets({**self.secret_values(), **self._checkpoint_key(), **self._index_secret()})
        plan = self.plan = request.plan
        self.started_at = time.monotonic()
        deadline = self.started_at + self.spec.timeout
        folder = self.folder = JobFolder(self.store, self.run_id, key)
        outcome = "KILLED"
        tailer: LogTailer | None = None
        result: JobResult | None = None
        released = None
        try:
            folder.put_payload(body)
            self.heartbeat = DriverHeartbeat(folder).start()  # the driver's alone, until the folder goes
            if self.spec.mlflow and mlflow_available():
                self.tracked = start_run(
                    self.call.name,
                    tags={"sgpu.run_id": self.run_id, "sgpu.store": self.store.root_uri, **self.tags},
                    params={"sgpu.gpus": self.spec.gpus, "sgpu.nodes": plan.nodes,
                            "sgpu.procs_per_node": plan.procs_per_node,
                            "sgpu.gpu_type": self.spec.gpu_type or plan.device,
                            "sgpu.compute": request.compute},
                    parent=self.mlflow_parent,
                )
            self.sink.info(
                f"{self.call.name}: starting {plan.world_size} rank(s) on {plan.nodes} node(s) "
                f"[{plan.device}, {request.compute}], job {self.run_id}"
            )
            tailer = LogTailer(self.store, self.run_id, plan.procs_per_node, self.sink.line).start()
            if self._relays_mlflow():
                from prefect_sgpu.mlflow_relay import MetricRelay

                assert self.tracked is not None
                self.relay = MetricRelay(self.store, self.run_id, self.tracked.tracking_uri, self.tracked.run_id,
                                         key)
            end = self._run_gangs(request, folder, deadline, tailer)
            tailer.poll()
            result = self._collect(self.plan, end)
            self._tell_gang_check(result.gang_check)
            outcome = "FINISHED"
        except (RankFailedError, LaunchTimeout, JobHung, EnvironmentMismatch):
            outcome = "FAILED"
            raise
        except BaseException as exc:
            outcome = "FAILED" if getattr(exc, "sgpu_failure", None) is not None else "KILLED"
            raise
        finally:
            # to its end even when an exception is raised into this thread meanwhile (Prefect's task timeout)
            released = interrupts.shielded(self._cleanup, outcome, tailer)
        assert result is not None
        every = [*self._released, *([released] if released is not None else [])]
        result.cost = total_cost([r.cost for r in every])
        result.released = [g for r in every for g in r.gone]
        result.recoveries = list(self.recoveries)
        result.stragglers = list(self.stragglers)
        result.step_rates = self.straggler_watch.detector.rates() if self.straggler_watch is not None else {}
        return result

    def _tell_gang_check(self, report: dict[str, Any] | None) -> None:
        from prefect_sgpu import gang_check

        if report:
            info, warnings = gang_check.describe(report)
            self.sink.info(f"{self.call.name}: {info}")
            for line in warnings:
                self.sink.warning(f"{self.call.name}: {line}")

    def _run_gangs(self, request: Request, folder: JobFolder, deadline: float, tailer: LogTailer) -> _GangEnd:
        """Acquire, start and wait; after infrastructure loss, replace what was lost (only the lost nodes
        where the compute can, else the whole gang) and do it again (``max_recoveries``)."""
        gang = 0
        allocation: Allocation | None = None
        while True:
            if allocation is None:
                allocation = self.allocation = self.compute.acquire(request, folder, deadline, self.cancel_event)
            tailer.node_of = lambda rank, a=allocation: self.compute.node_of_rank(a, rank)
            self.plan = allocation.plan  # a job compute may refine the device it got
            endpoint = self.compute.rendezvous_endpoint(allocation)
            launch = self.launch(request, [n.address for n in allocation.nodes], endpoint)
            self.compute.start(allocation, launch)
            gang_started = time.monotonic()
            end = self._wait(deadline)
            lost = end.infrastructure() if not end.ok else {}
            unfit = self._failed_gang_check(allocation) if not end.ok and not lost else {}
            if unfit and len(self.recoveries) >= self.spec.max_recoveries:
                return end  # the gang check's own error is the job's
            lost = lost or unfit
            if not lost or _stopped_for_heartbeat(end.statuses):
                return end  # a node that stopped itself for a stale heartbeat was not lost: it is the error
            hosts = {n.index: n.instance_id or n.host for n in allocation.nodes}
            reason = "; ".join(f"node {i} ({hosts.get(i, '?')}): {why}" for i, why in sorted(lost.items()))
            if len(self.recoveries) >= self.spec.max_recoveries:
                self.compute.stop(allocation)
                node = min(lost)
                raise InfrastructureLost(
                    None, hosts.get(node), end.codes.get(node), None,
                    f"infrastructure lost: {reason}; {len(self.recoveries)} recovery(ies) made, "
                    f"max_recoveries={self.spec.max_recoveries}", node=node,
                    recoveries=[r.as_dict() for r in self.recoveries])
            noticed, noticed_at = time.monotonic(), time.time()
            gang += 1
            self.sink.warning(f"{self.call.name}: {reason}; replacing it (recovery {gang} of at most "
                              f"{self.spec.max_recoveries})")
            try:
                self.compute.stop(allocation)
            except BaseException:
                self._released.append(self.compute.release(allocation))
                self.allocation = None
                raise
            # read once the lost gang is gone: a save it was sealing when the loss was seen may have
            # completed since, and the next gang resumes from that one
            step, lost_work = self._checkpoint_progress(noticed - gang_started, noticed_at)
            if self.relay is not None:
                self.relay.restart()
            tailer.restart(lambda g=gang: folder.reset_for_relaunch(g))
            request = self.compute.replan(request, gang)
            replaced = self._replace_lost(allocation, set(lost), request, deadline)
            recovery = Recovery(gang=gang, nodes={i: hosts.get(i, "?") for i in lost}, reason=reason,
                                resumed_from_step=step, reprovision_s=0.0, lost_work_s=lost_work,
                                replaced="nodes" if replaced else "gang",
                                kept={n.index: n.instance_id or n.host for n in allocation.nodes
                                      if n.index not in lost} if replaced else {})
            if not replaced:
                try:
                    self._released.append(self.compute.release(allocation))
                finally:
                    self.allocation = allocation = None
                folder.reset_nodes()  # what the nodes of a replacement given up wrote
            self.recoveries.append(recovery)
            self._reprovision_started = noticed

    def _failed_gang_check(self, allocation: Allocation) -> dict[int, str]:
        """The nodes the gang check found at fault, when they are some of a remote gang's nodes (not all:
        a fault every node shares is the job's, not a machine's): replaced like lost ones, what each saw."""
        if not self.compute.remote or len(allocation.nodes) < 2:
            return {}
        for envelope in sorted((e for e in self._envelopes().values() if not e.ok), key=lambda e: e.finished):
            exc = envelope.exception()
            if not isinstance(exc, GangCheckFailed):
                continue
            nodes = exc.nodes
            if not 0 < len(nodes) < len(allocation.nodes):
                return {}
            own = {r: info for r, info in exc.failed.items() if not info.get("collateral")}
            return {node: "failed the gang check: " + "; ".join(
                        f"rank {r}: {info.get('error', '?')}" for r, info in sorted(own.items())
                        if info.get("node") == node) for node in nodes}
        return {}

    def _replace_lost(self, allocation: Allocation, lost: set[int], request: Request, deadline: float) -> bool:
        """Only the lost nodes replaced, the others kept (True); False when the compute cannot, the nodes it
        would keep are unfit, or the new nodes could not be had (the whole gang is replaced then)."""
        try:
            released = self.compute.replace_nodes(allocation, lost, request, deadline, self.cancel_event)
        except (ProvisioningError, LaunchTimeout, EnvironmentMismatch) as exc:
            if self.cancel_event.is_set() or time.monotonic() >= deadline:
                raise
            self.sink.warning(f"{self.call.name}: the lost node(s) could not be replaced alone ({exc}); "
                              "relaunching the whole gang on new capacity")
            return False
        if released is None:
            return False
        self._released.append(released)
        self.sink.info(f"{self.call.name}: node(s) {sorted(lost)} replaced by new capacity, "
                       f"{len(allocation.nodes) - len(lost)} node(s) kept")
        return True

    def _checkpoint_progress(self, gang_ran_s: float, noticed_at: float) -> tuple[int | None, float | None]:
        """The newest complete checkpoint step and the seconds of work the lost gang did after it, until
        its loss was noticed (``noticed_at``, wall clock; ``gang_ran_s``: how long it had run then)."""
        from prefect_sgpu.checkpoints import DIR_ENV, URI_ENV, Location, step_dir_name

        env = {**self._checkpoint_env(), **self.spec.env}
        uri = env.get(URI_ENV) or env.get(DIR_ENV)
        if not uri:
            return None, None
        try:
            location = Location(uri)
            steps = location.complete_steps()
            if not steps:
                return None, gang_ran_s
            manifest = location.manifest(step_dir_name(steps[-1]))
            written = manifest.info.get("written_at") if manifest is not None else None
            return steps[-1], (max(0.0, noticed_at - written) if written else None)
        except Exception:  # noqa: BLE001 - a report, not a reason to fail the relaunch
            logger.debug("could not read the checkpoints of job %s", self.run_id, exc_info=True)
            return None, None

    def _wait(self, deadline: float) -> _GangEnd:
        """Poll the compute until every node exited, or one failed or was lost.

        After a failure the driver polls ``compute.loss_grace_s`` longer for a loss that
        explains it: a lost node's peers often fail first, on a broken collective.
        """
        assert self.allocation is not None and self.folder is not None
        end = _GangEnd({}, {}, {}, {})
        total = len(self.allocation.nodes)
        failed_at: float | None = None
        if self._reprovision_started is not None and self.recoveries:
            self.recoveries[-1].reprovision_s = time.monotonic() - self._reprovision_started
            self._reprovision_started = None
        outage = Outage(self.run_id, self._node_ttl())
        # this gang's: a relaunched gang's steps start over
        watch = self.straggler_watch = progress_watch.for_job(self)
        while True:
            now = time.monotonic()
            events: list[Any] = []
            try:
                events = self.compute.poll(self.allocation)
                outage.over()
            except SGPUError:
                raise
            except Exception as exc:  # noqa: BLE001 - the store (or the cloud API) is unreachable for now
                outage.failed(exc)
            for event in events:
                if isinstance(event, NodeExited):
                    end.codes[event.node] = event.exit_code
                    if event.status is not None:
                        end.statuses[event.node] = event.status
                elif isinstance(event, NodeLost):
                    end.codes[event.node] = 137
                    end.lost[event.node] = event.reason
                elif isinstance(event, NodeNotice):
                    if event.node not in end.notices:
                        self.sink.warning(f"{self.call.name}: node {event.node} will be reclaimed ({event.notice}); "
                                          "its ranks were told to checkpoint")
                    end.notices[event.node] = event.notice
                elif isinstance(event, NodeUp):
                    logger.debug("job %s: node %d up on %s", self.run_id, event.node, event.host)
            now = time.monotonic()
            if len(end.codes) == total:
                return end
            if any(end.codes.values()):
                if end.infrastructure():
                    return end
                failed_at = failed_at or now
                if now - failed_at >= self.compute.loss_grace_s:
                    return end
            if self.cancel_event.is_set():
                raise JobCancelled(f"job {self.run_id} was cancelled; every rank was stopped")
            if now > deadline:
                raise LaunchTimeout(self.run_id, self.spec.timeout)
            if self.relay is not None:
                self.relay.poll(every=RELAY_INTERVAL_S)
            for straggler in watch.poll() if watch is not None else ():
                progress_watch.name(self, straggler)
            self.cancel_event.wait(POLL_INTERVAL_S)

    def _node_ttl(self) -> float:
        return self._prepared[0].heartbeat_ttl_s if self._prepared else 60.0

    def _envelopes(self) -> dict[int, payload_mod.Envelope]:
        assert self.folder is not None
        outage = Outage(self.run_id, self._node_ttl())
        while True:
            try:
                results = self.folder.results()
                break
            except SGPUError:
                raise
            except Exception as exc:  # noqa: BLE001 - the results are there; the store will answer again
                outage.failed(exc)
                time.sleep(1.0)
        return {rank: payload_mod.load_envelope(body) for rank, body in results.items()}

    def _collect(self, plan: Plan, end: _GangEnd) -> JobResult:
        codes, statuses, lost = end.codes, end.statuses, end.lost
        if any(codes.values()):
            if self.allocation is not None:
                self.compute.stop(self.allocation)  # the other nodes, before reading envelopes
            raise self._failure(codes, statuses, lost)
        envelopes = self._envelopes()
        expected = self.launcher.result_ranks(plan)
        missing = [r for r in expected if r not in envelopes]
        if missing:
            raise RankFailedError(missing[0], None, None, None,
                                  f"rank(s) {missing} exited without a result")
        if any(not e.ok for e in envelopes.values()):
            raise self._failure(codes, statuses, lost)
        values = [envelopes[r].value() for r in expected]
        ranks = [RankReport(e.rank, e.node, e.host, e.exit_code, e.finished - e.started)
                 for e in (envelopes[r] for r in expected)]
        return JobResult(
            run_id=self.run_id, values=values, plan=plan, ranks=ranks,
            mlflow_run_id=self.tracked.run_id if self.tracked else None,
            mlflow_tracking_uri=self.tracked.tracking_uri if self.tracked else None,
            logs_uri=self.store.uri(self.run_id, "logs"),
            duration_s=time.monotonic() - self.started_at,
            gang_check=next((e.gang_check for e in envelopes.values() if e.gang_check), None),
        )

    def _failure(self, codes: dict[int, int], statuses: dict[int, NodeStatus],
                 lost: dict[int, str]) -> BaseException:
        """JobHung when a watchdog stopped the job; else the first failing rank's own exception
        (with rank/host notes); else RankFailedError."""
        hung = {int(rank): info.model_dump() for status in statuses.values() for rank, info in status.hung.items()}
        if hung:
            return JobHung(self.run_id, self.spec.hang_timeout or 0.0, hung)
        failed = sorted((e for e in self._envelopes().values() if not e.ok), key=lambda e: e.finished)
        expired = self._heartbeat_expired(statuses, failed)
        if expired is not None:
            return expired
        if failed:
            first = failed[0]
            info = RankFailedError(first.rank, first.host, first.exit_code, first.traceback,
                                   f"{first.exc_type}: {first.exc_message}", node=first.node)
            original = first.exception()
            if original is None or not isinstance(original, Exception):
                return info
            original.sgpu_failure = info  # type: ignore[attr-defined]
            original.add_note(
                f"[prefect-sgpu] raised in rank {first.rank} (node {first.node}) on {first.host}, "
                f"exit code {first.exit_code}, job {self.run_id}\nRemote traceback:\n"
                + (first.traceback or "").rstrip()
            )
            return original
        hosts = {n.index: n.host for n in (self.allocation.nodes if self.allocation else [])}
        for index, code in sorted(codes.items()):
            if not code:
                continue
            if index in lost:
                return RankFailedError(None, hosts.get(index), code, None, lost[index], node=index)
            status = statuses.get(index) or (self.folder.status(index) if self.folder else None)
            if status is not None and status.failures:
                rank, fail = min(status.failures.items(), key=lambda kv: int(kv[0]))
                how = f"killed by {fail.signal}" if fail.signal else "exited"
                return RankFailedError(int(rank), status.host or hosts.get(index), fail.exit_code, None,
                                       f"{how} without a Python exception (see its log)", node=index)
            why = (status.error if status else None) or (f"node {index}'s agent exited with code {code}"
                                                         + self._agent_output_tail(index))
            return RankFailedError(None, (status.host if status else None) or hosts.get(index), code, None, why,
                                   node=index)
        return RankFailedError(None, None, None, None, "the job failed without a report")

    def _heartbeat_expired(self, statuses: dict[int, NodeStatus],
                           failed: list[payload_mod.Envelope]) -> HeartbeatExpired | None:
        """A node that stopped itself for want of a new driver heartbeat is the cause; the errors its
        peers raised afterwards (a collective whose peer vanished) are collateral, named as such."""
        stale = _stopped_for_heartbeat(statuses)
        if not stale:
            return None
        index, status = next(iter(stale.items()))
        nodes = ", ".join(f"node {i}" for i in stale)
        message = (f"{nodes} stopped {'itself' if len(stale) == 1 else 'themselves'}: {status.stopped}, while "
                   f"the driver of job {self.run_id} still ran. Its heartbeat (written every "
                   f"{HEARTBEAT_INTERVAL_S:g}s) did not reach the node within the TTL: the driver's process was "
                   "too busy to write it, or the node could not read the job store. A longer heartbeat TTL "
                   "(ttl_minutes on EC2) rides such stalls out.")
        collateral = None
        if failed:
            first = failed[0]
            collateral = f"rank {first.rank} (node {first.node}): {first.exc_type}: {first.exc_message}"
            message += f" What the ranks raised after it is collateral; the first: {collateral}"
        return HeartbeatExpired(None, status.host, status.exit_code, None, message, node=index, collateral=collateral)

    def _agent_output_tail(self, index: int, lines: int = 12, limit: int = 3000) -> str:
        """The last lines a node agent printed (its import error, its own traceback), for a node
        that ended without a status: the reason is there, and nowhere else."""
        from prefect_sgpu.jobfolder import agent_output_key

        try:
            data = self.folder.store.get(self.run_id, agent_output_key(index)) if self.folder else None
        except Exception:  # noqa: BLE001 - the error is still raised, without the output
            return ""
        text = (data or b"")[-limit:].decode("utf-8", "replace").strip()
        if not text:
            return ""
        return "; the end of its output:\n" + "\n".join(text.splitlines()[-lines:])

    def _cleanup(self, outcome: str, tailer: LogTailer | None) -> Any:
        released = None
        try:
            if self.allocation is not None:
                try:
                    self.compute.stop(self.allocation)
                finally:
                    released = self.compute.release(self.allocation)
        finally:
            if tailer is not None:
                tailer.close()
            if self.relay is not None:
                self.relay.poll()  # the last metrics, before the run ends and the files go
            if self.tracked is not None:
                if self.recoveries:
                    import json

                    self.tracked.set_tags({"sgpu.recoveries": str(len(self.recoveries)),
                                           **{f"sgpu.recovery.{r.gang}": json.dumps(r.as_dict())[:5000]
                                              for r in self.recoveries}})
                self.tracked.end(outcome)
            if self.heartbeat is not None:
                self.heartbeat.stop()
            if self.folder is not None:
                try:
                    self.folder.delete_control_files()
                except Exception:  # noqa: BLE001 - the job's outcome matters more than tidiness
                    logger.warning("could not delete the control files of job %s", self.run_id, exc_info=True)
        return released
