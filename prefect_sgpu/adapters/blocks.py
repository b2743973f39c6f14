"""Prefect blocks: saved compute and storage configuration for GPU jobs.

A deployment names a block (``EC2Compute.load("h100-pool")``) instead of carrying
cloud settings in code; the block builds the compute object the driver uses. Blocks
hold configuration only: nothing is provisioned until a job runs.
"""

from __future__ import annotations

from abc import ABC
from typing import Any, Literal, Optional, Union

from prefect.blocks.core import Block
from pydantic import AfterValidator, Field
from typing_extensions import Annotated

from prefect_sgpu.compute.ec2.settings import EC2ComputeFields

try:  # AWS credentials reuse prefect-aws's block when the aws extra is installed
    from prefect_aws import AwsCredentials
except ImportError:  # pragma: no cover - exercised only without the aws extra
    AwsCredentials = None  # type: ignore[assignment,misc]

_DOCS = "https://github.com/prefect-sgpu/prefect-sgpu#readme"
_LOGO = "https://raw.githubusercontent.com/PrefectHQ/prefect/420d0d6a78bb6df1fc18bcf188fdad43c1d22ea9/assets/block-logos/process.png"


ENVIRONMENT_DESCRIPTION = (
    "What the nodes need, for every job on this compute that does not set its own (a call, task or task runner "
    "wins; PREFECT_SGPU_ENVIRONMENT is below): 'driver' (the default: the driver's Python, pinned "
    "distributions, local packages), 'image' (the image has every distribution), a JSON object or dict of "
    "options (working_dir, py_modules, requirements, index_url, extra_index_urls, find_links, excludes, "
    "max_bytes), or the path of a .json or .toml file of them. See docs/environment.md."
)


def _checked_environment(value: Any) -> Any:
    """The block keeps what was given (it saves as JSON); what it means is checked now."""
    from prefect_sgpu.environment import parse_option

    parse_option(value, "environment")
    return value


#: a block's ``environment=``, checked where the block is made
EnvironmentOption = Annotated[Optional[Union[str, dict[str, Any]]], AfterValidator(_checked_environment)]


def _with_environment(compute: Any, option: Any) -> Any:
    """The compute, carrying the block's ``environment=`` for :func:`prefect_sgpu.spec.compute_layer`."""
    if option is not None:
        from prefect_sgpu.environment import parse_option

        compute.sgpu_environment = parse_option(option, "environment")
    return compute


def _example(name: str, body: str, variable: str = "compute") -> str:
    return f'```python\nfrom prefect_sgpu.blocks import {name}\n\n{variable} = {name}.load("BLOCK_NAME")\n{body}\n```'


class SGPUBlock(Block, ABC):
    """What every prefect-sgpu block shares (an interface: Prefect registers only its subclasses)."""

    _documentation_url = _DOCS
    _logo_url = _LOGO  # type: ignore[assignment]


class LocalCompute(SGPUBlock):
    """Run every node of a job as local processes on the machine that runs the flow."""

    _block_type_name = "SGPU Local Compute"
    _block_type_slug = "sgpu-local-compute"
    _description = (
        "Runs GPU jobs as local processes (one torch elastic agent per simulated node); "
        "CPU ranks with gloo when the machine has no GPU."
    )
    _code_example = _example(
        "LocalCompute", "\n@flow(task_runner=GPUTaskRunner(compute=compute))\ndef pipeline(): ..."
    )

    isolation: Literal["auto", "namespaces", "none"] = Field(
        default="auto",
        description="Give each simulated node its own PID and mount namespace (private /dev/shm) when possible.",
    )
    shm_size: str = Field(default="2g", description="Size of each simulated node's private /dev/shm.")
    keep_warm: Optional[float] = Field(
        default=None, ge=0,
        description="Seconds a finished job's node processes (torch imported) wait for the next job of the "
                    "same shape, which then starts without a cold start; unset: PREFECT_SGPU_KEEP_WARM, "
                    "else 120; 0: every job starts cold. A flow's task runner closes them when the flow ends.",
    )

    def get_compute(self) -> Any:
        from prefect_sgpu.compute.local import LocalProcessCompute as Local

        return Local(isolation=self.isolation, shm_size=self.shm_size, keep_warm=self.keep_warm)


class SGPUStore(SGPUBlock):
    """Where job payloads, per-rank logs, results and checkpoints go: a folder or S3."""

    _block_type_name = "SGPU Store"
    _block_type_slug = "sgpu-store"
    _description = "The mailbox between a GPU job's driver and its nodes: a local folder or an s3:// prefix."
    _code_example = _example("SGPUStore", "@flow(task_runner=GPUTaskRunner(store=store))\ndef pipeline(): ...",
                             variable="store")

    uri: str = Field(
        default="", description="A local folder or s3://bucket/prefix; empty means $PREFECT_SGPU_HOME/jobs."
    )
    if AwsCredentials is not None:
        aws_credentials: Optional[AwsCredentials] = Field(  # type: ignore[valid-type]
            default=None, description="Credentials for an s3:// store."
        )

    def get_store(self) -> Any:
        from prefect_sgpu.store import LocalStore

        if self.uri.startswith("s3://"):
            from prefect_sgpu.store.s3 import S3Store

            creds = getattr(self, "aws_credentials", None)
            return S3Store(self.uri, session=creds.get_boto3_session() if creds else None)
        return LocalStore(self.uri or None)


class EC2Compute(SGPUBlock, EC2ComputeFields):
    """GPU VMs on AWS EC2, provisioned per job with boto3 and always terminated.

    Its fields are :class:`~prefect_sgpu.compute.ec2.settings.EC2ComputeFields` (each default and
    check written there once): a bad value is an ``SGPUConfigError`` where the block is made.
    """

    _block_type_name = "SGPU EC2 Compute"
    _block_type_slug = "sgpu-ec2-compute"
    _description = (
        "Provisions GPU instances on EC2 for each job (spot, on-demand or a capacity reservation, "
        "with AZ failover) and terminates them on every outcome."
    )
    _code_example = _example(
        "EC2Compute",
        '\n@distributed(gpus=16, gpu_type="H100", remote=True, compute=compute)\ndef train(): ...',
    )

    environment: EnvironmentOption = Field(default=None, description=ENVIRONMENT_DESCRIPTION)
    if AwsCredentials is not None:
        aws_credentials: Optional[AwsCredentials] = Field(  # type: ignore[valid-type]
            default=None, description="Credentials of the driver; nodes use the instance profile."
        )

    def get_compute(self) -> Any:
        from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute as EC2
        from prefect_sgpu.compute.ec2.settings import EC2Settings

        creds = getattr(self, "aws_credentials", None)
        compute = EC2(EC2Settings.of(self), session=creds.get_boto3_session() if creds else None)
        return _with_environment(compute, self.environment)


class RayCompute(SGPUBlock):
    """An existing Ray cluster: jobs run as Ray Train TorchTrainer runs."""

    _block_type_name = "SGPU Ray Compute"
    _block_type_slug = "sgpu-ray-compute"
    _description = "Runs GPU jobs on an existing Ray cluster as Ray Train TorchTrainer jobs."
    _code_example = _example(
        "RayCompute", "\n@flow(task_runner=GPUTaskRunner(compute=compute))\ndef pipeline(): ..."
    )

    address: str = Field(default="auto", description="Ray cluster address (ray://host:10001, or auto).")
    runtime_env: dict[str, Any] = Field(default_factory=dict, description="Ray runtime environment for the job.")
    backend: Optional[Literal["nccl", "gloo"]] = Field(
        default=None, description="torch.distributed backend; unset: nccl on GPU workers, gloo on CPU workers.")
    resources_per_worker: dict[str, float] = Field(
        default_factory=dict, description='Merged into every worker\'s Ray resources, e.g. {"CPU": 4} for data loading.')
    keep_warm: float = Field(
        default=0.0, ge=0,
        description="Seconds a warm worker group (placement group, one actor per rank with torch imported) "
                    "waits for the next job of the same shape, which then pays only for its function; 0: each "
                    "job is a Ray Train run of its own (needed by functions that call Ray Train's API).",
    )
    environment: EnvironmentOption = Field(default=None, description=ENVIRONMENT_DESCRIPTION)

    def get_compute(self) -> Any:
        from prefect_sgpu.ray.compute import RayTrainCompute as Ray

        return _with_environment(Ray(address=self.address, runtime_env=self.runtime_env, backend=self.backend,
                                     resources_per_worker=self.resources_per_worker, keep_warm=self.keep_warm),
                                 self.environment)

    def close(self) -> None:
        """Leave the cluster if a job of this process joined it (the Ray connection is per process)."""
        self.get_compute().close()
