"""An existing Ray cluster as a compute: each job is one Ray Train ``TorchTrainer`` run.

The same ``@distributed`` function or GPU task that runs under torchrun runs here:
one Ray Train worker per rank, with torch's environment variables, the process
group already initialised by Ray Train (gloo on CPU, nccl on GPU), the job's MLflow
run and environment. Ray schedules the workers, so this compute implements the
driver's whole-job hook (``execute``) instead of acquiring nodes; the driver still
validates, opens and ends the MLflow run, and turns envelopes into values or the
failing rank's own exception.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import TYPE_CHECKING, Any

from prefect_sgpu.compute import Allocation, Compute, NodeLaunch
from prefect_sgpu.errors import JobCancelled, LaunchTimeout, SGPUConfigError
from prefect_sgpu.spec import Plan, Resources
from prefect_sgpu.store import rank_key

if TYPE_CHECKING:
    from prefect_sgpu.driver import Job, JobResult


POLL_INTERVAL_S = 0.2
CANCEL_GRACE_S = 30.0

#: Ray's accelerator_type names for the catalog's GPU types (``accelerator_type:<name>`` resources)
RAY_ACCELERATOR_NAMES = {"A10": ("A10G", "A10"), "A100-80GB": ("A100-80G", "A100"), "L40S": ("L40S", "L40")}


def scaling_options(resources: Resources, plan: Plan, cluster: dict[str, float]) -> dict[str, Any]:
    """``ScalingConfig`` arguments for a job's resources on a cluster with ``cluster`` resources.

    GPUs are used when the resources name a GPU type and the cluster has GPUs; the
    accelerator type is pinned when the cluster advertises it; ``nodes`` chooses the
    placement (one node: STRICT_PACK, several: SPREAD, unset: PACK).
    """
    use_gpu = resources.gpu_type is not None and cluster.get("GPU", 0) > 0
    options: dict[str, Any] = {
        "num_workers": plan.world_size,
        "use_gpu": use_gpu,
        "resources_per_worker": {"GPU": 1} if use_gpu else {"CPU": 1},
        "placement_strategy": "PACK" if resources.nodes is None
        else ("STRICT_PACK" if resources.nodes == 1 else "SPREAD"),
    }
    if use_gpu:
        assert resources.gpu_type is not None
        for name in RAY_ACCELERATOR_NAMES.get(resources.gpu_type, (resources.gpu_type,)):
            if cluster.get(f"accelerator_type:{name}", 0) > 0:
                options["accelerator_type"] = name
                break
    return options


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


class RayTrainCompute(Compute):
    """Run jobs on an existing Ray cluster (``address="auto"``, ``"ray://host:10001"``, ``"host:6379"``)."""

    def __init__(self, address: str = "auto", runtime_env: dict[str, Any] | None = None,
                 backend: str | None = None) -> None:
        if not isinstance(address, str) or not address.strip():
            raise SGPUConfigError("address", address, "'auto', 'ray://host:port' or 'host:port'")
        if backend is not None and backend not in BACKENDS:
            raise SGPUConfigError("backend", backend, f"one of {', '.join(BACKENDS)}, or None for Ray Train's "
                                  "default (nccl on GPU workers, gloo on CPU workers)")
        self.address = address.strip()
        self.runtime_env = dict(runtime_env or {})
        self.backend = backend
        self._connected_here = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RayTrainCompute(address={self.address!r})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, RayTrainCompute) and other.address == self.address
                and other.runtime_env == self.runtime_env and other.backend == self.backend)

    __hash__ = None  # type: ignore[assignment]

    # -- planning (nothing spent) -------------------------------------------------

    def plan(self, resources: Resources) -> Plan:
        nodes = resources.nodes or 1
        if resources.gpus % nodes:
            raise SGPUConfigError("gpus", resources.gpus,
                                  f"must be a multiple of nodes={nodes} (each node runs the same number of ranks)")
        # GPUs only when asked for by type; confirmed against the cluster when the job starts
        device = "cuda" if resources.gpu_type else "cpu"
        return Plan(nodes=nodes, procs_per_node=resources.gpus // nodes, device=device)

    def dry_run(self, run_id: str, plan: Plan, launches: list[NodeLaunch]) -> dict[str, Any]:
        return {"compute": "ray", "address": self.address, "run_id": run_id,
                "trainer": "ray.train.torch.TorchTrainer", "num_workers": plan.world_size,
                "use_gpu_if_available": plan.device == "cuda", "runtime_env": self.runtime_env,
                "backend": self.backend or "nccl on GPU workers, gloo on CPU workers"}

    # -- the whole job ------------------------------------------------------------

    def connect(self) -> None:
        """Join the cluster once per process (reusing a connection the caller already made)."""
        import ray

        with self._lock:
            if ray.is_initialized():
                self._check_same_cluster()
                return
            ray.init(address=self.address, runtime_env=self.runtime_env or None, log_to_driver=False,
                     logging_level="WARNING")
            self._connected_here = True

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
        """Leave the cluster if this compute joined it (the task runner calls this at flow end)."""
        if self._connected_here:
            import ray

            ray.shutdown()
            self._connected_here = False

    def execute(self, job: "Job") -> "JobResult":
        import ray

        from prefect_sgpu.ray.train_worker import Collector

        plan, blob, key = job.prepare()
        self.connect()
        scaling = scaling_options(job.resources, plan, ray.cluster_resources())
        plan = dataclasses.replace(plan, device="cuda" if scaling["use_gpu"] else "cpu")
        if job.resources.gpu_type and not scaling["use_gpu"]:
            job.sink.warning(f"the Ray cluster at {self.address} has no GPUs: running "
                             f"{plan.world_size} CPU worker(s)")
        job.plan = plan
        env = {**job.options.env, "SGPU_RUN_ID": job.run_id, "SGPU_JOB_DIR": job.store.uri(job.run_id),
               "SGPU_DEVICE": plan.device, "PYTHONUNBUFFERED": "1", **(job.tracked.env if job.tracked else {})}
        collector = ray.remote(num_cpus=0)(Collector).remote()
        config = {"payload": blob, "key": key, "env": env, "collector": collector}
        fit = ray.remote(num_cpus=0, max_retries=0)(_fit).remote(
            config, scaling, job.run_id, job.options.max_restarts, self.backend)
        logs: dict[int, list[str]] = {}
        finished = False
        try:
            error = self._wait(job, fit, collector, logs)
            finished = True
            self._drain(job, collector, logs)
            for rank, envelope in ray.get(collector.results.remote()).items():
                job.store.put(job.run_id, rank_key("results", rank), envelope)
            if error is not None:
                job.store.put(job.run_id, "nodes/node-0.json", json.dumps(
                    {"node": 0, "host": self.address, "exit_code": 1, "failures": {}, "error": error}).encode())
            return job.collect(plan, {0: 1 if error is not None else 0})
        finally:
            connected = ray.is_initialized()
            if not finished and connected:  # cancelled, timed out or interrupted: stop the run
                self._cancel(fit)
            try:
                self._drain(job, collector, logs)
            except Exception:  # noqa: BLE001 - the collector may be gone with a failed run
                pass
            for rank, lines in logs.items():
                job.store.put(job.run_id, rank_key("logs", rank), ("\n".join(lines) + "\n").encode())
            if connected:
                ray.kill(collector)

    @staticmethod
    def _cancel(fit: Any) -> None:
        """Abort the run gracefully, so Ray Train releases its workers and placement group.

        A plain cancel interrupts ``fit()`` the way Ctrl-C does, and Ray Train answers by
        aborting its controller and worker group. Killing the task outright would leave the
        run's placement group reserved until this driver disconnects (clusters with a
        dashboard clean it up later); that is only the fallback.
        """
        import ray

        ray.cancel(fit, force=False)
        ready, _ = ray.wait([fit], timeout=CANCEL_GRACE_S)
        if not ready:
            ray.cancel(fit, force=True)

    def _wait(self, job: "Job", fit: Any, collector: Any, logs: dict[int, list[str]]) -> str | None:
        """Stream lines until the run ends; its error text, or None when it succeeded."""
        import ray

        deadline = job.started_at + job.options.timeout
        while True:
            ready, _ = ray.wait([fit], timeout=POLL_INTERVAL_S)
            self._drain(job, collector, logs)
            if ready:
                try:
                    ray.get(fit)
                    return None
                except Exception as exc:  # noqa: BLE001 - the ranks' envelopes say what failed
                    cause = getattr(exc, "cause", None) or exc
                    return f"{type(cause).__name__}: {cause}".strip()[:4000]
            if job.cancel_event.is_set():
                raise JobCancelled(f"job {job.run_id} was cancelled; the Ray Train run was stopped")
            if time.monotonic() > deadline:
                raise LaunchTimeout(job.run_id, job.options.timeout)

    def _drain(self, job: "Job", collector: Any, logs: dict[int, list[str]]) -> None:
        import ray

        if not ray.is_initialized():  # close() ran meanwhile: never let ray auto-start a local instance
            raise JobCancelled(f"job {job.run_id}: this process left the Ray cluster at {self.address}")
        for rank, node, text in ray.get(collector.drain.remote()):
            logs.setdefault(rank, []).append(text)
            job.sink.line(rank, node, text)

    # -- the node protocol does not apply: Ray places the workers ---------------------

    def acquire(self, run_id: str, plan: Plan, cancel: Any = None) -> Allocation:
        raise NotImplementedError("RayTrainCompute runs whole jobs through execute(); Ray places the workers")

    def start(self, allocation: Allocation, launch: NodeLaunch) -> None:
        raise NotImplementedError("RayTrainCompute runs whole jobs through execute()")

    def poll(self, allocation: Allocation, node: Any) -> int | None:
        raise NotImplementedError("RayTrainCompute runs whole jobs through execute()")

    def stop(self, allocation: Allocation, grace: float = 10.0) -> None:
        return None

    def release(self, allocation: Allocation) -> None:
        return None
