"""A checkpoint restored in a world of another size, and what a loop rescales when the world changes.

An elastic job (``nodes=(min, max)``) restarts its ranks in a larger or smaller world; the
:class:`~prefect_sgpu.pipeline.checkpoint.Checkpointer` then restores a checkpoint written by a
different number of ranks. What carries over depends on how the state was split:

- FSDP2: the model and optimizer were saved with ``torch.distributed.checkpoint`` (DCP), whose
  metadata records every shard's offsets; loading into the new world's DTensors reshards them
  (each rank reads the pieces of its new shard from whichever files hold them).
- DDP: every replica held the whole state; rank 0's copy (``model.pt``) loads on every rank.
- DeepSpeed: ZeRO stage 0 keeps the optimizer whole in the model-states file, so it loads as DDP's
  does. Stages 1-3 partition optimizer state (and stage 3 the parameters) per rank into files
  numbered by data-parallel rank; DeepSpeed's ``load_checkpoint`` reads them only at the world size
  that wrote them (its ZeRO ``elastic_checkpoint`` option is deprecated and refused for stage 3).
  Such a restore is refused, naming both world sizes, unless the engine was built to load a
  *universal* checkpoint (DeepSpeed's ``ds_to_universal`` conversion, ``"checkpoint":
  {"load_universal": true}``; DeepSpeed docs, "Universal Checkpointing"), which is then DeepSpeed's
  own to read.

Per-rank state cannot follow the ranks into another world: rank ``r``'s data-loader position
belongs to a partition of the data that no longer exists, and its RNG stream to a rank that may
not. So when the world size changed, every rank gets rank 0's ``extra`` (keep global counters there:
step, samples seen, epoch), :meth:`Checkpointer.saved_extras` gives every saved rank's ``extra`` for
code that merges per-rank state itself, and each rank's generators (Python, NumPy, torch, CUDA)
are seeded from the checkpoint's step and the new rank (:func:`reseed`): distinct streams per rank,
the same streams when the same world resumes the same step again.

:func:`batch_plan` and :func:`scaled_lr` are the two usual answers to "what about batch size and
learning rate" (docs/elastic.md): keep the global batch (per-rank batch and gradient accumulation
follow the world), or let it follow the world and scale the learning rate with it.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Any

from prefect_sgpu.errors import SGPUConfigError

__all__ = ["BatchPlan", "WorldChange", "batch_plan", "check_restorable", "reseed", "scaled_lr"]

#: learning-rate rules :func:`scaled_lr` knows
LR_RULES = ("linear", "sqrt", "none")


@dataclass(frozen=True)
class WorldChange:
    """The world a restored checkpoint was written by (``saved``) and the one restoring it (``now``)."""

    step: int
    saved: int | None
    now: int

    @property
    def changed(self) -> bool:
        """True when the checkpoint was written by another number of ranks (unknown counts as the same)."""
        return self.saved is not None and self.saved != self.now


def saved_world_size(info: dict[str, Any]) -> int | None:
    """The world size a checkpoint's sealed marker names (None for a marker that names none)."""
    value = info.get("world_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def check_restorable(strategy: str, change: WorldChange, *, zero_stage: int = 0, universal: bool = False) -> None:
    """Refuse a restore that the strategy cannot do across world sizes, naming both sizes and what works.

    FSDP2 (DCP reshards) and DDP (replicated) restore at any world size; DeepSpeed only at stage 0,
    or with a universal checkpoint (``universal``), or at the world size that wrote it."""
    if not change.changed or strategy != "deepspeed" or zero_stage == 0 or universal:
        return
    raise SGPUConfigError(
        "world_size", change.now,
        f"{change.saved}, the world size that wrote the DeepSpeed ZeRO stage {zero_stage} checkpoint of step "
        f"{change.step}: ZeRO stages 1-3 partition optimizer state per rank, and DeepSpeed reads those files only "
        "at the world size that wrote them",
        f"To restore it with {change.now} ranks, convert it with DeepSpeed's ds_to_universal and build the engine "
        "with \"checkpoint\": {\"load_universal\": true}; or run at world size "
        f"{change.saved} (nodes=(n, n)); or use strategy 'fsdp' (resharded) or ZeRO stage 0 (replicated)")


def reseed(step: int, rank: int) -> int:
    """Seed this rank's Python, NumPy, torch (and CUDA) generators from ``(step, rank)``; returns the seed.

    Used when a checkpoint is restored by a world of another size, whose ranks have no saved streams
    of their own: distinct per rank, the same again when the same world resumes the same step."""
    import torch

    seed = int.from_bytes(hashlib.sha256(f"prefect-sgpu/{step}/{rank}".encode()).digest()[:4], "big")
    random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device as well
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    return seed


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch is made in a world: ``per_rank`` samples a micro-step, ``accumulation``
    micro-steps an optimizer step; ``global_batch`` = per_rank x accumulation x world."""

    global_batch: int
    world_size: int
    per_rank: int
    accumulation: int


def _whole(field: str, value: Any, allowed: str = "a whole number >= 1") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SGPUConfigError(field, value, allowed)
    return value


def batch_plan(global_batch: int, world_size: int, max_per_rank: int) -> BatchPlan:
    """Keep ``global_batch`` in a world of ``world_size`` ranks: the fewest accumulation steps that keep
    each rank's micro-batch at most ``max_per_rank`` (what fits its memory).

    The global batch must split evenly: ``global_batch`` a multiple of ``world_size``, and the per-rank
    share a multiple of the accumulation steps; otherwise an ``SGPUConfigError`` names the values."""
    _whole("global_batch", global_batch)
    _whole("world_size", world_size)
    _whole("max_per_rank", max_per_rank)
    if global_batch % world_size:
        raise SGPUConfigError("global_batch", global_batch,
                              f"a multiple of the world size {world_size} (each rank gets the same share)",
                              "choose a global batch every world size of the job divides, e.g. a multiple of "
                              "the least common multiple of min..max ranks")
    share = global_batch // world_size
    for accumulation in range(math.ceil(share / max_per_rank), share + 1):
        if share % accumulation == 0:
            return BatchPlan(global_batch, world_size, share // accumulation, accumulation)
    raise AssertionError("unreachable: accumulation == share always divides")  # pragma: no cover


def scaled_lr(base_lr: float, base_world_size: int, world_size: int, rule: str = "linear") -> float:
    """The learning rate for a global batch that grew or shrank with the world: ``linear`` (Goyal et al.,
    "Accurate, Large Minibatch SGD", for SGD), ``sqrt`` (often used with Adam), or ``none`` (the global
    batch was kept, see :func:`batch_plan`)."""
    if rule not in LR_RULES:
        raise SGPUConfigError("rule", rule, "one of " + ", ".join(LR_RULES))
    if isinstance(base_lr, bool) or not isinstance(base_lr, (int, float)) or not base_lr > 0:
        raise SGPUConfigError("base_lr", base_lr, "a positive number")
    _whole("base_world_size", base_world_size)
    _whole("world_size", world_size)
    ratio = world_size / base_world_size
    return float(base_lr) * (ratio if rule == "linear" else math.sqrt(ratio) if rule == "sqrt" else 1.0)
