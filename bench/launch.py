"""Launch of the same trivial 2-rank job through every launcher, side by side in one run.

The job: init a gloo (nccl on GPUs) process group, one all_reduce, tear down. Each round
runs every side once, in order, and rounds repeat (``--runs``), so drift in machine load
hits every side alike. Sides:

- ``distributed-cold``: ``.distributed()`` on the local compute with ``keep_warm=0``
  (a new node agent every call; on CPU its ranks are forked from it);
- ``distributed-cold-spawn``: the same with ``PREFECT_SGPU_RANK_START=spawn`` (each rank a new
  interpreter, as on a GPU node);
- ``distributed-fresh``: a new interpreter per call that imports prefect-sgpu, makes one cold
  ``.distributed()`` call (``keep_warm=0``) and exits: what a script run once pays, import and exit
  included. The time from its last result to its exit is shown on its own (``exit lag``);
- ``distributed-warm``: ``.distributed()`` on a local compute with warm nodes (the first
  call, which starts them, is left out, as for every side's first call);
- ``torchrun``: raw ``torchrun --standalone --nproc-per-node=2`` of the same work;
- ``torchdistributor``: pyspark's ``TorchDistributor(local_mode=True)`` (the Spark session
  is created before timing) — needs pyspark, skipped with a note when it is missing;
- ``ray-torchtrainer``: a fresh Ray Train ``TorchTrainer(...).fit()`` per call;
- ``raycompute``: ``RayCompute`` as before warm groups (one Ray Train run per call);
- ``raycompute-warm``: ``RayCompute(keep_warm=...)``: a warm worker group.

Ray sides run on a one-node Ray head on loopback started by the bench (4 logical CPUs, so
an idle warm group and a Ray Train run fit side by side). Every figure is the median over
the rounds; ratios are against the median of raw torchrun.

    ./dev bench launch [--runs 5] [--quick] [--sides distributed-cold,distributed-warm,torchrun]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefect_sgpu import distributed  # noqa: E402
from prefect_sgpu.compute.local import LocalProcessCompute  # noqa: E402

SIDES = ["distributed-cold", "distributed-cold-spawn", "distributed-fresh", "distributed-warm", "torchrun", "torchdistributor", "ray-torchtrainer",
         "raycompute", "raycompute-warm"]

WORK = """
import torch, torch.distributed as dist
dist.init_process_group("nccl" if torch.cuda.is_available() and {gpu} else "gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
"""

#: the ``distributed-fresh`` side's whole process: import, one cold call, exit (the time of its last
#: result is printed for the exit lag)
FRESH = """
import time
from prefect_sgpu import distributed
from prefect_sgpu.compute.local import LocalProcessCompute

def trivial():
    import torch
    import torch.distributed as dist
    from prefect_sgpu import runtime
    runtime.init_process_group()
    t = torch.ones(1, device=runtime.device())
    dist.all_reduce(t)
    return float(t.item())

values = distributed(gpus={gpus}, mlflow=False, compute=LocalProcessCompute(keep_warm=0))(trivial).distributed()
assert values == [float({gpus})] * {gpus}, values
print("SGPU_BENCH_LAST_RESULT", time.time(), flush=True)
"""

#: per fresh call: seconds from its last result to its process's exit
EXIT_LAGS: list[float] = []


def fresh_call(gpus: int) -> None:
    """One ``distributed-fresh`` call: a new interpreter, timed by the caller from start to exit."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    # output to a file, not a pipe: the process's exit is timed, not the end of file of every process
    # that inherited its output
    with tempfile.TemporaryFile("w+") as out:
        code = subprocess.call([sys.executable, "-c", FRESH.format(gpus=gpus)], env=env, stdout=out,
                               stderr=subprocess.STDOUT)
        ended = time.time()
        out.seek(0)
        text = out.read()
    if code != 0:
        raise RuntimeError(f"distributed-fresh exited {code}: {text[-2000:]}")
    last = [line for line in text.splitlines() if line.startswith("SGPU_BENCH_LAST_RESULT ")]
    EXIT_LAGS.append(ended - float(last[-1].split()[1]))


def trivial() -> float:
    import torch
    import torch.distributed as dist

    from prefect_sgpu import runtime

    runtime.init_process_group()
    t = torch.ones(1, device=runtime.device())
    dist.all_reduce(t)
    return float(t.item())


def plain_trivial() -> float:
    """The same work for launchers that set torch's environment but no process group."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    value = float(t.item())
    dist.destroy_process_group()
    return value


def train_loop(_config: dict[str, Any]) -> None:
    """Ray Train's worker loop: Ray Train set the process group up."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)


class Ray:
    """A one-node Ray head on loopback for the Ray sides."""

    def __init__(self, cpus: int) -> None:
        from prefect_sgpu.ray.node_process import RayNodeProcess, RayNodeSpec, free_port

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        self.temp = tempfile.mkdtemp(prefix="sgpu-bench-ray-", dir="/tmp")
        port = free_port("127.0.0.21")
        self.address = f"127.0.0.21:{port}"
        self.log = open(Path(self.temp) / "ray-start.out", "a")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", ""))
                                                           if p)}
        self.head = RayNodeProcess(RayNodeSpec(node_ip="127.0.0.21", temp_dir=f"{self.temp}/h", num_cpus=cpus,
                                               gcs_port=port, object_store_memory=256 << 20), env=env, output=self.log)
        self.head.start()

    def stop(self) -> None:
        import ray

        ray.shutdown()  # first: a Ray driver whose cluster goes away exits on the spot
        self.head.stop()
        self.log.close()
        shutil.rmtree(self.temp, ignore_errors=True)


def build_sides(wanted: list[str], gpus: int, keep: list[Any]) -> dict[str, Callable[[], None]]:
    """One callable per side; each runs the job once and checks its value."""
    sides: dict[str, Callable[[], None]] = {}
    expected = [float(gpus)] * gpus
    gpu = os.environ.get("PREFECT_SGPU_DEVICE", "") != "cpu"
    if "distributed-cold" in wanted:
        cold = distributed(gpus=gpus, mlflow=False, compute=LocalProcessCompute(keep_warm=0))(trivial)
        sides["distributed-cold"] = lambda: _check(cold.distributed(), expected)
    if "distributed-cold-spawn" in wanted:
        spawned = distributed(gpus=gpus, mlflow=False, compute=LocalProcessCompute(keep_warm=0))(trivial)
        sides["distributed-cold-spawn"] = lambda: _check(_spawning(spawned.distributed), expected)
    if "distributed-fresh" in wanted:
        sides["distributed-fresh"] = lambda: fresh_call(gpus)
    if "distributed-warm" in wanted:
        warm_compute = LocalProcessCompute(keep_warm=3600)
        keep.append(warm_compute)
        warm = distributed(gpus=gpus, mlflow=False, compute=warm_compute)(trivial)
        sides["distributed-warm"] = lambda: _check(warm.distributed(), expected)
    if "torchrun" in wanted:
        script = Path(tempfile.mkdtemp()) / "trivial.py"
        script.write_text(WORK.format(gpu=gpu))
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", str(script)]
        sides["torchrun"] = lambda: subprocess.run(argv, check=True, capture_output=True) and None
    if "torchdistributor" in wanted:
        try:
            from pyspark.ml.torch.distributor import TorchDistributor
            from pyspark.sql import SparkSession
        except ImportError:
            print("torchdistributor: skipped (pyspark is not installed: pip install pyspark)")
        else:
            spark = SparkSession.builder.master("local[2]").appName("sgpu-bench").getOrCreate()
            spark.sparkContext.setLogLevel("ERROR")
            keep.append(spark)
            distributor = TorchDistributor(num_processes=gpus, local_mode=True, use_gpu=False)
            sides["torchdistributor"] = lambda: _check([distributor.run(plain_trivial)], [float(gpus)])
    ray_sides = [s for s in wanted if s.startswith("ray")]
    if ray_sides:
        import ray

        cluster = Ray(cpus=2 * gpus)
        keep.append(cluster)
        ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
        from prefect_sgpu.ray.compute import RayTrainCompute

        if "ray-torchtrainer" in wanted:
            from ray.train import RunConfig, ScalingConfig
            from ray.train.torch import TorchTrainer

            storage = tempfile.mkdtemp(prefix="sgpu-bench-train-")

            def fit() -> None:
                TorchTrainer(train_loop, scaling_config=ScalingConfig(num_workers=gpus, use_gpu=False),
                             run_config=RunConfig(storage_path=storage)).fit()

            sides["ray-torchtrainer"] = fit
        if "raycompute" in wanted:
            per_run = distributed(gpus=gpus, mlflow=False, compute=RayTrainCompute(address=cluster.address))(trivial)
            sides["raycompute"] = lambda: _check(per_run.distributed(), expected)
        if "raycompute-warm" in wanted:
            warm_ray = RayTrainCompute(address=cluster.address, keep_warm=3600)
            keep.append(warm_ray)
            on_group = distributed(gpus=gpus, mlflow=False, compute=warm_ray)(trivial)
            sides["raycompute-warm"] = lambda: _check(on_group.distributed(), expected)
    return sides


def _spawning(call: Callable[[], list[float]]) -> list[float]:
    """``call()`` with every rank a new interpreter (``PREFECT_SGPU_RANK_START=spawn``)."""
    before = os.environ.get("PREFECT_SGPU_RANK_START")
    os.environ["PREFECT_SGPU_RANK_START"] = "spawn"
    try:
        return call()
    finally:
        if before is None:
            os.environ.pop("PREFECT_SGPU_RANK_START", None)
        else:
            os.environ["PREFECT_SGPU_RANK_START"] = before


def _check(values: list[float], expected: list[float]) -> None:
    assert values == expected, (values, expected)


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ("torch", "prefect", "ray", "pyspark"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    return f"Python {platform.python_version()}, " + ", ".join(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 rounds (for ./dev bench all)")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of: {', '.join(SIDES)}")
    args = parser.parse_args()
    runs = 2 if args.quick else args.runs
    wanted = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SIDES))
    if unknown:
        parser.error(f"unknown side(s) {unknown}; known: {', '.join(SIDES)}")

    keep: list[Any] = []
    times: dict[str, list[float]] = {}
    first: dict[str, float] = {}
    try:
        sides = build_sides(wanted, args.gpus, keep)
        for name, side in sides.items():  # the first call of each side starts what it keeps (left out)
            t0 = time.perf_counter()
            side()
            first[name] = time.perf_counter() - t0
        for _ in range(runs):
            for name, side in sides.items():
                t0 = time.perf_counter()
                side()
                times.setdefault(name, []).append(time.perf_counter() - t0)
    finally:
        for thing in reversed(keep):
            for method in ("close", "stop"):
                if hasattr(thing, method):
                    try:
                        getattr(thing, method)()
                    except Exception as exc:  # noqa: BLE001 - report and go on tearing down
                        print(f"teardown of {type(thing).__name__}: {exc}")
                    break
    load = os.getloadavg()[0]
    medians = {name: statistics.median(values) for name, values in times.items()}
    base = medians.get("torchrun")
    print(f"{runs} round(s), {args.gpus} ranks, {versions()}")
    print("| side | first call s | median s | runs s | × raw torchrun |")
    print("| --- | --- | --- | --- | --- |")
    for name in sides:
        ratio = f"{medians[name] / base:.2f}" if base else "-"
        print(f"| {name} | {first[name]:.2f} | {medians[name]:.2f} | {', '.join(f'{x:.2f}' for x in times[name])} "
              f"| {ratio} |")
    if EXIT_LAGS:
        print(f"distributed-fresh exit lag (last result to process exit), median s: {statistics.median(EXIT_LAGS):.2f} "
              f"({', '.join(f'{x:.2f}' for x in EXIT_LAGS)})")
    row = " | ".join(f"{medians[s]:.2f}" if s in medians else "-" for s in SIDES)
    print(f"| {dt.date.today()} | {platform.node()} ({os.cpu_count()} cores, {platform.machine()}, load {load:.1f}) "
          f"| {args.gpus} | {runs} | {row} |")


if __name__ == "__main__":
    main()
