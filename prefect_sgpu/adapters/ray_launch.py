"""``@ray_launch``: a Ray cluster over the job's nodes, the function once as its driver.

The same resources, options and compute as ``@distributed`` (local simulated nodes,
EC2 nodes, ...); only what each node runs differs. Node 0 hosts the Ray head on the
job's rendezvous port, the others join it, and the function runs once on node 0 with
``RAY_ADDRESS`` set, so Ray Train, Ray Data and actors inside it use every node.

Every cluster runs with Ray's token authentication, so a Ray without it (before 2.52.0)
is refused (:mod:`prefect_sgpu.ray.token_auth`).
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, ParamSpec, TypeVar

from typing_extensions import Unpack

from prefect_sgpu.adapters.decorator import DistributedFunction, DistributedFuture
from prefect_sgpu import spec as spec_mod
from prefect_sgpu.driver.job import Job, Launcher
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.observe.logs import RankLogSink
from prefect_sgpu.spec import JobArgs, SpecLayer, require_fixed_nodes

if TYPE_CHECKING:
    from prefect_sgpu.compute.base import Request
    from prefect_sgpu.spec import Plan
    from prefect_sgpu.store import Store

P = ParamSpec("P")
R = TypeVar("R")


class RayLauncher(Launcher):
    """Each node runs ``prefect_sgpu.ray.node``: head on node 0, joiners elsewhere; one result."""

    name = "ray"

    def __init__(self, metrics_to_mlflow: bool = False, metrics_interval: float = 5.0,
                 runtime_env: dict[str, Any] | None = None) -> None:
        self.metrics_to_mlflow = metrics_to_mlflow
        self.metrics_interval = metrics_interval
        #: the Ray job's runtime_env (``environment=`` mapped): ``ray.init()`` in the function uses it
        self.runtime_env = dict(runtime_env or {})

    def node_argv(self, job: Job, request: "Request", node: int, address: str, endpoint: str) -> list[str]:
        plan = request.plan
        # logical resources match the plan: GPUs only where the plan has them, else that many CPUs
        resources = ([f"--num-gpus={plan.procs_per_node}"] if plan.device == "cuda"
                     else [f"--num-cpus={plan.procs_per_node}", "--num-gpus=0"])
        argv = [
            sys.executable, "-m", "prefect_sgpu.ray.node",
            f"--run-id={job.run_id}", f"--job-dir={job.store.uri(job.run_id)}",
            f"--node-index={node}", f"--nnodes={plan.nodes}", f"--gcs-endpoint={endpoint}",
            f"--node-ip={address}", *resources, f"--heartbeat-ttl={request.heartbeat_ttl_s:g}",
            f"--join-timeout={min(job.spec.timeout, 600):g}",
        ]
        if self.runtime_env and node == 0:  # the driver's ray.init() reads it as Ray's job config
            from prefect_sgpu.ray.runtime_env import job_config_json

            argv.append(f"--runtime-env={job_config_json(self.runtime_env)}")
        if self.metrics_to_mlflow and job.spec.mlflow:
            argv += ["--metrics-to-mlflow", f"--metrics-interval={self.metrics_interval:g}"]
        return argv

    def result_ranks(self, plan: "Plan") -> list[int]:
        return [0]  # the driver on node 0


def _runtime_env(job: Job) -> dict[str, Any]:
    """The Ray job's ``runtime_env`` for ``environment=``.

    Nodes of this machine (a local compute) run in the driver's own Python, so only what the
    call gives travels, through Ray: ``working_dir``, ``py_modules`` and ``requirements`` (Ray's
    pip). Remote nodes (EC2) already run every Ray process in the environment their
    environment stage built (docs/environment.md), with the project on ``sys.path``: nothing is
    repeated through Ray."""
    from prefect_sgpu.environment import Environment, EnvironmentOptions
    from prefect_sgpu.ray.runtime_env import merged

    option = job.spec.environment
    if job.compute.remote or option is None:
        return {}
    environment = option if isinstance(option, Environment) else None
    if isinstance(option, EnvironmentOptions):
        environment = option.capture()
    return merged({}, environment, field="environment")


class RayDriverFuture(DistributedFuture[R]):
    """A running ``.submit()`` of a ``@ray_launch`` function: ``result()`` is the driver's value."""

    def result(self, timeout: float | None = None) -> R:  # type: ignore[override]
        return self._future.result(timeout).values[0]  # type: ignore[no-any-return]


class RayLaunchFunction(DistributedFunction[P, R]):
    """A function that runs once, as the driver of a Ray cluster built over the job's nodes."""

    def __init__(self, fn: Callable[P, R], layer: SpecLayer, compute: Any | None = None,
                 store: "Store | Any | None" = None, ray_metrics_to_mlflow: bool = False) -> None:
        restarts = layer.given().get("max_restarts")
        if restarts:
            raise SGPUConfigError(
                "max_restarts", restarts, "0 for @ray_launch",
                "Ray retries its own tasks and actors; for training use Ray Train's FailureConfig",
            )
        super().__init__(fn, layer, compute=compute, store=store)
        self.ray_metrics_to_mlflow = bool(ray_metrics_to_mlflow)

    _kind = "@ray_launch function"

    def _runs(self) -> str:
        return f"run it as the driver of a Ray cluster over {self.spec.gpus} GPU(s)"

    def with_options(self, **changes: Any) -> "RayLaunchFunction[P, R]":
        metrics = changes.pop("ray_metrics_to_mlflow", self.ray_metrics_to_mlflow)
        layer, compute, store = self._changed(changes)
        return RayLaunchFunction(self.func, layer, compute=compute, store=store, ray_metrics_to_mlflow=metrics)

    def job(self, *args: Any, cancel_event: threading.Event | None = None,
            sink: RankLogSink | None = None, **kwargs: Any) -> Job:
        job = super().job(*args, cancel_event=cancel_event, sink=sink, **kwargs)
        require_fixed_nodes(job.spec, "@ray_launch")
        if not job.compute.runs_node_agents:
            raise SGPUConfigError(
                "compute", type(job.compute).__name__, "a compute that provides nodes (local or EC2)",
                "@ray_launch builds its own Ray cluster; on an existing cluster call ray.init(address) "
                "in the flow, or use @distributed with RayCompute for Ray Train jobs",
            )
        from prefect_sgpu.ray.token_auth import installed_ray_version, require_token_auth

        here = installed_ray_version()
        if here is not None:  # the nodes check their own Ray again before starting it
            require_token_auth(here)
        job.launcher = RayLauncher(metrics_to_mlflow=self.ray_metrics_to_mlflow, runtime_env=_runtime_env(job))
        return job

    def distributed(self, *args: P.args, **kwargs: P.kwargs) -> R:  # type: ignore[override]
        """Run as the Ray driver over every node; return the driver's value."""
        return self.run(*args, **kwargs).values[0]  # type: ignore[no-any-return]

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> RayDriverFuture[R]:  # type: ignore[override]
        future = super().submit(*args, **kwargs)
        return RayDriverFuture(future._future, future._cancel)


def ray_launch(
    fn: Callable[P, R] | None = None,
    *,
    compute: Any | None = None,
    store: Any | None = None,
    ray_metrics_to_mlflow: bool = False,
    **given: Unpack[JobArgs],
) -> Any:
    """Run ``fn`` once as the driver of a Ray cluster spanning ``gpus`` GPUs on ``nodes`` nodes.

    Resources and options are those of ``@distributed`` and are validated here. Inside,
    ``ray.init()`` (or Ray Train / Ray Data directly) connects to the job's cluster.
    ``ray_metrics_to_mlflow=True`` samples the cluster's resources into the call's
    MLflow run as ``system/ray/...`` metrics.
    """
    layer = spec_mod.layer("call", **given)

    def wrap(f: Callable[P, R]) -> RayLaunchFunction[P, R]:
        return RayLaunchFunction(f, layer, compute=compute, store=store,
                                 ray_metrics_to_mlflow=ray_metrics_to_mlflow)

    return wrap(fn) if fn is not None else wrap
