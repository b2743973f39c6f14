"""Two-tower recommender with PyTorch Lightning, trained on MDS shards, as a Prefect flow.

The pipeline:

1. ``generate_interactions`` (a task on the driver): a synthetic user-item interaction
   log with a deterministic seed — users and items have hidden taste vectors and each
   user picks items they like — split into a training part and a held-out part (a
   few items per user). Written as parquet files.
2. ``prepare_mds`` (the library's task): both parts -> MDS shards. Cached by content
   and settings: a rerun, or a flow run retried from the UI, converts nothing again.
3. ``train`` (a GPU task: one gang-launched job): every rank runs Lightning's Trainer
   with the DDP strategy; Lightning detects torch elastic's environment and its
   ``num_nodes``/``devices`` are set from the job's shape. Each rank streams its share
   of the shards (``prefect_sgpu.pipeline.streaming``). After training, the same job
   *evaluates* on the held-out part — recall@k (is the held-out item among the user's
   top k of all items?) and AUC (the share of other items ranked below it), summed over
   all ranks. Lightning's own ``MLFlowLogger`` writes parameters, the loss per epoch and
   the metrics into the job's MLflow run (``MLFLOW_RUN_ID`` in every rank; Lightning logs
   from rank 0), and its ``ModelCheckpoint`` keeps ``last.ckpt`` in the task's checkpoint
   folder after every epoch: a Prefect retry of the task resumes from it, loaded with
   ``weights_only=True``. Rank 0 saves the final weights beside it.
4. ``check_metrics`` (driver): fails the run on non-finite metrics and reports them
   next to a random model's (recall@k = k / items, AUC = 0.5).

CPU (default): 1 node x 2 ranks with gloo, small dims; about a minute here
(``--nodes 2`` runs 2 simulated nodes x 1 rank).

GPU: ``gpus=8, nodes=1`` on a local GPU box, or ``gpus=16, gpu_type="A10", remote=True``
(with an EC2 compute block, e.g. a deployment's ``compute_block``) for 4 x g5.12xlarge;
Lightning then uses the ``gpu`` accelerator and nccl. For remote nodes, put the shards
where every node can read them: ``data_uri="s3://BUCKET/two-tower"`` (ranks cache the
shards per job and node). Raise ``num_users``/``num_items``/``dim``/``batch_size`` to
give the GPUs work.

    python flows/two_tower.py --epochs 10 --gpus 2 --nodes 1

Top-level imports are light (``prefect deploy`` imports this file); torch, Lightning
and MLflow load inside the tasks.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task

from prefect_sgpu import GPUTaskRunner, gpu_task
from prefect_sgpu.pipeline.mds import ShardSet, prepare_mds


def _data_home() -> Path:
    return Path(os.environ.get("PREFECT_SGPU_HOME", Path.home() / ".prefect-sgpu")) / "data" / "two-tower"


@task(persist_result=True)
def generate_interactions(num_users: int = 300, num_items: int = 100, per_user: int = 20, holdout: int = 2,
                          seed: int = 0) -> dict[str, str]:
    """Write train/held-out interaction logs (parquet); the same arguments give the same files."""
    import numpy as np
    import pandas as pd

    if not 0 < holdout < per_user <= num_items:
        raise ValueError(f"need 0 < holdout ({holdout}) < per_user ({per_user}) <= num_items ({num_items})")
    rng = np.random.default_rng(seed)
    latent = 8
    users = rng.normal(size=(num_users, latent))
    items = rng.normal(size=(num_items, latent))
    affinity = users @ items.T / np.sqrt(latent) * 5.0
    # each user picks per_user distinct items, likelier the more they like them (Gumbel top-k)
    picked = np.argsort(-(affinity + rng.gumbel(size=affinity.shape)), axis=1)[:, :per_user]
    train, held_out = [], []
    for user in range(num_users):
        order = rng.permutation(picked[user])
        held_out += [(user, int(item)) for item in order[:holdout]]
        train += [(user, int(item)) for item in order[holdout:]]
    folder = _data_home() / f"interactions-{num_users}x{num_items}-{per_user}-{holdout}-{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in (("train", train), ("test", held_out)):
        frame = pd.DataFrame(rows, columns=["user", "item"])
        frame = frame.sample(frac=1.0, random_state=seed).reset_index(drop=True)  # not grouped by user
        path = folder / f"{name}.parquet"
        tmp = path.with_suffix(".tmp")
        frame.to_parquet(tmp, index=False)
        tmp.replace(path)
        paths[name] = str(path)
    return paths


def train_two_tower(train_set: ShardSet, test_set: ShardSet, num_users: int, num_items: int, epochs: int = 10,
                    batch_size: int = 64, dim: int = 32, lr: float = 0.02, temperature: float = 0.05,
                    k: int = 10, seed: int = 0, fault_file: str | None = None,
                    fault_epoch: int = -1) -> dict[str, Any]:
    """Fit the two towers with Lightning DDP on every rank, then evaluate on the held-out set.

    ``fault_file`` / ``fault_epoch`` are for failure drills: rank 0 fails once at the start of
    ``fault_epoch`` if the file exists, and deletes it; the task's retry resumes from ``last.ckpt``.
    """
    import math

    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn

    from prefect_sgpu import runtime
    from prefect_sgpu.pipeline.streaming import streaming_loader

    mlflow_run_id = os.environ.get("MLFLOW_RUN_ID")  # mlflow removes it once the run is resumed
    runtime.init_process_group()  # Lightning finds the group and keeps it
    L.seed_everything(seed, workers=True, verbose=False)
    rank_zero = runtime.is_rank_zero()

    def tower(count: int) -> nn.Module:
        return nn.Sequential(nn.Embedding(count, dim), nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))

    class TwoTower(L.LightningModule):
        """User and item towers; score = cosine similarity; in-batch softmax loss."""

        def __init__(self) -> None:
            super().__init__()
            self.user_tower = tower(num_users)
            self.item_tower = tower(num_items)
            self.epoch_losses: list[float] = []
            self.loss_sums = torch.zeros(2)  # loss x samples, samples (this epoch, this rank)
            self.sums = torch.zeros(3)

        def embed_users(self, users: torch.Tensor) -> torch.Tensor:
            return F.normalize(self.user_tower(users), dim=-1)

        def embed_items(self, items: torch.Tensor) -> torch.Tensor:
            return F.normalize(self.item_tower(items), dim=-1)

        def training_step(self, batch: dict[str, torch.Tensor], _: int) -> torch.Tensor:
            logits = self.embed_users(batch["user"]) @ self.embed_items(batch["item"]).T / temperature
            loss = F.cross_entropy(logits, torch.arange(len(logits), device=logits.device))
            self.loss_sums += torch.stack([loss.detach() * len(logits),
                                           torch.tensor(float(len(logits)), device=self.device)])
            return loss

        def on_train_epoch_start(self) -> None:
            self.loss_sums = torch.zeros(2, device=self.device)
            if fault_file and self.current_epoch == fault_epoch and rank_zero and Path(fault_file).exists():
                Path(fault_file).unlink()
                raise RuntimeError(f"injected fault at epoch {fault_epoch}")

        def on_train_epoch_end(self) -> None:
            total = self.trainer.strategy.reduce(self.loss_sums, reduce_op="sum")  # every rank's samples
            loss = float(total[0] / total[1])
            self.epoch_losses.append(loss)
            if self.logger is not None:  # Lightning's loggers write from rank 0 only
                self.logger.log_metrics({"train_loss": loss}, step=self.current_epoch)
            if rank_zero:
                print(f"epoch {self.current_epoch}: loss {loss:.4f}")

        def on_test_epoch_start(self) -> None:
            self.sums = torch.zeros(3, device=self.device)  # hits@k, AUC sum, samples

        def test_step(self, batch: dict[str, torch.Tensor], _: int) -> None:
            scores = self.embed_users(batch["user"]) @ self.embed_items(
                torch.arange(num_items, device=self.device)).T
            positive = scores.gather(1, batch["item"][:, None])
            above = (scores > positive).sum(dim=1).float()  # items ranked above the held-out one
            self.sums += torch.stack([(above < k).float().sum(), (1 - above / (num_items - 1)).sum(),
                                      torch.tensor(float(len(above)), device=self.device)])

        def on_test_epoch_end(self) -> None:
            self.sums = self.trainer.strategy.reduce(self.sums, reduce_op="sum")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=lr)

    train_loader = streaming_loader(train_set, batch_size, seed=seed)
    test_loader = streaming_loader(test_set, 256, shuffle=False)
    model = TwoTower()
    nodes = max(1, runtime.world_size() // runtime.local_world_size())
    folder = runtime.checkpoint_dir() / "lightning"
    logger: Any = False
    if mlflow_run_id:
        from lightning.pytorch.loggers import MLFlowLogger

        logger = MLFlowLogger(run_id=mlflow_run_id, tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"))
    trainer = L.Trainer(
        accelerator="gpu" if runtime.uses_gpu() else "cpu", devices=runtime.local_world_size(), num_nodes=nodes,
        strategy="ddp", max_epochs=epochs, logger=logger, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=folder, filename="last", enable_version_counter=False)],
        use_distributed_sampler=False, default_root_dir=str(runtime.checkpoint_dir()), log_every_n_steps=10**9,
    )
    resume = folder / "last.ckpt"
    start_epoch = 0
    if resume.is_file():  # an earlier attempt of this task got this far
        start_epoch = int(torch.load(resume, map_location="cpu", weights_only=True)["epoch"]) + 1
        print(f"resuming from {resume.name} (epoch {start_epoch})")
    if logger:  # every attempt has its own run
        logger.log_hyperparams({"num_users": num_users, "num_items": num_items, "epochs": epochs,
                                "batch_size": batch_size, "dim": dim, "lr": lr, "temperature": temperature,
                                "k": k, "world_size": runtime.world_size(), "nodes": nodes,
                                "train_rows": train_set.rows, "test_rows": test_set.rows})
    trainer.fit(model, train_dataloaders=train_loader, ckpt_path=resume if start_epoch else None,
                weights_only=True)
    trainer.test(model, dataloaders=test_loader, verbose=False)

    hits, auc_sum, count = (float(v) for v in model.sums.cpu())
    metrics = {f"recall_at_{k}": hits / count, "auc": auc_sum / count,
               f"random_recall_at_{k}": k / num_items, "random_auc": 0.5}
    model_path = runtime.checkpoint_dir() / "two_tower.pt"
    if logger:
        logger.log_metrics(metrics)
    if rank_zero:
        tmp = model_path.with_suffix(".tmp")
        torch.save({"state_dict": model.state_dict(), "num_users": num_users, "num_items": num_items,
                    "dim": dim}, tmp)
        tmp.replace(model_path)  # complete or absent
    return {**metrics, "k": k, "train_losses": model.epoch_losses, "evaluated": int(count),
            "finite": all(math.isfinite(v) for v in metrics.values()), "model_path": str(model_path),
            "mlflow_run_id": mlflow_run_id, "world_size": runtime.world_size(), "start_epoch": start_epoch,
            "lightning_checkpoint": str(resume)}


#: training + held-out evaluation as one gang-launched job (Prefect states, retries, results)
train = gpu_task(train_two_tower, gpus=2, nodes=1, strategy="ddp", name="train-two-tower", persist_result=True,
                 retries=1)


@task
def check_metrics(result: dict[str, Any]) -> dict[str, float]:
    """Fail on non-finite metrics; report them next to a random model's."""
    import math

    k = result["k"]
    recall, auc = result[f"recall_at_{k}"], result["auc"]
    if not (math.isfinite(recall) and math.isfinite(auc)):
        raise ValueError(f"evaluation produced non-finite metrics: recall@{k}={recall}, auc={auc}")
    get_run_logger().info("recall@%d %.3f (random %.3f), AUC %.3f (random 0.5) on %d held-out interactions",
                          k, recall, result[f"random_recall_at_{k}"], auc, result["evaluated"])
    return {f"recall_at_{k}": recall, "auc": auc, f"random_recall_at_{k}": result[f"random_recall_at_{k}"]}


@flow(name="two-tower", log_prints=True, task_runner=GPUTaskRunner())
def two_tower(num_users: int = 300, num_items: int = 100, per_user: int = 20, epochs: int = 10,
              batch_size: int = 64, dim: int = 32, lr: float = 0.02, k: int = 10, seed: int = 0, gpus: int = 2,
              nodes: int = 1, gpu_type: str | None = None, remote: bool = False,
              data_uri: str | None = None, fault_file: str | None = None, fault_epoch: int = -1) -> dict[str, Any]:
    """Generate interactions -> MDS shards -> Lightning DDP training and held-out evaluation -> metrics."""
    logs = generate_interactions(num_users=num_users, num_items=num_items, per_user=per_user, seed=seed)
    base = data_uri.rstrip("/") if data_uri else str(_data_home() / "mds")
    name = Path(logs["train"]).parent.name
    train_set = prepare_mds(logs["train"], f"{base}/{name}/train")
    test_set = prepare_mds(logs["test"], f"{base}/{name}/test")
    result = train.with_options(gpus=gpus, nodes=nodes, gpu_type=gpu_type, remote=remote)(
        train_set, test_set, num_users=num_users, num_items=num_items, epochs=epochs, batch_size=batch_size,
        dim=dim, lr=lr, k=k, seed=seed, fault_file=fault_file, fault_epoch=fault_epoch,
    )
    metrics = check_metrics(result)
    return {**result, **metrics}


def main() -> None:
    from prefect_sgpu.cli import add_gpu_arguments, gpu_options

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--data-uri", default=None)
    add_gpu_arguments(parser)
    args = parser.parse_args()
    out = two_tower(epochs=args.epochs, batch_size=args.batch_size, gpus=args.gpus, nodes=args.nodes,
                    data_uri=args.data_uri, **gpu_options(args))
    k = out["k"]
    print(f"recall@{k}: {out[f'recall_at_{k}']:.3f} (random {out[f'random_recall_at_{k}']:.3f})  "
          f"AUC: {out['auc']:.3f} (random 0.5)")


if __name__ == "__main__":
    main()
