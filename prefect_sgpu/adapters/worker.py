"""The ``sgpu`` work pool type: flow runs whose GPU tasks use a saved compute block.

The worker starts each flow run as a process, as Prefect's process worker does (so
cancellation, streaming and crash reporting are Prefect's own), and hands the run the
pool's compute and store blocks and GPU-task defaults through the environment:
``GPUTaskRunner()`` and ``gpu_task`` inside the flow then launch their jobs there (local
processes, EC2, Ray). Every job variable is checked while the worker prepares the run
(:mod:`prefect_sgpu.adapters.pool_variables`), before the flow run's process exists.
``kill_infrastructure`` stops a run's whole process tree, GPU jobs included, and only
on the host that started it.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from typing import Annotated, Any, Literal, Optional, Union

from prefect.workers.process import ProcessJobConfiguration, ProcessVariables, ProcessWorker
from pydantic import Field

from prefect_sgpu.adapters import pool_variables as pv
from prefect_sgpu.blocks import EC2Compute, LocalCompute, RayCompute, SGPUStore

COMPUTE_DESCRIPTION = (
    "Compute block the flow run's GPU tasks use: pick a saved block, or write "
    "'<block-type-slug>/<block-name>' (for example 'sgpu-ec2-compute/h100-pool'); "
    "empty runs them as local processes. A block that does not exist fails the run before it starts."
)
STORE_DESCRIPTION = (
    "Store block for job files: pick a saved block or write 'sgpu-store/<name>'; "
    "empty uses the compute's default."
)
ComputeName = Annotated[str, Field(pattern=pv.slug_pattern(pv.COMPUTE_SLUGS), title="Block name")]
StoreName = Annotated[str, Field(pattern=pv.slug_pattern(pv.STORE_SLUGS), title="Block name")]


def _gpu_description(what: str) -> str:
    return (f"{what}, for every GPU task of the flow run that does not set its own"
            " (a task or call setting wins).")


class SGPUJobConfiguration(ProcessJobConfiguration):
    compute_block: Optional[Any] = Field(default=None, description=COMPUTE_DESCRIPTION)
    store_block: Optional[Any] = Field(default=None, description=STORE_DESCRIPTION)
    gpus: Optional[Any] = Field(default=None, description=_gpu_description("Default GPUs (ranks)"))
    gpu_type: Optional[Any] = Field(default=None, description=_gpu_description("Default accelerator"))
    nodes: Optional[Any] = Field(default=None, description=_gpu_description("Default nodes"))
    strategy: Optional[Any] = Field(default=None, description=_gpu_description("Default strategy"))
    max_recoveries: Optional[Any] = Field(default=None, description=_gpu_description("Default recoveries"))
    hang_timeout: Optional[Any] = Field(default=None, description=_gpu_description("Default hang timeout"))
    straggler_factor: Optional[Any] = Field(default=None, description=_gpu_description("Default straggler factor"))
    straggler_steps: Optional[Any] = Field(default=None, description=_gpu_description("Default straggler steps"))
    gang_check: Optional[Any] = Field(default=None, description=_gpu_description("Default gang check"))
    environment: Optional[Any] = Field(default=None, description=_gpu_description("Default environment"))
    max_cost_usd: Optional[Any] = Field(default=None, description=_gpu_description("Default cost cap (USD)"))

    @classmethod
    async def from_template_and_values(cls, base_job_template: dict[str, Any], values: dict[str, Any],
                                       client: Any = None) -> "SGPUJobConfiguration":
        """Prefect's configuration, with the block names and GPU defaults checked first.

        Block references are read here, before Prefect's template resolution would replace
        a ``$ref`` with the block's values: the flow run gets the block's name, never its data.
        """
        from prefect.client.orchestration import get_client

        effective = pv.variables_with_defaults(base_job_template, values)
        if client is None:
            async with get_client() as own_client:
                checked = await _checked_blocks(own_client, effective)
        else:
            checked = await _checked_blocks(client, effective)
        defaults = pv.gpu_defaults(effective)
        config = await super().from_template_and_values(base_job_template, {**values, **checked},
                                                         client=client)
        config.compute_block, config.store_block = checked["compute_block"], checked["store_block"]
        for name in pv.GPU_DEFAULTS:
            setattr(config, name, defaults.get(name))
        return config

    def prepare_for_flow_run(self, flow_run: Any, deployment: Any = None, flow: Any = None,
                             work_pool: Any = None, worker_name: str | None = None,
                             worker_id: Any = None) -> None:
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id=worker_id)
        if self.compute_block:
            self.env["PREFECT_SGPU_COMPUTE"] = self.compute_block
        if self.store_block:
            self.env["PREFECT_SGPU_STORE"] = self.store_block
        given = {name: getattr(self, name) for name in pv.GPU_DEFAULTS if getattr(self, name) is not None}
        self.env.update(pv.gpu_defaults_env(given))


async def _checked_blocks(client: Any, variables: dict[str, Any]) -> dict[str, Any]:
    return {
        "compute_block": await pv.block_reference(client, "compute_block", variables.get("compute_block"),
                                                  pv.COMPUTE_SLUGS),
        "store_block": await pv.block_reference(client, "store_block", variables.get("store_block"),
                                                pv.STORE_SLUGS),
    }


class SGPUVariables(ProcessVariables):
    compute_block: Optional[Union[LocalCompute, EC2Compute, RayCompute, ComputeName]] = Field(
        default=None, title="Compute Block", description=COMPUTE_DESCRIPTION)
    store_block: Optional[Union[SGPUStore, StoreName]] = Field(
        default=None, title="Store Block", description=STORE_DESCRIPTION)
    gpus: Optional[int] = Field(default=None, ge=1, title="GPUs",
                                description=_gpu_description("Default GPUs (ranks) of a GPU task"))
    gpu_type: Optional[str] = Field(
        default=None, title="GPU Type",
        description=_gpu_description("Default accelerator from the catalog (A10, A100, H100, L4, ...)"))
    nodes: Optional[int] = Field(default=None, ge=1, title="Nodes",
                                 description=_gpu_description("Default nodes of a GPU task; empty: derived"))
    strategy: Optional[Literal["ddp", "fsdp", "deepspeed"]] = Field(
        default=None, title="Strategy", description=_gpu_description("Default training strategy"))
    max_recoveries: Optional[int] = Field(
        default=None, ge=0, title="Max Recoveries",
        description=_gpu_description("Default relaunches after infrastructure loss"))
    hang_timeout: Optional[float] = Field(
        default=None, gt=0, title="Hang Timeout",
        description=_gpu_description("Default seconds without progress from a rank before a job fails"))
    straggler_factor: Optional[float] = Field(
        default=None, gt=1, title="Straggler Factor",
        description=_gpu_description("Default factor: a rank slower than the median step rate divided by it "
                                     "is named a straggler"))
    straggler_steps: Optional[int] = Field(
        default=None, ge=1, title="Straggler Steps",
        description=_gpu_description("Default steps a rank stays that slow before it is named a straggler"))
    gang_check: Optional[bool] = Field(
        default=None, title="Gang Check",
        description=_gpu_description("Check every job's ranks before the function runs (known collective "
                                     "results, each node link's bandwidth, GPU health); false skips it"))
    environment: Optional[Union[str, dict[str, Any]]] = Field(
        default=None, title="Environment",
        description=_gpu_description("What remote nodes need: 'driver' (default: the driver's Python, pinned "
                                     "distributions and local packages), 'image' (the image has everything), "
                                     "an object of options (working_dir, py_modules, requirements, index_url, "
                                     "extra_index_urls, find_links, excludes, max_bytes) or the path of a "
                                     ".json/.toml file of them"))
    max_cost_usd: Optional[float] = Field(
        default=None, gt=0, title="Max Cost (USD)",
        description=_gpu_description("Default cost cap of a GPU task's job in US dollars: at the cap the "
                                     "ranks save a final checkpoint and the job stops (priced computes "
                                     "only: EC2)"))

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Pydantic's schema, where a block's own schema admits only its fields.

        Prefect's server lets a block-typed variable hold either the block's values or a
        ``{"$ref": {"block_document_id": ...}}`` (what the UI's block picker saves), one of
        the two exactly; a block whose fields all have defaults would match both.
        """
        schema = super().model_json_schema(*args, **kwargs)
        for definition in (schema.get("definitions") or schema.get("$defs") or {}).values():
            if "block_type_slug" in definition:
                definition["additionalProperties"] = False
        return schema


class SGPUWorker(ProcessWorker):
    """Runs flow runs whose GPU tasks are multi-node jobs on the pool's compute block."""

    type = "sgpu"
    job_configuration = SGPUJobConfiguration
    job_configuration_variables = SGPUVariables
    _description = (
        "Runs flow runs as processes whose GPU tasks launch multi-node torch jobs on a "
        "prefect-sgpu compute block (local processes, EC2, or a Ray cluster)."
    )
    _display_name = "prefect-sgpu"
    _logo_url = ProcessWorker._logo_url

    async def run(self, flow_run: Any, configuration: Any, task_status: Any = None) -> Any:
        """Prefect's process worker, reporting the run's process as ``'<hostname>:<pid>'``.

        The host part lets ``kill_infrastructure`` refuse a process another machine started.
        """
        import anyio

        outer = task_status if task_status is not None else anyio.TASK_STATUS_IGNORED

        class _HostPid:
            def started(self, value: Any = None) -> None:
                outer.started(f"{socket.gethostname()}:{value}")

        return await super().run(flow_run=flow_run, configuration=configuration, task_status=_HostPid())

    async def kill_infrastructure(self, infrastructure_pid: str, configuration: Any,
                                  grace_seconds: int = 30) -> None:
        """SIGTERM the flow run's process group (its GPU jobs stop their ranks), then SIGKILL.

        ``infrastructure_pid`` is ``'<hostname>:<pid>'`` or a bare pid; a host other than
        this one is refused with ``InfrastructureNotAvailable`` and nothing is signalled.
        The pid comes from the Prefect API, which whoever can edit a flow run writes: it is
        signalled only when it is the process a worker started for the flow run being
        cancelled (its environment names that flow run, as the worker set it), else
        ``InfrastructureNotAvailable`` and nothing is signalled.
        """
        import psutil
        from prefect.exceptions import InfrastructureNotAvailable, InfrastructureNotFound

        host, sep, raw_pid = str(infrastructure_pid).rpartition(":")
        if sep and host != socket.gethostname():
            raise InfrastructureNotAvailable(
                f"Unable to kill process {raw_pid!r}: it runs on host {host!r}, and this worker runs on "
                f"{socket.gethostname()!r}")
        try:
            pid = int(raw_pid)
        except ValueError:
            raise InfrastructureNotFound(f"infrastructure_pid {infrastructure_pid!r} names no process") \
                from None
        try:
            root = psutil.Process(pid)
        except psutil.NoSuchProcess:
            raise InfrastructureNotFound(f"flow run process {pid} is not running") from None
        _check_flow_run_process(root, configuration)
        tree = [root, *root.children(recursive=True)]
        root.send_signal(signal.SIGTERM)
        _, alive = await asyncio.to_thread(psutil.wait_procs, tree, grace_seconds)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        await asyncio.to_thread(psutil.wait_procs, alive, 5)


FLOW_RUN_ENV = "PREFECT__FLOW_RUN_ID"


def _check_flow_run_process(proc: Any, configuration: Any) -> None:
    """InfrastructureNotAvailable unless ``proc`` was started for the flow run of ``configuration``.

    The worker starts a flow run's process with ``PREFECT__FLOW_RUN_ID`` in its environment (Prefect's
    own job configuration sets it), and the configuration Prefect hands to ``kill_infrastructure``
    is prepared for the flow run being cancelled: a pid of any other process (the worker, another
    flow run's, another user's) does not match and is never signalled."""
    import psutil
    from prefect.exceptions import InfrastructureNotAvailable

    env = getattr(configuration, "env", None) or {}
    expected = env.get(FLOW_RUN_ENV) if isinstance(env, dict) else None
    if not expected:
        raise InfrastructureNotAvailable(f"Unable to kill process {proc.pid}: the configuration names no flow "
                                         "run, so nothing shows that this worker started it")
    try:
        found = proc.environ().get(FLOW_RUN_ENV)
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
        found = None
    if found != expected:
        raise InfrastructureNotAvailable(f"Unable to kill process {proc.pid}: it is not the process of flow run "
                                         f"{expected} (a worker starts that with {FLOW_RUN_ENV}={expected})")
