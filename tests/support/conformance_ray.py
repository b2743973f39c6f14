"""The Ray case of the compute conformance suite: a job compute on a real loopback cluster.

One two-node cluster (``tests/support/ray_cluster.py``) serves the whole test session,
since a process joins one Ray cluster; each test gets a fresh case on it.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from prefect_sgpu.ray.compute import RayAllocation, RayTrainCompute, collector_name
from support.conformance import control_files
from support.ray_cluster import job_leftovers

#: seconds Ray may take to finish removing what a released run held (its scheduler frees asynchronously)
SETTLE_S = 20.0


def ray_leftovers(run_id: str) -> list[str]:
    """What Ray still holds for job ``run_id``: its collector, placement groups, busy CPUs.

    The session's cluster runs one job at a time, so any placement group not yet removed
    and any CPU still taken after a job are that job's.
    """
    import ray

    if not ray.is_initialized():
        return []
    found = []
    try:
        ray.get_actor(collector_name(run_id))
        found.append(f"actor {collector_name(run_id)}")
    except ValueError:
        pass
    for pg_id, pg in ray.util.placement_group_table().items():
        if pg.get("state") != "REMOVED":
            found.append(f"placement group {pg_id} ({pg.get('name') or 'unnamed'}, {pg.get('state')})")
    free, total = ray.available_resources().get("CPU", 0.0), ray.cluster_resources().get("CPU", 0.0)
    if free != total:
        found.append(f"{total - free:g} of {total:g} CPUs still taken")
    return found


class RayCase:
    """An existing Ray cluster: each job one Ray Train run, reported as one node."""

    name = "ray"

    def __init__(self, address: str) -> None:
        self.compute = RayTrainCompute(address=address)

    def options(self, **overrides: Any) -> dict[str, Any]:
        return {"gpus": 2, "mlflow": False, "compute": self.compute, **overrides}

    def leftovers(self, run_id: str) -> list[str]:
        job_dir = Path(os.environ["PREFECT_SGPU_HOME"]) / "jobs" / run_id
        deadline = time.monotonic() + SETTLE_S
        while (left := ray_leftovers(run_id)) and time.monotonic() < deadline:
            time.sleep(0.5)
        return job_leftovers(run_id) + left + control_files(job_dir)

    @contextmanager
    def stalled_acquire(self) -> Iterator[None]:
        """Every worker asks for more CPUs than the cluster has, so acquire waits for them."""
        saved = self.compute.resources_per_worker
        self.compute.resources_per_worker = {"CPU": 1000.0}
        try:
            yield
        finally:
            self.compute.resources_per_worker = saved

    def check_sent(self, job: Any, shown: dict[str, Any]) -> None:
        allocation = job.allocation
        assert isinstance(allocation, RayAllocation), "driven through acquire/start/poll/release"
        assert allocation.fit is not None and allocation.released
        sent = allocation.request
        assert sent.scaling == shown["scaling_config"]
        assert (sent.address, sent.runtime_env) == (shown["address"], shown["runtime_env"])


class RayWarmCase(RayCase):
    """The same cluster with a warm worker group: between jobs the group's placement group and
    actors stay (they are the compute's, not the job's), but no rank process of the job may."""

    name = "ray_warm"

    def __init__(self, address: str) -> None:
        self.compute = RayTrainCompute(address=address, keep_warm=120)

    def leftovers(self, run_id: str) -> list[str]:
        import ray

        from prefect_sgpu.ray.warm_group import RAY_POOL

        busy = [f"warm group {g.id} rank {r} still runs a job" for g in RAY_POOL.idle()
                for r, actor in enumerate(g.actors) if ray.get(actor.busy.remote(), timeout=30)]
        RAY_POOL.close(owner=id(self.compute))  # what stays between jobs must go with the group
        return busy + super().leftovers(run_id)

    def check_sent(self, job: Any, shown: dict[str, Any]) -> None:
        allocation = job.allocation
        assert isinstance(allocation, RayAllocation) and allocation.released
        assert allocation.fit is None and allocation.group is None, "ran on the warm group, which went back"
        sent = allocation.request
        assert sent.scaling == shown["scaling_config"] and "warm worker group" in shown["trainer"]
        assert (sent.address, sent.runtime_env) == (shown["address"], shown["runtime_env"])
