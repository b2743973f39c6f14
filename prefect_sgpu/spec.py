"""What to run, independent of where: one validated ``JobSpec``.

Every user-facing knob lands here and is checked before any process, VM or MLflow
run exists. Errors name the field, the value and what is allowed
(:class:`~prefect_sgpu.errors.SGPUConfigError`).

Settings come in layers, highest first::

    call (with_options, a decorator's own arguments)
    > task (@gpu_task)
    > runner (GPUTaskRunner(...)) / work-pool job variables
    > environment (PREFECT_SGPU_<FIELD>)
    > built-in defaults

A layer holds only what its caller *gave*: ``GPUTaskRunner(gpus=4)`` under a bare
``@gpu_task()`` runs 4 ranks, because the task did not say ``gpus=1``, it said nothing.
Giving a value explicitly (even the built-in default, or ``None`` for ``nodes``)
does override the layers below.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Mapping

from typing_extensions import TypedDict

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator)

from prefect_sgpu import catalog
from prefect_sgpu import environment as environment_mod
from prefect_sgpu.errors import SGPUConfigError

DEFAULT_TIMEOUT_S = 3 * 60 * 60.0
DEFAULT_HANG_TIMEOUT_S = 15 * 60.0
DEFAULT_MAX_RECOVERIES = 3
DEFAULT_STRAGGLER_FACTOR = 2.0
DEFAULT_STRAGGLER_STEPS = 5
STRATEGIES = ("ddp", "fsdp", "deepspeed")
ENV_PREFIX = "PREFECT_SGPU_"


def _gpu_type(value: str | None) -> str | None:
    return None if value is None else catalog.lookup(value).name


def _seconds(value: Any) -> Any:
    return value.total_seconds() if isinstance(value, _dt.timedelta) else value


def _env_strings(value: Any) -> Any:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    return value


Gpus = Annotated[int, Field(ge=1, description="Total GPUs (ranks) of the job.")]
GpuType = Annotated[str | None, AfterValidator(_gpu_type), Field(description="Accelerator name from the catalog.")]
_NODES_ALLOWED = ("a whole number greater than or equal to 1, or (min, max): two whole numbers with 1 <= min <= max "
                  "(an elastic job: it starts once min nodes are up and grows to max), or None to derive it")


def _node_count(value: Any, given: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SGPUConfigError("nodes", given, _NODES_ALLOWED)
    return value


def _nodes(value: Any) -> Any:
    """``nodes``: N, or ``(min, max)`` (an elastic job; ``"min:max"`` from the environment, as torchrun's
    ``--nnodes``). ``(n, n)`` is ``n``: a job that cannot grow is not elastic."""
    if value is None:
        return None
    pair: Any = value
    if isinstance(value, str) and ":" in value:
        pair = value.split(":")
    if isinstance(pair, (tuple, list)):
        if len(pair) != 2:
            raise SGPUConfigError("nodes", value, _NODES_ALLOWED)
        low, high = (_node_count(v, value) for v in pair)
        if low > high:
            raise SGPUConfigError("nodes", value, _NODES_ALLOWED + f" (min {low} is more than max {high})")
        return low if low == high else (low, high)
    return _node_count(value, value)


Nodes = Annotated[int | tuple[int, int] | None, BeforeValidator(_nodes),
                  Field(description="Nodes, or (min, max) for an elastic job (local and EC2 computes); "
                                    "derived when omitted.")]
Timeout = Annotated[float, BeforeValidator(_seconds), Field(gt=0, description="Seconds before every rank is stopped.")]
Restarts = Annotated[int, Field(ge=0, description="Worker-group restarts torch elastic may do.")]
Env = Annotated[dict[str, str], BeforeValidator(_env_strings), Field(description="Extra environment for every rank.")]
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _secret_names(value: Any) -> Any:
    value = _env_strings(value)
    if isinstance(value, dict):
        for name, block in value.items():
            if not _ENV_NAME.match(name):
                raise SGPUConfigError(f"secrets[{name}]", name, "an environment variable name (letters, digits, _)")
            if not block.strip():
                raise SGPUConfigError(f"secrets[{name}]", block, "the name of a Prefect Secret block")
    return value


Secrets = Annotated[dict[str, str], BeforeValidator(_secret_names),
                    Field(description="Environment variables of every rank read from Prefect Secret blocks "
                                      "(variable -> block name); they travel encrypted, never in a document.")]
Recoveries = Annotated[int, Field(ge=0, description="Relaunches after infrastructure loss (spot reclaim, lost node).")]
HangTimeout = Annotated[Annotated[float, Field(gt=0)] | None, BeforeValidator(_seconds),
                        Field(description="Seconds without progress from a rank before the job fails; "
                                          "None turns the watchdog off.")]
StragglerFactor = Annotated[Annotated[float, Field(gt=1)] | None, Field(description=(
    "A rank whose step rate stays below the median rate divided by this factor is named a straggler; "
    "None turns straggler naming off."))]
StragglerSteps = Annotated[int, Field(ge=1, description="Steps a rank must stay that slow before it is named.")]
Strategy = Literal["ddp", "fsdp", "deepspeed"] | None
EnvironmentField = Annotated[Any, BeforeValidator(environment_mod.parse_option),
                             Field(description="What the nodes need (prefect_sgpu.environment): 'driver', 'image', "
                                               "options, or a captured Environment; unset: the driver's own.")]

def _trusted_results(value: Any) -> bool:
    """``trusted_results``: a bool, or (from the environment) true/false/1/0."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "false", "0"):
        return value.strip().lower() in ("true", "1")
    raise SGPUConfigError("trusted_results", value, "True (load any object a rank returns, only where every "
                          "rank's code is as trusted as the driver's) or False (plain data only, the default)")


TrustedResults = Annotated[bool, BeforeValidator(_trusted_results)]


def _usd(value: Any) -> Any:
    """``max_cost_usd``: a number (or its text), never a bool (pydantic would read True as 1.0)."""
    if isinstance(value, bool):
        raise SGPUConfigError("max_cost_usd", value, _ALLOWED["max_cost_usd"])
    return value


Usd = Annotated[float, Field(gt=0, allow_inf_nan=False)]
MaxCost = Annotated[Usd | None, BeforeValidator(_usd), Field(description=(
    "US dollars the job's machines may cost: once the cost so far, projected one check ahead, would pass "
    "it, the ranks are asked for a final checkpoint and the job is stopped (CostCapReached). Only on "
    "priced computes (EC2); None: no cap."))]


class JobArgs(TypedDict, total=False):
    """The keyword arguments of ``@distributed``, ``run_script`` and ``@ray_launch``: a key left
    out is *not given* (the layers below decide), which a default value could not express."""

    gpus: int
    gpu_type: str | None
    nodes: int | tuple[int, int] | None
    remote: bool
    timeout: float | _dt.timedelta
    max_restarts: int
    env: dict[str, str] | None
    secrets: dict[str, str] | None
    mlflow: bool
    max_recoveries: int
    hang_timeout: float | _dt.timedelta | None
    straggler_factor: float | None
    straggler_steps: int
    gang_check: bool
    environment: Any
    trusted_results: bool
    max_cost_usd: float | None
    fresh_machines: bool


class TaskArgs(JobArgs, total=False):
    """``@gpu_task`` and ``GPUTaskRunner`` take two more."""

    strategy: Literal["ddp", "fsdp", "deepspeed"] | None
    return_all: bool


#: every field of a job spec, in the order users meet them
FIELDS = ("gpus", "gpu_type", "nodes", "remote", "timeout", "max_restarts", "env", "secrets", "mlflow",
          "max_recoveries", "hang_timeout", "straggler_factor", "straggler_steps", "gang_check", "environment",
          "strategy", "return_all", "trusted_results", "max_cost_usd", "fresh_machines")


def max_nodes(nodes: int | tuple[int, int] | None) -> int | None:
    """The most nodes a ``nodes`` value asks for: N, or an elastic job's max."""
    return nodes[1] if isinstance(nodes, tuple) else nodes


def min_nodes(nodes: int | tuple[int, int] | None) -> int | None:
    """The fewest nodes a job with this ``nodes`` value runs on: N, or an elastic job's min."""
    return nodes[0] if isinstance(nodes, tuple) else nodes


def _check_shape(gpus: int | None, nodes: int | tuple[int, int] | None) -> None:
    if gpus is not None and nodes is not None and gpus % max_nodes(nodes):  # type: ignore[operator]
        most = max_nodes(nodes)
        raise SGPUConfigError(
            "gpus", gpus, f"a multiple of nodes={most} (each node runs the same number of ranks"
            + (f"; an elastic job's gpus are its ranks on max={most} nodes)" if isinstance(nodes, tuple) else ")")
        )


class SpecLayer(BaseModel):
    """The settings one source gave (a call, a task, a runner, the environment): nothing more."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field("call", exclude=True)
    gpus: Gpus | None = None
    gpu_type: GpuType = None
    nodes: Nodes = None
    remote: bool | None = None
    timeout: Timeout | None = None
    max_restarts: Restarts | None = None
    env: Env | None = None
    secrets: Secrets | None = None
    mlflow: bool | None = None
    max_recoveries: Recoveries | None = None
    hang_timeout: HangTimeout = None
    straggler_factor: StragglerFactor = None
    straggler_steps: StragglerSteps | None = None
    gang_check: bool | None = None
    environment: EnvironmentField = None
    strategy: Strategy = None
    return_all: bool | None = None
    trusted_results: TrustedResults | None = None
    max_cost_usd: MaxCost = None
    fresh_machines: bool | None = None

    @model_validator(mode="after")
    def _shape(self) -> "SpecLayer":
        _check_shape(self.gpus, self.nodes)
        return self

    def given(self) -> dict[str, Any]:
        """Only the fields this source set, with their validated values."""
        return {name: getattr(self, name) for name in FIELDS if name in self.model_fields_set}


class JobSpec(BaseModel):
    """Resources and options of one job, merged from every layer and validated once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus: Gpus = 1
    gpu_type: GpuType = None
    nodes: Nodes = None
    remote: bool = Field(False, description="Run on remote compute instead of this machine.")
    timeout: Timeout = DEFAULT_TIMEOUT_S
    max_restarts: Restarts = 0
    env: Env = Field(default_factory=dict)
    secrets: Secrets = Field(default_factory=dict)
    mlflow: bool = Field(True, description="Open one MLflow run per call and hand it to every rank.")
    max_recoveries: Recoveries = DEFAULT_MAX_RECOVERIES
    hang_timeout: HangTimeout = DEFAULT_HANG_TIMEOUT_S
    straggler_factor: StragglerFactor = DEFAULT_STRAGGLER_FACTOR
    straggler_steps: StragglerSteps = DEFAULT_STRAGGLER_STEPS
    gang_check: bool = Field(True, description=(
        "Before the function, every rank of a torch elastic job joins a short check (known collective "
        "results, each node link's bandwidth, GPU health); a failing node is named in seconds. "
        "False skips it."))
    environment: EnvironmentField = None
    strategy: Strategy = Field(None, description="Training strategy handed to ranks as SGPU_STRATEGY.")
    return_all: bool = Field(False, description="A GPU task returns every rank's value, not rank 0's.")
    trusted_results: TrustedResults = Field(False, description=(
        "Load every rank's return value and exception with plain pickle (any class, any code its "
        "__reduce__ names). False (the default) loads only plain data: builtins, containers, numbers, "
        "datetime, numpy arrays, torch tensors, prefect_sgpu's errors. See docs/security.md."))
    max_cost_usd: MaxCost = None
    fresh_machines: bool = Field(False, description=(
        "Run on machines launched for this job alone and ended after it, even where the compute keeps "
        "machines warm (keep_warm): the jobs one warm lease serves are one principal, and a job that "
        "must not share its machines with another job's code asks for fresh ones. See docs/security.md."))

    @model_validator(mode="after")
    def _shape(self) -> "JobSpec":
        _check_shape(self.gpus, self.nodes)
        return self

    @property
    def min_nodes(self) -> int | None:
        """The fewest nodes the job runs on (``nodes``, or an elastic job's min); None: derived."""
        return min_nodes(self.nodes)

    @property
    def max_nodes(self) -> int | None:
        """The most nodes the job runs on (``nodes``, or an elastic job's max); None: derived."""
        return max_nodes(self.nodes)

    @property
    def elastic(self) -> bool:
        """``nodes=(min, max)`` with min < max: the job starts on min nodes and grows to max."""
        return isinstance(self.nodes, tuple)

    def rank_env(self) -> dict[str, str]:
        """What every rank gets from the spec itself."""
        return {**self.env, **({"SGPU_STRATEGY": self.strategy} if self.strategy else {}),
                **({"SGPU_GANG_CHECK": "1"} if self.gang_check else {})}

    def replace(self, **changes: Any) -> "JobSpec":
        """A validated copy with ``changes`` applied."""
        return merge(layer("call", **changes), layer("base", **{name: getattr(self, name) for name in FIELDS}))


#: what a field allows, in words, where pydantic's message alone would not say it
_ALLOWED = {
    "straggler_factor": "a number greater than 1 (a rank slower than the median rate divided by it is a "
                        "straggler), or None to turn straggler naming off",
    "straggler_steps": "a whole number of at least 1 (the steps a rank stays that slow before it is named)",
    "max_cost_usd": "a positive, finite number of US dollars (the most the job's machines may cost), or None "
                    "for no cap",
}


def _config_error(exc: ValidationError) -> SGPUConfigError:
    err = exc.errors()[0]
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, SGPUConfigError):
        return cause
    field = ".".join(str(p) for p in err.get("loc", ())) or "spec"
    allowed = err.get("msg", "invalid value")
    if field == "strategy":
        allowed = "one of " + ", ".join(STRATEGIES) + " or None"
    elif field in _ALLOWED:
        allowed = f"{_ALLOWED[field]} ({allowed})"
    return SGPUConfigError(field, err.get("input"), allowed)


def layer(source: str, **given: Any) -> SpecLayer:
    """One source's settings: only the keywords passed count as given. Raises SGPUConfigError."""
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise SGPUConfigError(unknown[0], given[unknown[0]], "one of " + ", ".join(FIELDS))
    try:
        return SpecLayer(source=source, **given)
    except ValidationError as exc:
        raise _config_error(exc) from None


def environment_layer(environ: Mapping[str, str] | None = None) -> SpecLayer:
    """``PREFECT_SGPU_GPUS=8``, ``PREFECT_SGPU_GPU_TYPE=H100``, ``PREFECT_SGPU_ENV='{"A": "1"}'``, ..."""
    environ = os.environ if environ is None else environ
    given: dict[str, Any] = {}
    for name in FIELDS:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is None or raw == "":
            continue
        if name == "environment":
            given[name] = _environment_from(raw)
        elif name in ("env", "secrets"):
            try:
                given[name] = json.loads(raw)
            except ValueError:
                raise SGPUConfigError(ENV_PREFIX + name.upper(), raw, "a JSON object of strings") from None
        elif name in ("gpu_type", "strategy"):
            given[name] = None if raw.lower() == "none" else raw
        elif name in ("hang_timeout", "straggler_factor", "max_cost_usd") and raw.lower() in ("none", "off"):
            given[name] = None
        elif name == "nodes" and raw.lower() in ("none", "auto"):
            given[name] = None
        else:
            given[name] = raw
    try:
        return layer("environment", **given)
    except SGPUConfigError as exc:
        raise SGPUConfigError(ENV_PREFIX + exc.field.upper(), exc.value, exc.allowed) from None


def _environment_from(raw: str) -> Any:
    """``PREFECT_SGPU_ENVIRONMENT``: ``driver``, ``image``, a JSON object of options, or a .json/.toml file."""
    try:
        return environment_mod.parse_option(raw, environment_mod.ENVIRONMENT_ENV)
    except SGPUConfigError as exc:
        if exc.field.startswith(environment_mod.ENVIRONMENT_ENV):
            raise
        raise SGPUConfigError(exc.field, exc.value, exc.allowed,
                              f"(set by {environment_mod.ENVIRONMENT_ENV}) {exc.hint or ''}".strip()) from None


def merge(*layers: SpecLayer | None) -> JobSpec:
    """The job spec: for each field, the first layer (highest first) that gave it, else the default."""
    values: dict[str, Any] = {}
    for item in layers:
        if item is None:
            continue
        for name, value in item.given().items():
            values.setdefault(name, value)
    try:
        return JobSpec(**values)
    except ValidationError as exc:
        raise _config_error(exc) from None


def build(*layers: SpecLayer | None, environ: Mapping[str, str] | None = None) -> JobSpec:
    """``merge`` with the environment layer below the given ones."""
    return merge(*layers, environment_layer(environ))


def compute_layer(compute: Any) -> SpecLayer | None:
    """What a compute block gave (``EC2Compute(environment=...)``), at the runner / work-pool level:
    below the call, task and runner, above ``PREFECT_SGPU_ENVIRONMENT``. (``compute`` is a
    :class:`~prefect_sgpu.compute.base.Compute`, typed loosely: computes import this module, not the reverse.)"""
    option = compute.sgpu_environment
    return None if option is None else layer("compute block", environment=option)


def for_compute(compute: Any, *layers: SpecLayer | None, environ: Mapping[str, str] | None = None,
                script: str | None = None) -> JobSpec:
    """The spec of a job on ``compute``: ``layers`` (highest first) over the compute block's, the
    environment variables and the built-in defaults; for remote nodes its environment captured now
    (the driver's own unless one was given), so a folder over its size limit fails here, before
    anything is spent. Local nodes run in the driver's own environment: nothing is captured."""
    spec = build(*layers, compute_layer(compute), environ=environ)
    captured = environment_mod.for_compute(spec.environment, compute.remote, script)
    if captured is None or captured is spec.environment:
        return spec
    return spec.replace(environment=captured)


@dataclass(frozen=True)
class Plan:
    """The resolved shape of a job: nodes x procs_per_node ranks on one device kind.

    ``nodes`` is what the compute allocates, the most the job runs on; an elastic job
    (``min_nodes < nodes``) starts once ``min_nodes`` of them are up and grows as the rest join."""

    nodes: int
    procs_per_node: int
    device: str  # "cuda" or "cpu"
    instance_type: catalog.InstanceType | None = None
    #: the fewest nodes the job runs on; None: ``nodes`` (a fixed gang)
    min_nodes: int | None = None

    def __post_init__(self) -> None:
        if self.min_nodes is None:
            object.__setattr__(self, "min_nodes", self.nodes)

    @property
    def max_nodes(self) -> int:
        return self.nodes

    @property
    def elastic(self) -> bool:
        return (self.min_nodes or self.nodes) < self.nodes

    @property
    def world_size(self) -> int:
        """Ranks on every node the job may run on (an elastic job's world at max)."""
        return self.nodes * self.procs_per_node


def require_fixed_nodes(spec: JobSpec, compute: str) -> None:
    """Refuse ``nodes=(min, max)`` on a compute that cannot run an elastic job yet."""
    if spec.elastic:
        raise SGPUConfigError("nodes", spec.nodes, f"a whole number of nodes on {compute}: elastic jobs "
                              "(nodes=(min, max)) run on the local and EC2 computes only for now")


def plan_remote(spec: JobSpec, instance_type: str | None = None) -> Plan:
    """Whole instances of one type: the catalog's for ``gpu_type``, or ``instance_type`` when given. An
    elastic job's (``nodes=(min, max)``) are its max, ``min_nodes`` its min."""
    fewest = spec.min_nodes if spec.elastic else None
    if spec.gpu_type is None:
        raise SGPUConfigError(
            "gpu_type", None, "remote=True needs a gpu_type: one of " + ", ".join(catalog.known_gpu_types())
        )
    if instance_type:
        itype = catalog.instance_type_by_name(instance_type)
        if itype is not None:
            if spec.gpus % itype.gpus:
                raise SGPUConfigError("gpus", spec.gpus, f"a multiple of {itype.gpus} (GPUs of one {itype.name})")
            nodes = spec.gpus // itype.gpus
            if spec.nodes is not None and spec.max_nodes != nodes:
                raise SGPUConfigError("nodes", spec.nodes, f"{nodes} ({spec.gpus} GPUs on {itype.name})"
                                      + (" at max" if spec.elastic else ""))
            return Plan(nodes=nodes, procs_per_node=itype.gpus, device="cuda", instance_type=itype, min_nodes=fewest)
    nodes, itype = catalog.plan_nodes(spec.gpu_type, spec.gpus, spec.max_nodes)
    return Plan(nodes=nodes, procs_per_node=itype.gpus, device="cuda", instance_type=itype, min_nodes=fewest)


def plan_local(spec: JobSpec, local_gpus: int) -> Plan:
    """Simulated nodes on this machine: one rank per GPU, or CPU ranks when it has none."""
    nodes = spec.max_nodes or 1
    fewest = spec.min_nodes or 1
    _check_shape(spec.gpus, nodes)
    if local_gpus == 0:
        return Plan(nodes=nodes, procs_per_node=spec.gpus // nodes, device="cpu", min_nodes=fewest)
    if spec.gpus > local_gpus:
        raise SGPUConfigError(
            "gpus",
            spec.gpus,
            f"at most {local_gpus} on this machine (it has {local_gpus} GPU(s)); "
            "use remote=True or set PREFECT_SGPU_DEVICE=cpu to run CPU ranks",
        )
    return Plan(nodes=nodes, procs_per_node=spec.gpus // nodes, device="cuda", min_nodes=fewest)
