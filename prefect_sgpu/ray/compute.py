"""An existing Ray cluster as a compute: each job is one Ray Train ``TorchTrainer`` run.

The same ``@distributed`` function or GPU task that runs under torchrun runs here:
one Ray Train worker per rank, with torch's environment variables, the process
group already initialised by Ray Train (gloo on CPU, nccl on GPU), the job's MLflow
run and environment.

Ray places the workers itself, so this is a *job compute*: it speaks the same
contract as the node computes but reports the whole run as one node (node 0).
``acquire`` joins the cluster and waits until it can hold the job, ``start`` submits
the run with the sealed payload, ``poll`` copies the workers' output into the job
folder's rank logs and, once the run ends, seals every rank's envelope into the
folder before reporting ``NodeExited(0)``. The driver reads the folder exactly as it
does for torchrun nodes, so values and the failing rank's own exception come back
the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefect_sgpu.protocol import jobfolder
from prefect_sgpu.compute.base import (AllocatedNode, Allocation, Compute, Event, JobLaunch, NodeCommand,
                                       NodeExited, NodeLost, NodeUp, Released, Request)
from prefect_sgpu.errors import JobCancelled, LaunchTimeout, SGPUConfigError
from prefect_sgpu.protocol.jobfolder import HungRank, NodeStatus
from prefect_sgpu.ray.placement import alive_node_resources, ask_autoscaler, fits, refuse_elastic, scaling_options
from prefect_sgpu.spec import JobSpec, Plan, require_fixed_nodes

if TYPE_CHECKING:
    from prefect_sgpu.protocol.jobfolder import JobFolder

logger = logging.getLogger("prefect_sgpu.ray.compute")

#: seconds between two reads of the collector (poll() itself is called every 50 ms)
DRAIN_INTERVAL_S = 0.2
#: seconds between two looks at the cluster while acquire waits for resources
ACQUIRE_INTERVAL_S = 1.0
#: the least time a graceful cancel gets before the run is killed (see RayTrainCompute._cancel)
CANCEL_GRACE_S = 30.0
#: how often a running job's collector is asked which ranks are silent (the hang watchdog)
HANG_CHECK_INTERVAL_S = 1.0
TRAINER = "ray.train.torch.TorchTrainer"

#: process-group backends a RayTrainCompute may pin (None: Ray Train's choice, nccl on GPU, gloo on CPU)
BACKENDS = ("nccl", "gloo")


def _fit(config: dict[str, Any], scaling: dict[str, Any], name: str, max_failures: int,
         backend: str | None = None) -> None:
    """Run the job's TorchTrainer to the end (in a Ray task, so cancelling it stops the run)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from prefect_sgpu.ray.train_worker import run_rank

    TorchTrainer(
        run_rank, train_loop_config=config, scaling_config=ScalingConfig(**scaling),
        torch_config=TorchConfig(backend=backend) if backend else None,
        run_config=RunConfig(name=name, failure_config=FailureConfig(max_failures=max_failures)),
    ).fit()


@dataclass(frozen=True)
class RayRequest(Request):
    """One Ray Train run: the cluster, the ``ScalingConfig`` and how workers are set up.

    From ``plan`` the scaling is the intent (GPU workers when a GPU type is named);
    after ``acquire`` it is exactly what is sent (GPUs confirmed, accelerator pinned).
    """

    address: str = "auto"
    scaling: dict[str, Any] = field(default_factory=dict)
    runtime_env: dict[str, Any] = field(default_factory=dict)
    backend: str | None = None
    max_failures: int = 0
    #: seconds a warm worker group waits for the next job of its shape (0: one Ray Train run per job)
    keep_warm: float = 0.0

    def describe(self) -> dict[str, Any]:
        # no heartbeat: Ray ends the run's task when the driver that owns it goes away
        described = {k: v for k, v in super().describe().items() if k != "heartbeat_ttl_s"}
        trainer = (f"warm worker group (one actor per rank, kept {self.keep_warm:g}s between jobs)"
                   if self.keep_warm > 0 else TRAINER)
        return {**described, "address": self.address, "trainer": trainer,
                "num_workers": self.scaling.get("num_workers"), "scaling_config": dict(self.scaling),
                "use_gpu_if_available": bool(self.scaling.get("use_gpu")), "runtime_env": dict(self.runtime_env),
                "backend": self.backend or "nccl on GPU workers, gloo on CPU workers",
                "max_failures": self.max_failures}


@dataclass
class RayAllocation(Allocation):
    """A Ray Train run from ``start`` to ``release``: its task, its collector and what was read."""

    fit: Any = None
    collector: Any = None
    started: bool = False
    announced: bool = False
    finished: bool = False
    stopped: bool = False
    last_drain: float = 0.0
    last_hang_check: float = 0.0
    #: everything written to each rank's log so far (stores without append get the whole file again)
    logs: dict[int, bytearray] = field(default_factory=dict)
    #: the Ray node each rank's worker reported (Ray places workers, so ranks are not in node order)
    rank_nodes: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: the warm worker group the job runs on (None: a Ray Train run)
    group: Any = None
    #: how many times the warm group's ranks were started for this job (see ``SETUP_ATTEMPTS``)
    setup_attempts: int = 1
    #: the request's runtime_env as sent to Ray: local working_dir and py_modules uploaded, as gcs:// URIs
    runtime_env: dict[str, Any] = field(default_factory=dict)

    def kept_in(self) -> Any:
        """The warm worker group the job runs on (None: a Ray Train run of its own)."""
        return self.group


# one Ray connection per process: which cluster prefect-sgpu joined, so any compute for it may leave it
_joined: str | None = None
_join_lock = threading.Lock()


class RayTrainCompute(Compute):
    """Run jobs on an existing Ray cluster (``address="auto"``, ``"ray://host:10001"``, ``"host:6379"``)."""

    name = "ray"
    remote = True
    runs_node_agents = False

    def __init__(self, address: str = "auto", runtime_env: dict[str, Any] | None = None,
                 backend: str | None = None, resources_per_worker: dict[str, float] | None = None,
                 keep_warm: float = 0.0) -> None:
        """``keep_warm``: seconds a warm worker group (placement group, one actor per rank with torch
        imported) waits for the next job of the same shape, which then pays only for its function;
        0: every job is a Ray Train run of its own (needed by functions that call Ray Train's API)."""
        from prefect_sgpu.compute.warm_pool import check_keep_warm

        self.keep_warm = check_keep_warm("keep_warm", keep_warm, "a Ray Train run per job")
        if not isinstance(address, str) or not address.strip():
            raise SGPUConfigError("address", address, "'auto', 'ray://host:port' or 'host:port'")
        if backend is not None and backend not in BACKENDS:
            raise SGPUConfigError("backend", backend, f"one of {', '.join(BACKENDS)}, or None for Ray Train's "
                                  "default (nccl on GPU workers, gloo on CPU workers)")
        self.address = address.strip()
        self.runtime_env = dict(runtime_env or {})
        self.backend = backend
        #: merged into every worker's Ray resources ({"CPU": 4}: four cores for data loading)
        self.resources_per_worker = dict(resources_per_worker or {})

    def __repr__(self) -> str:
        return f"RayTrainCompute(address={self.address!r})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, RayTrainCompute) and other.address == self.address
                and other.runtime_env == self.runtime_env and other.backend == self.backend
                and other.resources_per_worker == self.resources_per_worker and other.keep_warm == self.keep_warm)

    __hash__ = None  # type: ignore[assignment]

    # -- planning (nothing spent) -------------------------------------------------

    def plan(self, spec: JobSpec, run_id: str) -> RayRequest:
        refuse_elastic(spec)  # says whether the installed Ray Train could, and what to use instead
        require_fixed_nodes(spec, "RayCompute")
        nodes = spec.nodes or 1
        # GPUs only when asked for by type; confirmed against the cluster in acquire
        plan = Plan(nodes=nodes, procs_per_node=spec.gpus // nodes, device="cuda" if spec.gpu_type else "cpu")
        return RayRequest(run_id=run_id, compute=self.name, plan=plan, spec=spec, heartbeat_ttl_s=0.0,
                          address=self.address, scaling=scaling_options(spec, plan, None, self.resources_per_worker),
                          runtime_env=self.job_runtime_env(spec), backend=self.backend,
                          max_failures=spec.max_restarts, keep_warm=self.keep_warm)

    def job_runtime_env(self, spec: JobSpec) -> dict[str, Any]:
        """The job's ``runtime_env``: this compute's own with the job's ``environment=`` mapped onto it
        (:mod:`prefect_sgpu.ray.runtime_env`); a key both set raises SGPUConfigError here, in ``plan``."""
        from prefect_sgpu.environment import Environment
        from prefect_sgpu.ray.runtime_env import merged

        environment = spec.environment if isinstance(spec.environment, Environment) else None
        return merged(self.runtime_env, environment)

    def command_line(self, request: Request, command: NodeCommand) -> list[str]:
        """What node 0 stands for: one Ray Train run (``dry_run`` prints this, not a torchrun agent)."""
        assert isinstance(request, RayRequest)
        return [TRAINER, f"--address={request.address}", f"--num-workers={request.plan.world_size}"]

    def rendezvous_endpoint(self, allocation: Allocation) -> str:
        return ""  # Ray Train sets up the process group itself

    # -- the connection -------------------------------------------------------------

    def connect(self) -> None:
        """Join the cluster once per process (reusing a connection the caller already made)."""
        global _joined
        import ray

        with _join_lock:
            if ray.is_initialized():
                self._check_same_cluster()
                return
            ray.init(address=self.address, runtime_env=self.runtime_env or None, log_to_driver=False,
                     logging_level="WARNING")
            _joined = self.address

    def _check_same_cluster(self) -> None:
        """A process holds one Ray connection: refuse to run on it when it is another cluster's."""
        import ray

        if self.address == "auto" or self.address.startswith("ray://"):
            return  # "auto" accepts the cluster joined; a client address is not comparable to the GCS one
        try:
            joined = ray.get_runtime_context().gcs_address
        except Exception:  # noqa: BLE001 - nothing to compare with
            return
        if joined and joined != self.address:
            raise SGPUConfigError(
                "address", self.address,
                f"the Ray cluster this process is connected to ({joined}): a process joins one Ray cluster; "
                "call ray.shutdown() first or run the job from another process")

    def close(self) -> None:
        """Leave the cluster if prefect-sgpu joined it for this address (the task runner calls this at flow end).

        The connection is the process's, not this object's: a block builds a new compute
        for every call, and any of them may end the connection the first one made.
        """
        global _joined
        from prefect_sgpu.ray.warm_group import RAY_POOL

        RAY_POOL.close(owner=id(self))
        with _join_lock:
            if _joined is not None and _joined == self.address:
                import ray

                RAY_POOL.close()  # groups of this connection cannot outlive it
                ray.shutdown()
                _joined = None

    # -- acquire: the cluster can hold the job ---------------------------------------

    def acquire(self, request: Request, folder: "JobFolder", deadline: float,
                cancel: threading.Event) -> RayAllocation:
        """Join the cluster and wait until its nodes can hold every worker.

        An autoscaling cluster grows when asked (``request_resources``); a fixed one that
        is too small waits until the job's timeout. Nothing is reserved: Ray Train's own
        placement group takes the workers in ``start``.
        """
        import ray

        assert isinstance(request, RayRequest)
        self.connect()
        spec, plan = request.spec, request.plan
        scaling = scaling_options(spec, plan, ray.cluster_resources(), self.resources_per_worker)
        if spec.gpu_type and not scaling["use_gpu"]:
            logger.warning("the Ray cluster at %s has no GPUs: running %d CPU worker(s)",
                           self.address, plan.world_size)
        asked = False
        try:
            while not fits(scaling, alive_node_resources()):
                if not asked:
                    asked = True
                    logger.warning("job %s: the Ray cluster at %s cannot hold %d worker(s) of %s yet; waiting",
                                   request.run_id, self.address, plan.world_size, scaling["resources_per_worker"])
                    ask_autoscaler(scaling)
                if cancel.wait(ACQUIRE_INTERVAL_S):
                    raise JobCancelled(f"job {request.run_id} was cancelled while waiting for Ray resources")
                if time.monotonic() > deadline:
                    raise LaunchTimeout(request.run_id, spec.timeout, phase="acquire")
        finally:
            if asked:
                ask_autoscaler(None)
        if cancel.is_set():
            raise JobCancelled(f"job {request.run_id} was cancelled")
        from prefect_sgpu.ray.runtime_env import uploaded

        refined = dataclasses.replace(request, scaling=scaling, plan=dataclasses.replace(
            plan, device="cuda" if scaling["use_gpu"] else "cpu"))
        allocation = RayAllocation(request=refined, folder=folder,
                                   nodes=[AllocatedNode(index=0, address=self.address, host=self.address)],
                                   # the job's working_dir and py_modules go up to the cluster now (gcs:// URIs)
                                   runtime_env=uploaded(refined.runtime_env))
        if refined.keep_warm > 0:
            allocation.group = self._warm_group(refined, allocation.runtime_env, deadline, cancel)
        return allocation

    def _warm_group(self, request: RayRequest, runtime_env: dict[str, Any], deadline: float,
                    cancel: threading.Event) -> Any:
        """An idle warm group of this job's shape, or a new one (placement group and actors ready)."""
        from prefect_sgpu.ray.warm_group import RAY_POOL, create_group

        # uploaded files are named by their content: a changed project gets a group of its own
        key = (self.address, repr(sorted(request.scaling.items())), repr(sorted(runtime_env.items())),
               request.backend)
        group = RAY_POOL.take(key, owner=id(self))
        if group is not None:
            return group
        try:
            group = create_group(key, request.scaling, runtime_env, deadline, cancel)
        except TimeoutError:
            if cancel.is_set():
                raise JobCancelled(f"job {request.run_id} was cancelled while its warm group started") from None
            raise LaunchTimeout(request.run_id, request.spec.timeout, phase="starting the warm worker group") from None
        RAY_POOL.add(group, owner=id(self))
        return group

    # -- start, poll, stop, release -----------------------------------------------------

    def start(self, allocation: Allocation, launch: JobLaunch) -> None:
        """Submit the TorchTrainer run (a Ray task) with the sealed payload, the key and the run id."""
        import ray

        from prefect_sgpu.ray.train_worker import Collector

        assert isinstance(allocation, RayAllocation)
        request = allocation.request
        assert isinstance(request, RayRequest)
        folder = allocation.folder
        sealed = folder.store.get(folder.run_id, jobfolder.PAYLOAD)
        if sealed is None:
            raise FileNotFoundError(f"{folder.uri(jobfolder.PAYLOAD)} is missing")
        # secrets= ride in the run's config: the cluster is one trust domain (docs/security.md)
        env = {**launch.env, **launch.secrets, "SGPU_DEVICE": allocation.plan.device}
        with allocation.lock:
            if allocation.released:
                return
            allocation.collector = ray.remote(num_cpus=0)(Collector).options(
                name=collector_name(allocation.run_id)).remote()
            config = {"payload": sealed, "key": folder.key, "run_id": folder.run_id, "env": env,
                      "collector": allocation.collector}
            allocation.started = True
            if allocation.group is not None:
                config.pop("collector")
                allocation.group.start(config, allocation.collector, request.backend)
                return
            # max_calls=1: the worker that ran fit() exits after it. Ray Train's controller is an
            # actor that worker owns; after a failed run the exception's traceback can keep the
            # controller's handle alive in a reused worker, and with it the run's workers and
            # placement group. The owner's exit ends them (Ray Train removes the group itself).
            # the job's runtime_env on the run's task: Ray Train's controller and workers inherit it
            options: dict[str, Any] = {"runtime_env": allocation.runtime_env} if allocation.runtime_env else {}
            allocation.fit = ray.remote(num_cpus=0, max_retries=0, max_calls=1, **options)(_fit).remote(
                config, request.scaling, allocation.run_id, request.max_failures, request.backend)
            allocation.started = True

    def poll(self, allocation: Allocation) -> list[Event]:
        import ray

        assert isinstance(allocation, RayAllocation)
        if not allocation.started or allocation.finished:
            return []
        events: list[Event] = []
        if not allocation.announced:
            allocation.announced = True
            events.append(NodeUp(0, f"Ray Train run on {self.address}"))
        if not ray.is_initialized():  # close() ran meanwhile: never let ray auto-start a local instance
            allocation.finished = True
            return [*events, NodeLost(0, f"this process left the Ray cluster at {self.address}")]
        now = time.monotonic()
        if now - allocation.last_drain < DRAIN_INTERVAL_S:
            return events
        allocation.last_drain = now
        hung: dict[str, HungRank] = {}
        if allocation.group is not None:
            error = self._warm_outcome(allocation)
            if error == "running":
                if not (hung := self._silent_ranks(allocation, now)):
                    return events
                error = self._stop_hung(allocation, hung)
        else:
            ready, _ = ray.wait([allocation.fit], timeout=0)
            self._drain(allocation)
            if ready:
                error = _run_error(allocation.fit)
            elif not (hung := self._silent_ranks(allocation, now)):
                return events
            else:
                error = self._stop_hung(allocation, hung)
        allocation.finished = True
        self._drain(allocation)
        for rank, body in ray.get(allocation.collector.results.remote()).items():
            allocation.folder.put_result(rank, body)
        status = None
        if error is not None:
            status = NodeStatus(node=0, host=self.address, exit_code=1, error=error, hung=hung)
            allocation.folder.put_status(0, status)
        return [*events, NodeExited(0, 0 if error is None else 1, status)]

    def _silent_ranks(self, allocation: RayAllocation, now: float) -> dict[str, HungRank]:
        """The hang watchdog of a Ray job: started ranks that neither printed nor reported progress
        for the job's ``hang_timeout`` (asked of the collector about once a second).

        A node agent does this for torchrun ranks; here the driver does it, because a Ray worker
        that dies without a word (``os._exit``, a segfault) can leave Ray Train waiting for its
        own health check, which gives up only after minutes."""
        import ray

        timeout = allocation.request.spec.hang_timeout
        if not timeout or allocation.collector is None or now - allocation.last_hang_check < HANG_CHECK_INTERVAL_S:
            return {}
        allocation.last_hang_check = now
        silent = ray.get(allocation.collector.silent.remote(float(timeout)))
        return {str(rank): HungRank(silent_s=round(seconds, 1), step=step,
                                    stack="(a Ray worker: no stack is taken; its last lines are in the rank's log)")
                for rank, (seconds, step) in sorted(silent.items())}

    def _stop_hung(self, allocation: RayAllocation, hung: dict[str, HungRank]) -> str:
        timeout = allocation.request.spec.hang_timeout or 0.0
        ranks = ", ".join(sorted(hung, key=int))
        logger.warning("job %s: rank(s) %s made no progress for %gs (hang_timeout): stopping the run",
                       allocation.run_id, ranks, timeout)
        self.stop(allocation, grace=0.0)
        return f"rank(s) {ranks} made no progress for {timeout:g}s (hang_timeout)"

    def _warm_outcome(self, allocation: RayAllocation) -> str | None:
        """"running" until every rank ended or one failed (the others are stopped then, as Ray
        Train stops a run's workers); None when all succeeded, else the failure."""
        from prefect_sgpu.ray.warm_group import SETUP_ATTEMPTS

        group = allocation.group
        ended, failed, setup = group.outcomes()
        self._drain(allocation)
        if setup and len(setup) == len(failed) and allocation.setup_attempts < SETUP_ATTEMPTS:
            # no rank ran the function (each waits for all at a barrier first): start them again
            allocation.setup_attempts += 1
            if group.start_again():
                logger.warning("job %s: rank(s) %s could not join the job's process group; starting its "
                               "ranks again (attempt %d of %d)", allocation.run_id,
                               ", ".join(map(str, setup)), allocation.setup_attempts, SETUP_ATTEMPTS)
                return "running"
        if failed:
            group.stop(0.0)
            self._drain(allocation)
            return "; ".join(failed)[:4000]
        return None if ended else "running"

    def _drain(self, allocation: RayAllocation) -> None:
        """Append the lines the workers sent since the last drain to ``logs/rank-<r>.log``."""
        import ray

        if allocation.collector is None or not ray.is_initialized():
            return
        by_rank: dict[int, list[str]] = {}
        for rank, node, text in ray.get(allocation.collector.drain.remote()):
            allocation.rank_nodes[rank] = node  # before the line is in the log the tailer reads
            by_rank.setdefault(rank, []).append(text)
        for rank, lines in by_rank.items():
            _append_log(allocation, rank, ("\n".join(lines) + "\n").encode())

    def node_of_rank(self, allocation: Allocation, rank: int) -> int:
        assert isinstance(allocation, RayAllocation)
        return allocation.rank_nodes.get(rank, 0)

    def stop(self, allocation: Allocation, grace: float = 10.0) -> None:
        """Cancel the run gracefully if it still runs; safe to call again."""
        import ray

        assert isinstance(allocation, RayAllocation)
        with allocation.lock:
            if (allocation.fit is None and allocation.group is None) or allocation.stopped or not ray.is_initialized():
                return
            allocation.stopped = True
        if allocation.group is not None:
            allocation.group.stop(grace)
        elif not ray.wait([allocation.fit], timeout=0)[0]:
            self._cancel(allocation.fit, grace)
        try:
            self._drain(allocation)
        except Exception:  # noqa: BLE001 - the collector may be gone with a failed run
            logger.debug("could not read the last lines of job %s", allocation.run_id, exc_info=True)

    @staticmethod
    def _cancel(fit: Any, grace: float) -> None:
        """Abort the run gracefully, so Ray Train releases its workers and placement group.

        A plain cancel interrupts ``fit()`` the way Ctrl-C does, and Ray Train answers by
        aborting its controller and worker group. Killing the task outright would leave the
        run's placement group reserved until this driver disconnects (clusters with a
        dashboard clean it up later); that is only the fallback, after at least
        ``CANCEL_GRACE_S`` because Ray Train's abort takes longer than a process's SIGTERM.
        """
        import ray

        ray.cancel(fit, force=False)
        ready, _ = ray.wait([fit], timeout=max(grace, CANCEL_GRACE_S))
        if not ready:
            ray.cancel(fit, force=True)

    def release(self, allocation: Allocation) -> Released:
        """Stop the run if it still runs and kill the collector. Idempotent."""
        import ray

        assert isinstance(allocation, RayAllocation)
        with allocation.lock:
            if allocation.released:
                return Released()
            allocation.released = True
        self.stop(allocation, grace=0.0)
        gone = []
        if allocation.group is not None:
            from prefect_sgpu.ray.warm_group import RAY_POOL

            group, allocation.group = allocation.group, None
            group.runs = []
            gone.append(f"job {allocation.run_id}'s rank processes on warm group {group.id}")
            RAY_POOL.give_back(group, allocation.request.keep_warm)  # type: ignore[attr-defined]
        if allocation.fit is not None:
            gone.append(f"Ray Train run {allocation.run_id} (its workers and placement group)")
        if allocation.collector is not None and ray.is_initialized():
            if allocation.fit is not None:  # Ray Train removes its group itself when its abort completes
                ray.wait([allocation.fit], timeout=CANCEL_GRACE_S)
                for left in ray.get(allocation.collector.remove_placement_groups.remote()):
                    logger.info("job %s: removed placement group %s that its run left", allocation.run_id, left)
            ray.kill(allocation.collector)
            gone.append(f"collector actor {collector_name(allocation.run_id)}")
        return Released(gone=gone)


def collector_name(run_id: str) -> str:
    """The named actor that holds a job's output lines and envelopes until the driver reads them."""
    return f"sgpu-collector-{run_id}"


def _run_error(fit: Any) -> str | None:
    """The run's error text, or None when it succeeded (the ranks' envelopes say more)."""
    import ray

    try:
        ray.get(fit)
        return None
    except Exception as exc:  # noqa: BLE001 - reported through the node status
        cause = getattr(exc, "cause", None) or exc
        return f"{type(cause).__name__}: {cause}".strip()[:4000]


def _append_log(allocation: RayAllocation, rank: int, data: bytes) -> None:
    """Append to a rank's log: in place on a local folder, else the whole file again (S3 has no append)."""
    store, run_id, key = allocation.folder.store, allocation.run_id, jobfolder.log_key(rank)
    local = store.local_dir(run_id)
    if local is not None:
        path = local / key
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as fh:
            fh.write(data)
        return
    written = allocation.logs.setdefault(rank, bytearray())
    written += data
    store.put(run_id, key, bytes(written))
