"""Sample a Ray cluster's resources into the job's MLflow run as system metrics.

Started by node 0 of a ``@ray_launch(ray_metrics_to_mlflow=True)`` job beside the
driver: it connects to the job's cluster as a second (resource-free) driver, samples
``ray.cluster_resources()`` / ``ray.available_resources()`` / ``ray.nodes()`` every
``interval`` seconds and logs them under ``system/ray/...`` in ``MLFLOW_RUN_ID``, the
same prefix MLflow's own system metrics use. One sample is taken at start and one
when stopped, so even a short job has a first and a last point.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any


def sample(cluster: dict[str, float], available: dict[str, float], nodes: list[dict[str, Any]]) -> dict[str, float]:
    """``system/ray/...`` metrics from one reading of the cluster's logical resources."""
    metrics = {"system/ray/nodes_alive": float(sum(1 for n in nodes if n.get("Alive")))}
    for key, name in (("CPU", "cpu"), ("GPU", "gpu")):
        total = float(cluster.get(key, 0.0))
        metrics[f"system/ray/{name}_total"] = total
        metrics[f"system/ray/{name}_used"] = total - float(available.get(key, 0.0))
    for key, name in (("object_store_memory", "object_store"), ("memory", "memory")):
        total = float(cluster.get(key, 0.0))
        metrics[f"system/ray/{name}_total_bytes"] = total
        metrics[f"system/ray/{name}_used_bytes"] = total - float(available.get(key, 0.0))
    return metrics


def log(client: Any, run_id: str, metrics: dict[str, float], step: int) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefect-sgpu-ray-metrics")
    p.add_argument("--address", required=True)
    p.add_argument("--interval", type=float, default=5.0)
    p.add_argument("--stop-file", required=True, help="take a last sample and exit once this file exists")
    args = p.parse_args(argv)

    import ray
    from mlflow.tracking import MlflowClient

    run_id = os.environ["MLFLOW_RUN_ID"]
    client = MlflowClient(os.environ.get("MLFLOW_TRACKING_URI"))
    ray.init(address=args.address, log_to_driver=False, logging_level="WARNING")
    stop = threading.Event()  # after ray.init, which installs its own handlers
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop_file = Path(args.stop_file)
    step = 0
    try:
        while True:
            log(client, run_id, sample(ray.cluster_resources(), ray.available_resources(), ray.nodes()), step)
            step += 1
            if step > 1 and (stop.is_set() or stop_file.exists()):
                break  # always a closing sample after the first one
            deadline = time.monotonic() + args.interval
            while time.monotonic() < deadline and not (stop.is_set() or stop_file.exists()):
                stop.wait(0.2)
    except Exception as exc:  # noqa: BLE001 - metrics never fail the job
        print(f"[sgpu-ray-metrics] stopped sampling: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    print(f"[sgpu-ray-metrics] logged {step} sample(s) to MLflow run {run_id}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
