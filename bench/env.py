"""Seconds to agent up on EC2 (simulated): an image with everything, a bare image cold, a bare image reused.

Runs offline, like the test suite: a moto server, the EC2 simulator that boots each instance's
real user-data as local processes (``tests/support``). Three 2-node jobs of a trivial function:

1. ``image``: the simulated image has prefect-sgpu and every package (``environment="image"``);
2. ``bare cold``: a bare image (the system Python with pip only); the nodes fetch the uv wheel
   the stage pins (from a package index on 127.0.0.1) and build the driver's environment (a venv
   by digest, packages offline from uv's cache, the shipped files from the store);
3. ``bare reused``: the same environment again on the same node disk: the venv is reused.

For each: the wall time of the job, the seconds from the job's start to every agent up, and the
stage's own seconds as the nodes printed them (built / reused).

    ./dev bench env

On AWS a cold build downloads the wheels from the index (several GB with CUDA torch) instead of
linking them from a warm cache: the cold number here is a lower bound.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from prefect_sgpu import distributed  # noqa: E402
from support.aws_fixtures import create_network, offline_aws  # noqa: E402
from support.conformance_ec2 import ec2_environment  # noqa: E402

STAGE = re.compile(r"\[prefect-sgpu env\] (built|reused) environment \S+ at \S+ in ([0-9.]+)s")


def _rank() -> int:
    from prefect_sgpu import runtime

    return runtime.rank()


class AgentsUp(logging.Handler):
    """When the driver logged its last "agent up" line (every node announced itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "agent up" in message and re.search(r"\((\d+)/\1\)", message):
            self.at = time.monotonic()


def one(env: Any, label: str, watcher: AgentsUp, environment: str | None) -> dict[str, Any]:
    fn = distributed(gpus=2, gpu_type="A10", remote=True, mlflow=False, timeout=900,
                     compute=env.compute(agent_timeout_s=900.0),
                     **({"environment": environment} if environment else {}))(_rank)
    job = fn.job()
    watcher.at = None
    started = time.monotonic()
    values = job.run().values
    wall = time.monotonic() - started
    assert values == [0, 1], values
    stage = [STAGE.search(env.simulator.console(i["InstanceId"])) for i in env.instances(job.run_id)]
    row = {"label": label, "wall": wall, "agents_up": (watcher.at or started) - started,
           "stage": ", ".join(f"{m.group(1)} {float(m.group(2)):.1f}" for m in stage if m) or "-"}
    print(f"{label}: {row}", flush=True)
    return row


def main() -> None:
    watcher = AgentsUp()
    logging.getLogger("prefect_sgpu.compute.remote.nodes").addHandler(watcher)
    logging.getLogger("prefect_sgpu.compute.remote.nodes").setLevel(logging.INFO)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sgpu-bench-env-") as tmp, offline_aws() as (aws, proxy):
        work = Path(tmp)
        network = create_network(aws)
        with ec2_environment(aws, network, work / "image-nodes", proxy=proxy, bare=False) as env:
            rows.append(one(env, "image (everything baked in)", watcher, None))
        with ec2_environment(aws, network, work / "bare-nodes", proxy=proxy, bare=True,
                             env_root=work / "node-envs") as env:
            rows.append(one(env, "bare image, cold", watcher, "driver"))
            rows.append(one(env, "bare image, reused", watcher, "driver"))
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    print("\n| date | machine | job | wall s | agents up s | env stage s (per node) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {dt.date.today()} | {machine} | {row['label']} | {row['wall']:.1f} | {row['agents_up']:.1f} "
              f"| {row['stage']} |")


if __name__ == "__main__":
    main()
