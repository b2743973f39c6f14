"""SimpleMLP with DDP: Databricks' serverless GPU quick-start, on prefect-sgpu.

A 5000 x 10 regression set, a small MLP, Adam and MSE, a DistributedSampler so each
rank sees its share, the loss logged to MLflow from rank 0, and a checkpoint every
epoch so a rerun resumes where training stopped.

Two ways to use it:
- ``train_mlp`` is a plain ``@distributed`` function: ``train_mlp.distributed(num_epochs=3)``.
- ``mlp_ddp`` is a Prefect flow: prepare data (persisted, cached) -> train (a GPU task,
  one multi-node job) -> evaluate. A failed run retried from the UI reuses the data
  and resumes training from the last checkpoint.

CPU (default): 2 nodes x 2 ranks on this machine, gloo.
GPU: ``gpus=8, gpu_type="H100", remote=True`` with an EC2 compute block (a deployment's
``compute_block``), or ``gpus=<GPUs on this box>`` locally; nccl is picked automatically.

    python flows/mlp_ddp.py --epochs 5
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from prefect import flow, get_run_logger, task

from prefect_sgpu import GPUTaskRunner, distributed, gpu_task, runtime


def _data_home() -> Path:
    return Path(os.environ.get("PREFECT_SGPU_HOME", Path.home() / ".prefect-sgpu")) / "data"


@task(persist_result=True)
def prepare_data(rows: int = 5000, features: int = 10, seed: int = 0) -> str:
    """Write the regression set once; a rerun of the same flow run gets this result from cache."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=gen)
    w = torch.randn(features, 1, generator=gen)
    y = x @ w + 0.1 * torch.randn(rows, 1, generator=gen)
    path = _data_home() / f"regression-{rows}x{features}-{seed}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"x": x, "y": y}, tmp)
    tmp.replace(path)
    return str(path)


@distributed(gpus=4, nodes=2)
def train_mlp(num_epochs: int = 5, batch_size: int = 64, lr: float = 1e-3, seed: int = 0,
              data_path: str | None = None, fault_file: str | None = None, fault_epoch: int = -1,
              pace_s: float = 0.0) -> dict:
    """Train on every rank; return the last epoch's mean loss and the epoch training started at.

    Rank 0 writes a checkpoint after every epoch (to ``runtime.checkpoint_dir()``); a new
    attempt starts from the newest one. ``fault_file``/``fault_epoch`` are for failure
    drills: rank 0 raises at ``fault_epoch`` while ``fault_file`` exists. ``pace_s``: seconds every
    rank waits after each epoch (for drills that need a run that stays in training cheaply, e.g.
    cancellation); 0, the default, trains at full speed.
    """
    import time

    import mlflow
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    if not (isinstance(pace_s, (int, float)) and 0 <= pace_s <= 3600):
        raise ValueError(f"pace_s={pace_s!r}: seconds to wait after each epoch, a number from 0 to 3600")
    runtime.init_process_group()
    device = runtime.device()

    class SimpleMLP(nn.Module):
        def __init__(self, d_in: int = 10, hidden: int = 64) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                     nn.ReLU(), nn.Linear(hidden, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    if data_path:
        data = torch.load(data_path, weights_only=True)  # tensors only: a planted pickle never runs
        x, y = data["x"], data["y"]
    else:  # the same data set on every rank
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(5000, 10, generator=gen)
        y = x @ torch.randn(10, 1, generator=gen) + 0.1 * torch.randn(5000, 1, generator=gen)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=runtime.world_size(), rank=runtime.rank(),
                                 shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)

    torch.manual_seed(seed)
    model = SimpleMLP(d_in=x.shape[1]).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=lr)
    loss_fn = nn.MSELoss()

    ckpt = runtime.checkpoint_dir() / "mlp.pt"
    start_epoch = 0
    if ckpt.exists():  # every rank loads the same state, so DDP replicas stay identical
        state = torch.load(ckpt, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
        print(f"resuming from checkpoint after epoch {state['epoch']}")

    if runtime.is_rank_zero() and start_epoch == 0:
        mlflow.log_params({"num_epochs": num_epochs, "batch_size": batch_size, "lr": lr,
                           "world_size": runtime.world_size()})
    mean = float("nan")
    epoch_loss = torch.zeros(2, device=device)
    for epoch in range(start_epoch, num_epochs):
        if runtime.is_rank_zero() and epoch == fault_epoch and fault_file and Path(fault_file).exists():
            raise RuntimeError(f"injected fault at epoch {epoch} ({fault_file} exists)")
        sampler.set_epoch(epoch)
        epoch_loss.zero_()
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            optimizer.zero_grad()
            loss = loss_fn(ddp(xb), yb)
            loss.backward()
            optimizer.step()
            epoch_loss += torch.stack([loss.detach() * len(xb), torch.tensor(float(len(xb)), device=device)])
        dist.all_reduce(epoch_loss)
        mean = (epoch_loss[0] / epoch_loss[1]).item()
        if runtime.is_rank_zero():
            mlflow.log_metric("loss", mean, step=epoch)
            print(f"epoch {epoch}: loss {mean:.4f}")
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, tmp)
            tmp.replace(ckpt)  # a checkpoint is either complete or absent
        if pace_s:
            time.sleep(pace_s)
        dist.barrier()
    return {"loss": mean, "start_epoch": start_epoch}


#: the training step as a Prefect task: one gang-launched job, Prefect retries and states
train = gpu_task(train_mlp.func, gpus=4, nodes=2, strategy="ddp", name="train-mlp", persist_result=True)


@task(persist_result=True)
def evaluate(data_path: str, result: dict) -> float:
    """A final check on the driver: the run must have produced a finite loss."""
    import math

    if not math.isfinite(result["loss"]):
        raise ValueError(f"training produced a non-finite loss: {result['loss']}")
    return float(result["loss"])


@flow(name="mlp-ddp", log_prints=True, task_runner=GPUTaskRunner())
def mlp_ddp(num_epochs: int = 5, batch_size: int = 64, gpus: int = 4, nodes: int = 2,
            gpu_type: str | None = None, remote: bool = False, fault_file: str | None = None,
            fault_epoch: int = -1, pace_s: float = 0.0) -> dict:
    """Prepare data, train with DDP on ``gpus`` ranks over ``nodes`` nodes, evaluate."""
    data_path = prepare_data()
    result = train.with_options(gpus=gpus, nodes=nodes, gpu_type=gpu_type, remote=remote)(
        num_epochs=num_epochs, batch_size=batch_size, data_path=data_path,
        fault_file=fault_file, fault_epoch=fault_epoch, pace_s=pace_s,
    )
    loss = evaluate(data_path, result)
    get_run_logger().info("final loss %.4f (training started at epoch %d)", loss, result["start_epoch"])
    return {"loss": loss, "start_epoch": result["start_epoch"]}


def main() -> None:
    from prefect_sgpu.cli import add_gpu_arguments, gpu_options

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    add_gpu_arguments(parser)
    args = parser.parse_args()
    out = mlp_ddp(num_epochs=args.epochs, batch_size=args.batch_size, gpus=args.gpus, nodes=args.nodes,
                  **gpu_options(args))
    print(f"final loss: {out['loss']:.4f}")


if __name__ == "__main__":
    main()
