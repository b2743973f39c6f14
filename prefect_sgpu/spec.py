"""What to run, independent of where: the validated job model.

Every user-facing knob lands in a pydantic model here and is checked before any
process, VM or MLflow run exists. Errors name the field, the value and what is
allowed (:class:`~prefect_sgpu.errors.SGPUConfigError`).
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from prefect_sgpu import catalog
from prefect_sgpu.errors import SGPUConfigError

DEFAULT_TIMEOUT_S = 3 * 60 * 60.0


class Resources(BaseModel):
    """How many GPUs of which type, on how many nodes, here or remote."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus: int = Field(1, ge=1, description="Total GPUs (ranks) of the job.")
    gpu_type: str | None = Field(None, description="Accelerator name from the catalog.")
    nodes: int | None = Field(None, ge=1, description="Nodes; derived when omitted.")
    remote: bool = Field(False, description="Run on remote compute instead of this machine.")

    @field_validator("gpu_type")
    @classmethod
    def _known_gpu_type(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return catalog.lookup(value).name


class JobOptions(BaseModel):
    """How a job runs: limits, restarts, environment, tracking."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout: float = Field(DEFAULT_TIMEOUT_S, gt=0, description="Seconds before every rank is stopped.")
    max_restarts: int = Field(0, ge=0, description="Worker-group restarts torch elastic may do.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for every rank.")
    mlflow: bool = Field(True, description="Open one MLflow run per call and hand it to every rank.")

    @field_validator("timeout", mode="before")
    @classmethod
    def _timedelta_to_seconds(cls, value: Any) -> Any:
        if isinstance(value, _dt.timedelta):
            return value.total_seconds()
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env_strings(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): str(v) for k, v in value.items()}
        return value


@dataclass(frozen=True)
class Plan:
    """The resolved shape of a job: nodes x procs_per_node ranks on one device kind."""

    nodes: int
    procs_per_node: int
    device: str  # "cuda" or "cpu"
    instance_type: catalog.InstanceType | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


def _config_error(model: type[BaseModel], exc: ValidationError) -> SGPUConfigError:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err.get("loc", ())) or model.__name__
    value = err.get("input")
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, SGPUConfigError):
        return cause
    return SGPUConfigError(field, value, err.get("msg", "invalid value"))


def make_resources(**values: Any) -> Resources:
    try:
        return Resources(**values)
    except ValidationError as exc:
        raise _config_error(Resources, exc) from None


def make_options(**values: Any) -> JobOptions:
    try:
        return JobOptions(**values)
    except ValidationError as exc:
        raise _config_error(JobOptions, exc) from None


def plan_remote(resources: Resources) -> Plan:
    """Whole nodes of one instance type, from the catalog."""
    if resources.gpu_type is None:
        raise SGPUConfigError(
            "gpu_type", None, "remote=True needs a gpu_type: one of " + ", ".join(catalog.known_gpu_types())
        )
    nodes, itype = catalog.plan_nodes(resources.gpu_type, resources.gpus, resources.nodes)
    return Plan(nodes=nodes, procs_per_node=itype.gpus, device="cuda", instance_type=itype)


def plan_local(resources: Resources, local_gpus: int) -> Plan:
    """Simulated nodes on this machine: one rank per GPU, or CPU ranks when it has none."""
    nodes = resources.nodes or 1
    if resources.gpus % nodes:
        raise SGPUConfigError(
            "gpus",
            resources.gpus,
            f"must be a multiple of nodes={nodes} (each node runs the same number of ranks)",
        )
    if local_gpus == 0:
        return Plan(nodes=nodes, procs_per_node=resources.gpus // nodes, device="cpu")
    if resources.gpus > local_gpus:
        raise SGPUConfigError(
            "gpus",
            resources.gpus,
            f"at most {local_gpus} on this machine (it has {local_gpus} GPU(s)); "
            "use remote=True or set PREFECT_SGPU_DEVICE=cpu to run CPU ranks",
        )
    return Plan(nodes=nodes, procs_per_node=resources.gpus // nodes, device="cuda")
