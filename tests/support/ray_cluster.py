"""A real two-node Ray cluster on loopback for the Ray tests, and a leftover-process check.

The cluster is started the way an operator would (``ray start --head`` and ``ray start
--address``), through the same ``RayNodeProcess`` the ``@ray_launch`` nodes use, so it
is stopped by pid and never with a host-wide ``ray stop``.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from prefect_sgpu.ray.node_process import RayNodeProcess, RayNodeSpec, free_port

ROOT = Path(__file__).resolve().parents[2]

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DISABLE_DOCKER_CPU_WARNING", "1")
# a plain cluster, as most are run: the same whether or not ~/.ray/auth_token exists
os.environ["RAY_AUTH_MODE"] = "disabled"


@contextmanager
def ray_cluster(cpus_per_node: int = 1, gpus_per_node: int | None = None,
                resources: str | None = None) -> Iterator[str]:
    """A head on 127.0.0.11 and a worker on 127.0.0.12; yields the GCS address."""
    temp = tempfile.mkdtemp(prefix="sgpu-rc-", dir="/tmp")
    port = free_port("127.0.0.11")
    address = f"127.0.0.11:{port}"
    # the cluster's workers import prefect_sgpu (and the tests' modules) from this checkout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")) if p)}
    # a one-host head's setting (prefect_sgpu.ray.node_process.head_env) left in this process's
    # environment by an earlier job would make `ray start` refuse this cluster's second node
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    log = open(Path(temp) / "ray-start.out", "a")  # noqa: SIM115 - closed below
    # no Ray log monitor: ranks' output reaches a job through prefect-sgpu's own collector, and the
    # two monitors (one a node) tailing every worker's log files cost minutes of CPU in a suite
    quiet = ["--include-log-monitor=false"]
    head = RayNodeProcess(RayNodeSpec(node_ip="127.0.0.11", temp_dir=f"{temp}/h", num_cpus=cpus_per_node,
                                      num_gpus=gpus_per_node, gcs_port=port, resources=resources,
                                      object_store_memory=256 << 20, extra_args=quiet), env=env, output=log)
    worker = RayNodeProcess(RayNodeSpec(node_ip="127.0.0.12", temp_dir=f"{temp}/w", num_cpus=cpus_per_node,
                                        num_gpus=gpus_per_node, head_address=address, resources=resources,
                                        object_store_memory=256 << 20, extra_args=quiet), env=env, output=log)
    try:
        head.start(timeout=450, attempts=8)  # a loaded machine (other suites beside it) can need several tries
        worker.start(timeout=450, attempts=8)
        yield address
    finally:
        worker.stop()
        head.stop()
        log.close()


def job_leftovers(run_id: str) -> list[str]:
    """Live processes of a job: its run id in their command line or their environment."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
                continue
            cmd = " ".join(proc.info["cmdline"] or [])
            if run_id in cmd or proc.environ().get("SGPU_RUN_ID") == run_id:
                found.append(f"{proc.pid}: {cmd[:160]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


