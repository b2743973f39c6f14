"""The ``sgpu`` work pool type: flow runs whose GPU tasks use a saved compute block.

The worker starts each flow run as a process, as Prefect's process worker does (so
cancellation, streaming and crash reporting are Prefect's own), and hands the run the
pool's compute and store blocks through the environment: ``GPUTaskRunner()`` and
``gpu_task`` inside the flow then launch their jobs there (local processes, EC2, Ray).
``kill_infrastructure`` stops a run's whole process tree, GPU jobs included.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any, Optional

from prefect.workers.process import ProcessJobConfiguration, ProcessVariables, ProcessWorker
from pydantic import Field

COMPUTE_DESCRIPTION = (
    "Compute block the flow run's GPU tasks use, as '<block-type-slug>/<block-name>' "
    "(for example 'sgpu-ec2-compute/h100-pool'); empty runs them as local processes."
)
STORE_DESCRIPTION = "Store block ('sgpu-store/<name>') for job files; empty uses the compute's default."


class SGPUJobConfiguration(ProcessJobConfiguration):
    compute_block: Optional[str] = Field(default=None, description=COMPUTE_DESCRIPTION)
    store_block: Optional[str] = Field(default=None, description=STORE_DESCRIPTION)

    def prepare_for_flow_run(self, flow_run: Any, deployment: Any = None, flow: Any = None,
                             work_pool: Any = None, worker_name: str | None = None,
                             worker_id: Any = None) -> None:
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id=worker_id)
        if self.compute_block:
            self.env["PREFECT_SGPU_COMPUTE"] = self.compute_block
        if self.store_block:
            self.env["PREFECT_SGPU_STORE"] = self.store_block


class SGPUVariables(ProcessVariables):
    compute_block: Optional[str] = Field(default=None, description=COMPUTE_DESCRIPTION)
    store_block: Optional[str] = Field(default=None, description=STORE_DESCRIPTION)


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
    _documentation_url = "https://github.com/prefect-sgpu/prefect-sgpu#readme"
    _logo_url = ProcessWorker._logo_url

    async def kill_infrastructure(self, infrastructure_pid: str, configuration: Any,
                                  grace_seconds: int = 30) -> None:
        """SIGTERM the flow run's process group (its GPU jobs stop their ranks), then SIGKILL."""
        import psutil
        from prefect.exceptions import InfrastructureNotFound

        pid = int(str(infrastructure_pid).rsplit(":", 1)[-1])
        try:
            root = psutil.Process(pid)
        except psutil.NoSuchProcess:
            raise InfrastructureNotFound(f"flow run process {pid} is not running") from None
        tree = [root, *root.children(recursive=True)]
        root.send_signal(signal.SIGTERM)
        _, alive = await asyncio.to_thread(psutil.wait_procs, tree, grace_seconds)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        await asyncio.to_thread(psutil.wait_procs, alive, 5)
