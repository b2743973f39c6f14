"""An elastic job that keeps its training recipe when nodes come and go (docs/elastic.md).

The job asks for ``nodes=(1, 2)``: it starts once one node is up and grows when the second joins.
Each time the world changes, torch elastic restarts the ranks and this function runs again from
its start, so everything that depends on the world size is decided here, from the world it is in:

- ``keep_global_batch=True`` (the default): the global batch stays ``GLOBAL_BATCH`` samples, made of
  ``per_rank`` samples on every rank times ``accumulation`` micro-steps (``batch_plan``), so the
  learning rate stays as it is: each step averages the gradient over the same samples at any world size;
- ``keep_global_batch=False``: every rank keeps ``MAX_PER_RANK`` samples, the global batch follows the
  world and the learning rate is scaled linearly with it (``scaled_lr``), ramped from the previous
  world's rate over ``WARMUP_STEPS`` steps after a change, so a larger world does not jump to a large
  rate with the optimizer's moments of a smaller batch.

The ``Checkpointer`` restores the newest checkpoint whatever world wrote it (DDP: rank 0's copy;
FSDP2: resharded), and every rank gets rank 0's ``extra``: the global step and samples seen, which
is all the loop needs, since each step's samples are picked by the global step and the rank.

    python examples/elastic_rescale.py --steps 12
"""

from __future__ import annotations

import argparse
from typing import Any

from prefect import flow, get_run_logger

from prefect_sgpu import distributed, runtime

#: samples in one optimizer step, whatever the world size (keep_global_batch=True)
GLOBAL_BATCH = 24
#: the most samples one rank's memory holds in one forward pass
MAX_PER_RANK = 8
#: the learning rate the recipe was tuned with, at BASE_WORLD ranks
BASE_LR = 0.05
BASE_WORLD = 2
#: steps over which the rate moves to its new value after a world change (keep_global_batch=False)
WARMUP_STEPS = 4


def recipe(world: int, previous: int | None, steps_since_change: int, keep_global_batch: bool) -> dict[str, Any]:
    """Per-rank batch, accumulation steps and learning rate for a world of ``world`` ranks."""
    from prefect_sgpu.pipeline.world_change import batch_plan, scaled_lr

    if keep_global_batch:
        plan = batch_plan(GLOBAL_BATCH, world, MAX_PER_RANK)
        return {"per_rank": plan.per_rank, "accumulation": plan.accumulation, "global_batch": GLOBAL_BATCH,
                "lr": BASE_LR}
    target = scaled_lr(BASE_LR, BASE_WORLD, world, "linear")
    start = scaled_lr(BASE_LR, BASE_WORLD, previous, "linear") if previous else target
    ramp = min(1.0, (steps_since_change + 1) / WARMUP_STEPS)
    return {"per_rank": MAX_PER_RANK, "accumulation": 1, "global_batch": MAX_PER_RANK * world,
            "lr": start + (target - start) * ramp}


def _samples(step: int, rank: int, micro: int, per_rank: int, accumulation: int, world: int) -> Any:
    """The samples of one rank's micro-step: step ``step``'s global batch, split by rank and micro-step,
    so the same step trains on the same samples at any world size (keep_global_batch=True)."""
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(per_rank * accumulation * world, 6, generator=gen)
    first = (rank * accumulation + micro) * per_rank
    x = x[first:first + per_rank]
    return x, x.sum(dim=1, keepdim=True)


@distributed(gpus=2, nodes=(1, 2), mlflow=False)
def train(folder: str | None = None, steps: int = 12, keep_global_batch: bool = True) -> dict[str, Any]:
    """Every rank: restore, rescale for this world, train to ``steps``; returns what it used."""
    import torch
    from torch import nn

    from prefect_sgpu.pipeline.checkpoint import Checkpointer
    from prefect_sgpu.pipeline.strategies import wrap

    torch.manual_seed(0)
    w = wrap(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)),
             lambda params: torch.optim.SGD(params, lr=BASE_LR), strategy="ddp", max_grad_norm=None)
    ckpt = Checkpointer(w, folder, every=2)
    start, extra = ckpt.restore()
    world = runtime.world_size()
    # the world this one follows: the previous round's (an elastic restart), else the checkpoint's writer's
    previous = runtime.previous_world_size() or (ckpt.restored.saved if ckpt.restored is not None else None)
    changed = runtime.world_size_changed() or (ckpt.restored is not None and ckpt.restored.changed)
    changed_at = start if changed else int(extra.get("changed_at", 0))
    losses: list[float] = []
    for step in range(start, steps):
        r = recipe(world, previous, step - changed_at, keep_global_batch)
        for group in w.optimizer.param_groups:
            group["lr"] = r["lr"]
        w.zero_grad()
        for micro in range(r["accumulation"]):
            x, y = _samples(step, runtime.rank(), micro, r["per_rank"], r["accumulation"], world)
            loss = nn.functional.mse_loss(w.model(x), y) / r["accumulation"]
            w.backward(loss)  # DDP averages over ranks; dividing by accumulation averages over micro-steps
            losses.append(loss.item() * r["accumulation"])
        w.step()
        samples = extra.get("samples", 0) + r["global_batch"] * (step + 1 - start)
        ckpt.maybe_save(step + 1, {"samples": samples, "world": world, "changed_at": changed_at})
    ckpt.wait()
    return {"rank": runtime.rank(), "world": world, "previous": previous, "start": start,
            "recipe": recipe(world, previous, max(0, steps - 1 - changed_at), keep_global_batch),
            "losses": losses, "weights": w.full_state_dict()}


@flow(name="elastic-rescale")
def elastic_rescale(steps: int = 12, keep_global_batch: bool = True) -> dict[str, Any]:
    """Run the elastic job; log the world it ended in and the recipe it used there."""
    values = train.distributed(steps=steps, keep_global_batch=keep_global_batch)
    first = values[0]
    get_run_logger().info("ended with %d ranks (previous world %s): %s", first["world"], first["previous"],
                          first["recipe"])
    return {k: first[k] for k in ("world", "previous", "start", "recipe")}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--scale-lr", action="store_true", help="let the global batch follow the world")
    options = parser.parse_args()
    print(elastic_rescale(steps=options.steps, keep_global_batch=not options.scale_lr))
