"""A small training job that checkpoints and resumes: what recovery tests and benchmarks run.

60 steps of a tiny two-block model through ``wrap`` (DDP, FSDP2 or DeepSpeed), a
``Checkpointer`` every 10 steps (and at once on a reclaim notice), resumed from the
newest complete checkpoint. Each rank returns where it started, how many steps it ran,
the optimizer's step count, the weights it restored and ended with (digests) and the
instance it ran on.
"""

from __future__ import annotations

import time
from typing import Any

STEPS = 60
EVERY = 10


def train_with_checkpoints(step_s: float = 0.25, strategy: str = "ddp", stop_at: int = STEPS) -> dict[str, Any]:
    """A 60-step loop that checkpoints every 10 steps (and at once on a reclaim notice) and resumes."""
    import hashlib
    import socket

    import torch
    from torch import nn

    from prefect_sgpu import runtime
    from prefect_sgpu.pipeline.checkpoint import Checkpointer
    from prefect_sgpu.pipeline.strategies import wrap

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = torch.tanh(block(x))
            return self.head(x)

    torch.manual_seed(0)
    w = wrap(Tiny(), lambda params: torch.optim.AdamW(params, lr=0.01), strategy, micro_batch_size=8)
    ckpt = Checkpointer(w, every=EVERY, keep=2)
    start, _extra = ckpt.restore()

    def weights() -> str | None:
        state = w.full_state_dict()  # collective; rank 0 gets the whole model
        if state is None:
            return None
        return hashlib.sha256(b"".join(state[k].float().numpy().tobytes() for k in sorted(state))).hexdigest()

    restored = weights()
    print(f"starting at step {start} on {socket.gethostname()}", flush=True)
    ran = 0
    for step in range(start, stop_at):
        x = torch.randn(8, 8)
        loss = nn.functional.mse_loss(w.model(x), x.sum(dim=1, keepdim=True))
        w.zero_grad()
        w.backward(loss)
        w.step()
        ran += 1
        print(f"step {step + 1}", flush=True)
        time.sleep(step_s)
        if ckpt.due(step + 1):
            ckpt.save(step + 1)
    opt_state = w.optimizer.state_dict()["state"]
    steps = None
    if opt_state:  # FSDP2 keeps DTensors; the step count is a plain tensor either way
        first = opt_state[min(opt_state)]["step"]
        steps = int(first.full_tensor().item() if hasattr(first, "full_tensor") else first.item())
    return {"start": start, "ran": ran, "optimizer_steps": steps, "restored": restored, "final": weights(),
            "host": socket.gethostname(), "instance": runtime.instance_id()}


def all_reduce_for_a_minute() -> int:
    """Ranks in lockstep for about a minute (an all-reduce every 0.1 s): a job whose ranks all die together
    when any one of them goes."""
    import torch
    import torch.distributed as dist

    from prefect_sgpu import runtime

    runtime.init_process_group()
    t = torch.ones(1)
    for _ in range(600):
        dist.all_reduce(t)
        time.sleep(0.1)
    return runtime.rank()
