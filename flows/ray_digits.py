"""Ray Train + Ray Data on scikit-learn's digits: a small CNN, MLflow, the model registry.

``train_digits`` is a ``@ray_launch`` function: the job's nodes form one Ray cluster
(node 0 hosts the head) and the function runs once on node 0 as the Ray driver. There
it builds a Ray Dataset from the 8x8 digit images, trains a small CNN with a
``TorchTrainer`` (one Ray Train worker per ``num_workers``, DDP under the hood), and
evaluates the best checkpoint on the held-out images, logging to the job's MLflow run.
The flow then registers the model only when it is accurate enough, so the registry
never gets a model that failed its gate.

CPU (default): 2 simulated nodes x 2 CPUs on this machine. GPU: ``gpus=8,
gpu_type="A10", remote=True`` with an EC2 compute block; workers then use GPUs
(``use_gpu`` follows the cluster).

    python flows/ray_digits.py --epochs 3
"""

from __future__ import annotations

import argparse
from typing import Any

from prefect import flow, get_run_logger, task

from prefect_sgpu.ray import ray_launch

MODEL_NAME = "digits-cnn"


def _digits_split(seed: int) -> tuple[Any, Any, Any, Any]:
    """scikit-learn's digits (shipped with the package: nothing is downloaded), 80/20 split."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.astype(np.float32)[:, None, :, :]  # N x 1 x 8 x 8, pixels 0..16
    return train_test_split(images, digits.target.astype(np.int64), test_size=0.2, random_state=seed,
                            stratify=digits.target)


def _cnn() -> Any:
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def _train_per_worker(config: dict) -> None:
    """One Ray Train worker: its shard of the Ray Dataset, DDP via prepare_model, a report per epoch."""
    import tempfile
    from pathlib import Path

    import ray.train
    import torch
    from ray.train import Checkpoint
    from ray.train.torch import prepare_model

    torch.manual_seed(config["seed"])
    model = prepare_model(_cnn())
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    loss_fn = torch.nn.CrossEntropyLoss()
    shard = ray.train.get_dataset_shard("train")
    ctx = ray.train.get_context()
    for epoch in range(config["epochs"]):
        total, correct, loss_sum = 0, 0, 0.0
        for batch in shard.iter_torch_batches(batch_size=config["batch_size"],
                                              dtypes={"image": torch.float32, "label": torch.long}):
            logits = model(batch["image"])
            loss = loss_fn(logits, batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += len(batch["label"])
            correct += int((logits.argmax(1) == batch["label"]).sum())
            loss_sum += float(loss) * len(batch["label"])
        metrics = {"epoch": epoch, "loss": loss_sum / max(total, 1), "train_accuracy": correct / max(total, 1)}
        if ctx.get_world_rank() == 0:
            print(f"epoch {epoch}: loss {metrics['loss']:.4f} train accuracy {metrics['train_accuracy']:.3f}")
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if ctx.get_world_rank() == 0:
                state = getattr(model, "module", model).state_dict()
                torch.save(state, Path(tmp) / "model.pt")
                checkpoint = Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=checkpoint)


@ray_launch(gpus=4, nodes=2)
def train_digits(epochs: int = 3, batch_size: int = 64, lr: float = 3e-3, num_workers: int = 2,
                 seed: int = 0) -> dict:
    """The Ray driver: Ray Data + TorchTrainer, then evaluation and the model in the job's MLflow run."""
    from pathlib import Path

    import mlflow
    import ray
    import torch
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from prefect_sgpu import runtime

    ray.init()  # the job's cluster (RAY_ADDRESS)
    x_train, x_test, y_train, y_test = _digits_split(seed)
    train_ds = ray.data.from_items([{"image": x, "label": int(y)} for x, y in zip(x_train, y_train)])
    train_ds = train_ds.map_batches(lambda b: {"image": b["image"] / 16.0, "label": b["label"]})
    use_gpu = ray.cluster_resources().get("GPU", 0) > 0

    trainer = TorchTrainer(
        _train_per_worker,
        train_loop_config={"epochs": epochs, "batch_size": batch_size, "lr": lr, "seed": seed},
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        datasets={"train": train_ds},
        run_config=RunConfig(name="digits", storage_path=str(runtime.checkpoint_dir() / "ray-train")),
    )
    result = trainer.fit()

    model = _cnn()
    with result.checkpoint.as_directory() as folder:
        model.load_state_dict(torch.load(Path(folder) / "model.pt", map_location="cpu", weights_only=True))
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(x_test / 16.0))
    accuracy = float((logits.argmax(1) == torch.from_numpy(y_test)).float().mean())
    print(f"test accuracy {accuracy:.3f} on {len(y_test)} held-out digits")

    with mlflow.start_run():  # the job's run (MLFLOW_RUN_ID)
        mlflow.log_params({"epochs": epochs, "batch_size": batch_size, "lr": lr, "num_workers": num_workers})
        for row in result.metrics_dataframe.to_dict("records") if result.metrics_dataframe is not None else []:
            mlflow.log_metrics({"loss": row["loss"], "train_accuracy": row["train_accuracy"]},
                               step=int(row["epoch"]))
        mlflow.log_metric("test_accuracy", accuracy)
        info = mlflow.pytorch.log_model(model, name="model", serialization_format="pickle",
                                        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])
    return {"accuracy": accuracy, "loss": float(result.metrics["loss"]), "model_uri": info.model_uri}


@task
def train(epochs: int, batch_size: int, lr: float, num_workers: int, gpus: int, nodes: int,
          gpu_type: str | None, remote: bool) -> dict:
    """One @ray_launch job: the Ray cluster exists only while this task runs."""
    return train_digits.with_options(gpus=gpus, nodes=nodes, gpu_type=gpu_type, remote=remote).distributed(
        epochs=epochs, batch_size=batch_size, lr=lr, num_workers=num_workers)


@task
def register(result: dict, model_name: str, min_accuracy: float) -> int:
    """Register the model only when it passed the accuracy gate; return the new version."""
    import mlflow

    if result["accuracy"] < min_accuracy:
        raise ValueError(f"test accuracy {result['accuracy']:.3f} is below {min_accuracy}: not registered")
    version = mlflow.register_model(result["model_uri"], model_name)
    return int(version.version)


@flow(name="ray-digits", log_prints=True)
def ray_digits(epochs: int = 3, batch_size: int = 64, lr: float = 3e-3, num_workers: int = 2, gpus: int = 4,
               nodes: int = 2, gpu_type: str | None = None, remote: bool = False,
               model_name: str = MODEL_NAME, min_accuracy: float = 0.8) -> dict:
    """Train a digits CNN with Ray Train + Ray Data on a per-run Ray cluster, then register it."""
    result = train(epochs, batch_size, lr, num_workers, gpus, nodes, gpu_type, remote)
    version = register(result, model_name, min_accuracy)
    get_run_logger().info("registered %s version %d (test accuracy %.3f)", model_name, version, result["accuracy"])
    return {**result, "model_name": model_name, "version": version}


def main() -> None:
    from prefect_sgpu.cli import add_gpu_arguments, gpu_options

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    add_gpu_arguments(parser)
    args = parser.parse_args()
    out = ray_digits(epochs=args.epochs, gpus=args.gpus, nodes=args.nodes, **gpu_options(args))
    print(f"test accuracy {out['accuracy']:.3f}; registered {out['model_name']} version {out['version']}")


if __name__ == "__main__":
    main()
