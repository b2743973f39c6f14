"""Run one distributed job from start to finish, and clean up on every path.

Order matters: everything that can be checked (spec, plan, payload) is checked
before the store, MLflow or any process is touched; once anything exists, a
``finally`` stops every rank, releases the compute and ends the MLflow run. The
driver speaks to every compute through the same contract
(:mod:`prefect_sgpu.compute.base`) and to nodes only through sealed documents in the
job folder (:mod:`prefect_sgpu.protocol.jobfolder`).

The job's loop is here; what happens between a lost gang and the next is
:mod:`prefect_sgpu.driver.recovery`, and what a gang's end makes of the job (values or
the error) :mod:`prefect_sgpu.driver.results`.
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
from typing import Any

from prefect_sgpu.driver import cost_cap
from prefect_sgpu.driver import recovery as driver_recovery
from prefect_sgpu.driver import results as driver_results
from prefect_sgpu.driver import interrupts
from prefect_sgpu.driver import membership as membership_mod
from prefect_sgpu.driver.env_seconds import env_seconds
from prefect_sgpu.protocol import payload as payload_mod
from prefect_sgpu.observe import progress_watch
from prefect_sgpu.observe import timeline as timeline_mod
from prefect_sgpu.compute.base import (Allocation, Compute, JobLaunch, NodeCommand, NodeExited, NodeLost, NodeNotice,
                                       NodeUp, Released, Request, rank_prefect_environment, total_cost)
from prefect_sgpu.driver.recovery import GangEnd, Recovery
from prefect_sgpu.driver.results import JobResult, RankReport
from prefect_sgpu.errors import (EnvironmentMismatch, JobCancelled, JobHung, LaunchTimeout, RankFailedError,
                                 SGPUConfigError, SGPUError)
from prefect_sgpu.driver.heartbeat import DriverHeartbeat, Outage
from prefect_sgpu.protocol.jobfolder import GANG_ENV, RANK_STARTS, JobFolder, new_key
from prefect_sgpu.observe.logs import LogTailer, RankLogSink
from prefect_sgpu.spec import JobSpec, Plan
from prefect_sgpu.store import Store
from prefect_sgpu.observe.tracking import TrackedRun, active_parent, mlflow_available, start_run

logger = logging.getLogger("prefect_sgpu.driver.job")

__all__ = ["Job", "JobResult", "Launcher", "RankReport", "Recovery", "TorchrunLauncher", "new_run_id", "rank_start"]

RELAY_INTERVAL_S = 5.0
POLL_INTERVAL_S = 0.05

#: how cold node agents start their ranks: auto (the default: fork where ranks use no GPU), spawn or fork
RANK_START_ENV = "PREFECT_SGPU_RANK_START"


#: seconds a warm set's passed gang check stands for its next jobs while its nodes are unchanged (0: every job)
GANG_CHECK_REUSE_ENV = "PREFECT_SGPU_GANG_CHECK_REUSE_S"
DEFAULT_GANG_CHECK_REUSE_S = 300.0


def gang_check_reuse_s() -> float:
    """``PREFECT_SGPU_GANG_CHECK_REUSE_S``, checked: seconds >= 0 (300 by default)."""
    return env_seconds(GANG_CHECK_REUSE_ENV, DEFAULT_GANG_CHECK_REUSE_S, "seconds (a number >= 0; 0: check every job)")


#: seconds an elastic job's first nodes wait for the rest once its min nodes joined (torch elastic's last call)
ELASTIC_WAIT_ENV = "PREFECT_SGPU_ELASTIC_WAIT_S"
DEFAULT_ELASTIC_WAIT_S = 30


def elastic_wait_s() -> int:
    """``PREFECT_SGPU_ELASTIC_WAIT_S``, checked: whole seconds >= 0 (30 by default, torch elastic's)."""
    return int(env_seconds(ELASTIC_WAIT_ENV, DEFAULT_ELASTIC_WAIT_S, "whole seconds (a number >= 0) an elastic job's "
                           "first nodes wait for the rest once its min nodes joined; 0: start at once", whole=True))


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
            f"--local-addr={address}", f"--max-restarts={max_restarts(job.spec, plan)}",
            f"--heartbeat-ttl={request.heartbeat_ttl_s:g}", f"--join-timeout={min(job.spec.timeout, 600):g}",
            f"--hang-timeout={job.spec.hang_timeout or 0:g}", f"--rank-start={rank_start()}",
            *([f"--min-nodes={plan.min_nodes}", f"--elastic-wait={elastic_wait_s()}",
               f"--lost-after={membership_mod.lost_after_s()}"] if plan.elastic else []),
        ]

    def result_ranks(self, plan: Plan) -> list[int]:
        """The ranks whose envelopes make up the job's values, in order."""
        return list(range(plan.world_size))


TorchrunLauncher = Launcher


def max_restarts(spec: JobSpec, plan: Plan) -> int:
    """The restarts each node's agent may make: ``max_restarts``; an elastic job's agents also start their
    ranks again after each of at most ``max_recoveries`` lost nodes the job goes on without
    (:mod:`prefect_sgpu.driver.membership`): torch elastic counts that restart as a failure's."""
    return spec.max_restarts + (spec.max_recoveries if plan.elastic else 0)


def new_run_id(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:32] or "job"
    return f"{slug}-{uuid.uuid4().hex[:10]}"


def _node_key(allocation: Allocation) -> tuple[tuple[Any, ...], ...]:
    """What makes a warm set's gang check stand: each node's index, address, host and instance."""
    return tuple((n.index, n.address, n.host, n.instance_id) for n in allocation.nodes)


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
        #: called with each reading of the job's cost (``max_cost_usd``: the task run's progress artifact)
        self.cost_listeners: list[Any] = []
        self.cost_watch: cost_cap.CostWatch | None = None
        self.given_back: list[Released] = []
        #: an elastic job's membership changes, oldest first (:mod:`prefect_sgpu.driver.membership`)
        self.membership: list[membership_mod.MembershipChange] = []
        #: called with each membership change as it happens (the task runner's event and artifact)
        self.membership_listeners: list[Any] = []
        #: where the job's time went, per phase and node (:mod:`prefect_sgpu.observe.timeline`)
        self.timeline = timeline_mod.Timeline()
        self.reprovision_started: float | None = None
        self.relay: Any = None
        self.mlflow_parent = active_parent() if spec.mlflow else None
        #: seconds since the warm set this job runs on passed the gang check, where the job skips it
        self.gang_check_reused: float | None = None

    # -- preparation (nothing spent) ---------------------------------------------

    def prepare(self) -> tuple[Request, bytes, str]:
        """Request and payload, checked and built once; raises before anything is started."""
        if self._prepared is None:
            rank_start()  # a bad setting fails here, before anything is spent
            gang_check_reuse_s()
            elastic_wait_s()
            if self.spec.elastic:
                membership_mod.lost_after_s()
            request = self.compute.plan(self.spec, self.run_id)
            cost_cap.check(self.spec, self.compute, request)  # a cap on a compute without a price
            self._prepared = (request, payload_mod.build(self.call), new_key())
        return self._prepared

    def launch(self, request: Request, addresses: list[str], endpoint: str) -> JobLaunch:
        env = {
            **self.spec.rank_env(),
            "SGPU_RUN_ID": self.run_id,
            "SGPU_JOB_DIR": self.store.uri(self.run_id),
            "PYTHONUNBUFFERED": "1",
            **({GANG_ENV: str(self.folder.gang)} if self.folder is not None and self.folder.gang else {}),
            **self.checkpoint_env(),
            **self._tracking_env(),
            **rank_prefect_environment(),  # last: no Prefect credential reaches a rank, not even via env=
        }
        if self.gang_check_reused is not None:
            env.pop("SGPU_GANG_CHECK", None)
        commands = [NodeCommand(i, self.launcher.node_argv(self, request, i, address, endpoint))
                    for i, address in enumerate(addresses)]
        return JobLaunch(env=env, commands=commands, rendezvous=endpoint,
                         secrets={**self.secret_values(), **self._checkpoint_key(), **self._index_secret()},
                         node_command=lambda node, address: NodeCommand(
                             node, self.launcher.node_argv(self, request, node, address, endpoint)))

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
        from prefect_sgpu.observe.mlflow_relay import relays

        return (self.tracked is not None and self.compute.remote and self.compute.runs_node_agents
                and relays(self.tracked.tracking_uri))

    def _tracking_env(self) -> dict[str, str]:
        if self.tracked is None:
            return {}
        env = dict(self.tracked.env)
        if self._relays_mlflow():
            from prefect_sgpu.observe.mlflow_relay import SCHEME

            env["MLFLOW_TRACKING_URI"] = f"{SCHEME}:"
        return env

    def checkpoint_env(self) -> dict[str, str]:
        """Checkpoints on the job's store (they outlive nodes and relaunches), unless the caller chose."""
        from prefect_sgpu.checkpoints import DIR_ENV, URI_ENV

        if URI_ENV in self.spec.env or DIR_ENV in self.spec.env:
            return {}
        return {URI_ENV: self.store.uri(self.run_id, "checkpoints")}

    def _checkpoint_key(self) -> dict[str, str]:
        """The checkpoint location's key, for the ranks: it travels as ``secrets=`` do (never in the store)
        and, derived from the driver's checkpoint secret per location, is the same for every retry of a
        task (:mod:`prefect_sgpu.checkpoints.manifest`)."""
        from prefect_sgpu.checkpoints.manifest import FOLDERS_KEY_ENV, KEY_ENV, folders_key, location_key
        from prefect_sgpu.checkpoints import DIR_ENV, URI_ENV

        env = {**self.checkpoint_env(), **self.spec.env}
        uri = env.get(URI_ENV) or env.get(DIR_ENV)
        return {KEY_ENV: location_key(uri), FOLDERS_KEY_ENV: folders_key(self.store.root_uri)} if uri else {}

    def _index_secret(self) -> dict[str, str]:
        """The environment's index URLs with their credentials, for a compute whose nodes build it: they
        travel as ``secrets=`` do (the manifest shows them masked), and are never a rank's variable."""
        from prefect_sgpu.environment import ship as environment_ship

        if not self.compute.ships_environment:
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
        self.timeline = timeline_mod.Timeline()
        timeline_mod.active(self.run_id, self.timeline)  # a remote compute adds what it sees while acquiring
        deadline = self.started_at + self.spec.timeout
        folder = self.folder = JobFolder(self.store, self.run_id, key)
        self.cost_watch = cost_cap.CostWatch(self) if self.spec.max_cost_usd is not None else None
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
                + (f"(elastic: from {plan.min_nodes} node(s) on) " if plan.elastic else "")
                + f"[{plan.device}, {request.compute}], job {self.run_id}"
            )
            tailer = LogTailer(self.store, self.run_id, plan.procs_per_node, self.sink.line).start()
            if self._relays_mlflow():
                from prefect_sgpu.observe.mlflow_relay import MetricRelay

                assert self.tracked is not None
                self.relay = MetricRelay(self.store, self.run_id, self.tracked.tracking_uri, self.tracked.run_id,
                                         key)
            end = self._run_gangs(request, folder, deadline, tailer)
            tailer.poll()
            result = driver_results.collect(self, self.plan, end)
            timeline_mod.note_ranks(self.timeline, result.ranks)
            self._tell_gang_check(result.gang_check)
            self._note_gang_check(result)
            outcome = "FINISHED"
        except (RankFailedError, LaunchTimeout, JobHung, EnvironmentMismatch):
            outcome = "FAILED"
            self._forget_gang_check()
            raise
        except BaseException as exc:
            outcome = "FAILED" if getattr(exc, "sgpu_failure", None) is not None else "KILLED"
            self._forget_gang_check()
            raise
        finally:
            # to its end even when an exception is raised into this thread meanwhile (Prefect's task timeout)
            released = interrupts.shielded(self._cleanup, outcome, tailer)
        assert result is not None
        every = [*self.given_back, *([released] if released is not None else [])]
        result.cost = total_cost([r.cost for r in every])
        result.released = [g for r in every for g in r.gone]
        result.recoveries = list(self.recoveries)
        result.membership = list(self.membership)
        result.stragglers = list(self.stragglers)
        result.step_rates = self.straggler_watch.detector.rates() if self.straggler_watch is not None else {}
        result.timeline = self.timeline.phases()
        return result

    def _tell_gang_check(self, report: dict[str, Any] | None) -> None:
        from prefect_sgpu.observe import gang_check

        if report:
            info, warnings = gang_check.describe(report)
            self.sink.info(f"{self.call.name}: {info}")
            for line in warnings:
                self.sink.warning(f"{self.call.name}: {line}")

    def _reuse_gang_check(self, allocation: Allocation) -> float | None:
        """Seconds since ``allocation``'s warm set passed the gang check, where this gang may skip it: the
        check is on, this is the job's first gang (no recovery), the set passed within
        ``PREFECT_SGPU_GANG_CHECK_REUSE_S`` and no job on it failed since. A set whose node died is never
        reused by the pool, and a new set has not passed, so a replaced node is always checked."""
        warm = self.compute.warm_set(allocation)
        checked = getattr(warm, "gang_checked_at", None)
        if not self.spec.gang_check or self.recoveries or checked is None:
            return None
        if warm.gang_checked_nodes != _node_key(allocation):  # a node changed (an instance, an address)
            return None
        age = time.monotonic() - checked
        return age if age <= gang_check_reuse_s() else None

    def _note_gang_check(self, result: JobResult) -> None:
        """After a job that ended well: a check that passed here stands for the warm set's next jobs."""
        warm = self.compute.warm_set(self.allocation) if self.allocation is not None else None
        if self.gang_check_reused is not None:
            result.gang_check_reused_s = self.gang_check_reused
            self.sink.info(f"{self.call.name}: gang check skipped: warm set {getattr(warm, 'id', '?')} passed it "
                           f"{self.gang_check_reused:.0f}s ago and is unchanged")
        elif result.gang_check and warm is not None and self.allocation is not None:
            warm.gang_checked_at = time.monotonic()
            warm.gang_checked_nodes = _node_key(self.allocation)

    def _forget_gang_check(self) -> None:
        """A job that failed: its warm set is checked again by the next job."""
        warm = self.compute.warm_set(self.allocation) if self.allocation is not None else None
        if warm is not None:
            warm.gang_checked_at = None

    def _run_gangs(self, request: Request, folder: JobFolder, deadline: float, tailer: LogTailer) -> GangEnd:
        """Acquire, start and wait; after infrastructure loss, replace what was lost (only the lost nodes
        where the compute can, else the whole gang: :func:`driver_recovery.recover`) and do it again
        (``max_recoveries``)."""
        allocation: Allocation | None = None
        while True:
            if allocation is None:
                self.timeline.mark("launch requested")
                allocation = self.allocation = self.compute.acquire(request, folder, deadline, self.cancel_event)
                self.timeline.mark("acquired")
            tailer.node_of = lambda rank, a=allocation: self.compute.node_of_rank(a, rank)
            self.plan = allocation.plan  # a job compute may refine the device it got
            self.gang_check_reused = self._reuse_gang_check(allocation)
            endpoint = self.compute.rendezvous_endpoint(allocation)
            launch = self.launch(request, [n.address for n in allocation.nodes], endpoint)
            self.compute.start(allocation, launch)
            self.timeline.mark("started")
            gang_started = time.monotonic()
            end = self._wait(deadline, membership_mod.Membership(self, allocation, request, launch, deadline))
            self._note_first_steps()
            relaunch = driver_recovery.recover(self, allocation, end, request, deadline, gang_started, tailer)
            if relaunch is None:
                return end
            allocation, request = relaunch

    def _wait(self, deadline: float, members: "membership_mod.Membership | None" = None) -> GangEnd:
        """Poll the compute until every node exited, or one failed or was lost (an elastic job goes on
        without a lost node where ``members`` says so).

        After a failure the driver polls ``compute.loss_grace_s`` longer for a loss that
        explains it: a lost node's peers often fail first, on a broken collective.
        """
        assert self.allocation is not None and self.folder is not None
        end = GangEnd({}, {}, {}, {})
        failed_at: float | None = None
        if self.reprovision_started is not None and self.recoveries:
            self.recoveries[-1].reprovision_s = time.monotonic() - self.reprovision_started
            self.reprovision_started = None
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
                    self.timeline.once("ranks done", event.node)
                    end.codes[event.node] = event.exit_code
                    if event.status is not None:
                        end.statuses[event.node] = event.status
                elif isinstance(event, NodeLost) and members is not None and members.lost(
                        event.node, event.reason, set(end.codes)):
                    continue
                elif isinstance(event, NodeLost):
                    end.codes[event.node] = 137
                    end.lost[event.node] = event.reason
                elif isinstance(event, NodeNotice) and not event.reclaim:
                    self.sink.warning(f"{self.call.name}: node {event.node} got a rebalance recommendation "
                                      f"({event.notice}); not a reclaim: the job goes on on the same nodes")
                elif isinstance(event, NodeNotice):
                    if event.node not in end.notices:
                        self.sink.warning(f"{self.call.name}: node {event.node} will be reclaimed ({event.notice}); "
                                          "its ranks were told to checkpoint")
                    end.notices[event.node] = event.notice
                elif isinstance(event, NodeUp):
                    self.timeline.once("agent up", event.node)  # a remote compute's came while acquiring
                    if members is not None:
                        members.up(event.node)
                    logger.debug("job %s: node %d up on %s", self.run_id, event.node, event.host)
            now = time.monotonic()
            # every node the gang has now: an elastic job's late node joins while it runs
            if len(end.codes) == len(self.allocation.nodes) or driver_results.ended_without_late_nodes(self, end):
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
            if self.cost_watch is not None:
                self.cost_watch.poll(now)  # CostCapReached, after a final checkpoint, at the cap
            if self.relay is not None:
                self.relay.poll(every=RELAY_INTERVAL_S)
            for straggler in watch.poll() if watch is not None else ():
                progress_watch.name(self, straggler)
            self.cancel_event.wait(POLL_INTERVAL_S)

    def _note_first_steps(self) -> None:
        """Each node's first step, as this gang's straggler watch read it (and once more at its end)."""
        watch, allocation = self.straggler_watch, self.allocation
        if watch is not None:
            watch.read_at_end()
        if watch is not None and allocation is not None and watch.first_steps:
            steps, watch.first_steps = watch.first_steps, {}  # noted once, in the gang they belong to
            timeline_mod.note_first_steps(self.timeline, steps, lambda r: self.compute.node_of_rank(allocation, r))

    def _node_ttl(self) -> float:
        return self._prepared[0].heartbeat_ttl_s if self._prepared else 60.0

    def envelopes(self) -> dict[int, payload_mod.Envelope]:
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
        return {rank: payload_mod.load_envelope(body, rank) for rank, body in results.items()}

    def _cleanup(self, outcome: str, tailer: LogTailer | None) -> Any:
        released = None
        try:
            if self.allocation is not None:
                self._note_first_steps()
                try:
                    self.compute.stop(self.allocation)
                finally:
                    released = self.compute.release(self.allocation)
                    self.timeline.mark("release")
        finally:
            timeline_mod.active(self.run_id, None)
            if tailer is not None:
                tailer.close()
            if self.relay is not None:
                self.relay.poll()  # the last metrics, before the run ends and the files go
            if self.tracked is not None:
                if self.recoveries:
                    self.tracked.set_tags({"sgpu.recoveries": str(len(self.recoveries)),
                                           **{f"sgpu.recovery.{r.gang}": json.dumps(r.as_dict())[:5000]
                                              for r in self.recoveries}})
                timeline_mod.log_to_mlflow(self.timeline, self.tracked.tracking_uri, self.tracked.run_id)
                self.tracked.end(outcome)
            if self.heartbeat is not None:
                self.heartbeat.stop()
            if self.folder is not None:
                try:
                    self.folder.delete_control_files()
                except Exception:  # noqa: BLE001 - the job's outcome matters more than tidiness
                    logger.warning("could not delete the control files of job %s", self.run_id, exc_info=True)
        return released
