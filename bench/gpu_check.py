"""The GPU path of the local compute, end to end, on a machine with one or more NVIDIA GPUs.

Each check is one ``.distributed()`` call on the local compute (``mlflow=False``), one rank
per GPU, NCCL as the backend (``runtime.init_process_group`` picks it when the rank has a
GPU): DDP and FSDP2 through ``pipeline.strategies.wrap`` train a small MLP for a few steps
on a fixed batch, and an ``all_reduce`` checks the group. It prints one line per check and
exits non-zero when a check fails (a loss that does not fall, a wrong sum, a CPU device).

    PREFECT_SGPU_DEVICE=cuda python bench/gpu_check.py [--gpus N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def train(strategy: str, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from prefect_sgpu import runtime
    from prefect_sgpu.pipeline.strategies import wrap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    wrapped = wrap(model, lambda params: torch.optim.AdamW(params, lr=1e-2), strategy)
    device = runtime.device()
    x = torch.randn(128, 64, device=device)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for _ in range(steps):
        wrapped.zero_grad()
        with wrapped.autocast():
            loss = nn.functional.mse_loss(wrapped.model(x).float(), y)
        wrapped.backward(loss)
        wrapped.step()
        losses.append(float(loss.detach()))
    total = torch.ones(1, device=device) * (runtime.rank() + 1)
    dist.all_reduce(total)
    return {"rank": runtime.rank(), "device": str(device), "backend": dist.get_backend(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "first": losses[0], "last": losses[-1], "sum": float(total.item())}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=None, help="ranks (default: every visible GPU)")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    import torch

    from prefect_sgpu import distributed

    gpus = args.gpus or torch.cuda.device_count()
    if gpus < 1 and os.environ.get("PREFECT_SGPU_DEVICE") != "cpu":
        print("no GPU visible: this check needs one", file=sys.stderr)
        return 2
    failed = False
    for strategy in ("ddp", "fsdp"):
        started = time.perf_counter()
        results = distributed(gpus=gpus, mlflow=False)(train).distributed(strategy, args.steps)
        seconds = time.perf_counter() - started
        want_sum = gpus * (gpus + 1) / 2
        ok = (all(r["device"].startswith("cuda") and r["backend"] == "nccl" for r in results)
              and all(r["last"] < r["first"] / 2 for r in results)
              and all(r["sum"] == want_sum for r in results))
        failed |= not ok
        print(json.dumps({"check": strategy, "ok": ok, "seconds": round(seconds, 2), "ranks": results}))
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SGPU_DEVICE", "cuda")
    sys.exit(main())
