"""Wrap a model and its optimizer for DDP, FSDP2 or DeepSpeed ZeRO, inside a rank.

A training loop should not change with the parallelism strategy. :func:`wrap` returns a
:class:`Wrapped` whose ``model`` is called for the forward pass and whose
``backward(loss)``, ``step()`` and ``zero_grad()`` do the right thing for each strategy
(DeepSpeed's engine owns backward and step; DDP and FSDP2 use plain autograd and the
optimizer). The strategy defaults to ``SGPU_STRATEGY``, which ``gpu_task(strategy=...)``
sets for every rank, so one training function serves all three.

Precision follows the device: bf16 on GPUs (autocast for DDP, a mixed-precision policy
for FSDP2, DeepSpeed's ``bf16`` section), fp32 on the CPU, where bf16 is slow and gloo
reduces fp32 anyway.

The optimizer is passed as a factory because FSDP2 replaces parameters with sharded
DTensors: an optimizer built before ``fully_shard`` would hold the wrong tensors.
DeepSpeed receives the plain torch optimizer, which avoids compiling DeepSpeed's own
optimizer ops.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from prefect_sgpu import runtime
from prefect_sgpu.errors import SGPUConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

STRATEGIES = ("ddp", "fsdp", "deepspeed")
STRATEGY_ENV = "SGPU_STRATEGY"
DEFAULT_STRATEGY = "ddp"

OptimizerFactory = Callable[[Iterable["nn.Parameter"]], "torch.optim.Optimizer"]


def resolve_strategy(strategy: str | None = None) -> str:
    """The strategy to use: the argument, else ``SGPU_STRATEGY``, else DDP."""
    value = strategy or os.environ.get(STRATEGY_ENV) or DEFAULT_STRATEGY
    if value not in STRATEGIES:
        raise SGPUConfigError("strategy", value, "one of " + ", ".join(STRATEGIES))
    return value


def compute_dtype() -> "torch.dtype":
    """bf16 on GPUs, fp32 on the CPU."""
    import torch

    return torch.bfloat16 if runtime.uses_gpu() else torch.float32


@dataclass
class Wrapped:
    """A model and optimizer prepared for one strategy; the loop calls the same methods for all.

    ``model`` is what the loop calls (the DDP wrapper, the FSDP2 module, the DeepSpeed
    engine); ``module`` is the user's own module underneath (for saving and evaluation).
    ``engine`` is the DeepSpeed engine, or None.
    """

    strategy: str
    model: Any
    module: "nn.Module"
    optimizer: "torch.optim.Optimizer"
    device: "torch.device"
    dtype: "torch.dtype"
    engine: Any = None
    zero_stage: int = 0
    max_grad_norm: float | None = None
    _autocast: bool = field(default=False, repr=False)

    @property
    def shards_state(self) -> bool:
        """True when each rank holds only part of the training state (FSDP2, ZeRO)."""
        return self.strategy in ("fsdp", "deepspeed")

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Wrap the forward pass: bf16 autocast for DDP on GPUs, a no-op otherwise."""
        if not self._autocast:
            return contextlib.nullcontext()
        import torch

        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: "torch.Tensor") -> None:
        if self.engine is not None:
            self.engine.backward(loss)
        else:
            loss.backward()

    def step(self) -> None:
        """Clip gradients to ``max_grad_norm`` (DeepSpeed: its ``gradient_clipping``), then step."""
        if self.engine is not None:
            self.engine.step()
            return
        if self.max_grad_norm is not None:
            import torch

            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)
        self.optimizer.step()

    def zero_grad(self) -> None:
        if self.engine is not None:
            self.engine.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def full_state_dict(self) -> dict[str, "torch.Tensor"] | None:
        """The whole model's weights on the CPU, on rank 0 (None on other ranks).

        Collective for FSDP2 and ZeRO-3: every rank must call it.
        """
        import torch

        if self.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True,
                                                                               cpu_offload=True))
        elif self.strategy == "deepspeed" and self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
                state = {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}
        else:
            state = {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}
        if not runtime.is_rank_zero():
            return None
        return {k: v.float() if torch.is_floating_point(v) else v for k, v in state.items()}


def wrap(
    model: "nn.Module",
    make_optimizer: OptimizerFactory,
    strategy: str | None = None,
    *,
    micro_batch_size: int = 1,
    max_grad_norm: float | None = 1.0,
    zero_stage: int = 2,
    deepspeed_config: dict[str, Any] | None = None,
    shard_modules: Callable[["nn.Module"], Iterable["nn.Module"]] | None = None,
) -> Wrapped:
    """Move ``model`` to this rank's device and wrap it (and a new optimizer) for ``strategy``.

    Joins the process group first if needed. Gradients are clipped to ``max_grad_norm``
    (None: no clipping) the same way for every strategy. ``zero_stage`` and
    ``micro_batch_size`` fill the default DeepSpeed config; ``deepspeed_config`` replaces it (``bf16`` is added on
    GPUs unless the config has ``bf16`` or ``fp16``). ``shard_modules`` picks the
    submodules FSDP2 shards on their own before the root (default: every element of every
    ``nn.ModuleList``, i.e. the transformer blocks).
    """
    name = resolve_strategy(strategy)
    if name == "deepspeed" and zero_stage not in (0, 1, 2, 3):
        raise SGPUConfigError("zero_stage", zero_stage, "0, 1, 2 or 3")
    if micro_batch_size < 1:
        raise SGPUConfigError("micro_batch_size", micro_batch_size, "an integer >= 1")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise SGPUConfigError("max_grad_norm", max_grad_norm, "a positive number, or None for no clipping")
    runtime.init_process_group()
    device = runtime.device()
    if device.type == "cpu":
        share_cpu_cores()
    dtype = compute_dtype()
    model = model.to(device)
    if name == "ddp":
        wrapped = _wrap_ddp(model, make_optimizer, device, dtype)
    elif name == "fsdp":
        wrapped = _wrap_fsdp(model, make_optimizer, device, dtype, shard_modules or _repeated_blocks)
    else:
        config = deepspeed_config or default_deepspeed_config(micro_batch_size, zero_stage, max_grad_norm)
        return _wrap_deepspeed(model, make_optimizer, device, dtype, config)
    wrapped.max_grad_norm = max_grad_norm
    return wrapped


def share_cpu_cores() -> int:
    """Give each CPU rank its share of the node's cores, unless OMP_NUM_THREADS says otherwise.

    Every rank's torch otherwise starts one intra-op thread per core: with several ranks
    per node the threads fight over the cores, and a step measured 15-20x slower.
    """
    import torch

    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, runtime.local_world_size())))
    return int(torch.get_num_threads())


def default_deepspeed_config(micro_batch_size: int, zero_stage: int = 2,
                             max_grad_norm: float | None = 1.0) -> dict[str, Any]:
    """A small ZeRO config: one micro-batch per step, gradient clipping, no offload."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": max_grad_norm or 0.0,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,  # the caller's plain torch optimizer
        "steps_per_print": 10**9,  # the flow logs its own metrics
        "wall_clock_breakdown": False,
    }


def _wrap_ddp(model: "nn.Module", make_optimizer: OptimizerFactory, device: "torch.device",
              dtype: "torch.dtype") -> Wrapped:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return Wrapped("ddp", ddp, model, make_optimizer(ddp.parameters()), device, dtype,
                   _autocast=device.type == "cuda")


def _repeated_blocks(model: "nn.Module") -> Iterator["nn.Module"]:
    from torch import nn

    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            yield from module


def _wrap_fsdp(model: "nn.Module", make_optimizer: OptimizerFactory, device: "torch.device",
               dtype: "torch.dtype", shard_modules: Callable[["nn.Module"], Iterable["nn.Module"]]) -> Wrapped:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (runtime.world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in list(shard_modules(model)):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return Wrapped("fsdp", model, model, make_optimizer(model.parameters()), device, dtype)


def _wrap_deepspeed(model: "nn.Module", make_optimizer: OptimizerFactory, device: "torch.device",
                    dtype: "torch.dtype", config: dict[str, Any]) -> Wrapped:
    import torch

    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
    import deepspeed

    config = dict(config)
    if dtype == torch.bfloat16 and "bf16" not in config and "fp16" not in config:
        config["bf16"] = {"enabled": True}
    optimizer = make_optimizer(model.parameters())
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                       dist_init_required=False)
    stage = int(config.get("zero_optimization", {}).get("stage", 0))
    return Wrapped("deepspeed", engine, engine.module, ds_optimizer, device, dtype, engine=engine,
                   zero_stage=stage)
