"""The same trivial 2-rank job on an existing Ray cluster (RayCompute) vs the local default.

Starts a two-node Ray cluster on loopback (``ray start`` head and worker, one CPU each),
then alternates the job through ``RayCompute`` (one Ray Train ``TorchTrainer`` run per
call) and through the local torch elastic launcher. Prints the cluster's start time,
the first Ray call (it connects and starts Ray Train's actors) and the medians of the
rest. Needs the ``ray`` extra.

    ./dev bench ray_compute [--runs 5]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from prefect_sgpu import distributed  # noqa: E402
from prefect_sgpu.ray import RayCompute  # noqa: E402
from prefect_sgpu.ray.node_process import RayNodeProcess, RayNodeSpec, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def rank_sum() -> float:
    """One all_reduce of the ranks' numbers over the job's process group."""
    import torch
    import torch.distributed as dist

    from prefect_sgpu import runtime

    runtime.init_process_group()
    t = torch.tensor([float(runtime.rank())])
    dist.all_reduce(t)
    return float(t.item())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    temp = tempfile.mkdtemp(prefix="sgpu-bench-", dir="/tmp")
    port = free_port("127.0.0.11")
    address = f"127.0.0.11:{port}"
    log = open(Path(temp) / "ray-start.out", "a")  # noqa: SIM115 - closed below
    head = RayNodeProcess(RayNodeSpec(node_ip="127.0.0.11", temp_dir=f"{temp}/h", num_cpus=1, gcs_port=port,
                                      object_store_memory=256 << 20), env=env, output=log)
    worker = RayNodeProcess(RayNodeSpec(node_ip="127.0.0.12", temp_dir=f"{temp}/w", num_cpus=1,
                                        head_address=address, object_store_memory=256 << 20), env=env, output=log)
    compute = RayCompute(address=address)
    try:
        t0 = time.perf_counter()
        head.start()
        worker.start()
        cluster_s = time.perf_counter() - t0
        on_ray = distributed(gpus=2, compute=compute, mlflow=False)(rank_sum)
        local = distributed(gpus=2, mlflow=False)(rank_sum)
        t0 = time.perf_counter()
        assert on_ray.distributed() == [1.0, 1.0]
        first_s = time.perf_counter() - t0
        local.distributed()  # warm the local driver's imports too
        ray_s, local_s = [], []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            assert on_ray.distributed() == [1.0, 1.0]
            ray_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert local.distributed() == [1.0, 1.0]
            local_s.append(time.perf_counter() - t0)
    finally:
        compute.close()
        worker.stop()
        head.stop()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
    m_ray, m_local = statistics.median(ray_s), statistics.median(local_s)
    load = os.getloadavg()[0]
    print(f"cluster start {cluster_s:.1f} s, first RayCompute call {first_s:.1f} s")
    print(f"RayCompute s: {[round(x, 2) for x in ray_s]}")
    print(f"local      s: {[round(x, 2) for x in local_s]}")
    print(f"| {dt.date.today()} | {platform.node()} ({os.cpu_count()} cores, {platform.machine()}, load {load:.1f}) | "
          f"2 | {cluster_s:.1f} | {first_s:.1f} | {m_ray:.2f} | {m_local:.2f} |")


if __name__ == "__main__":
    main()
