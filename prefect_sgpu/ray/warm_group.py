"""A warm worker group on an existing Ray cluster: jobs without per-call Ray Train setup.

A ``RayCompute`` call is one Ray Train run: a controller, a placement group and one actor
per rank are created for it and torn down after it (about 14 s here before the function
runs). With ``keep_warm`` the compute keeps one group for jobs of the same shape instead:
a placement group reserved as Ray Train would reserve it, one long-lived actor per rank
placed in it, and in each actor a ``multiprocessing`` fork server that has imported torch.
A call then only forks one process per rank and runs the function.

Every job's rank is a new process forked from the fork server (which never runs user code):
a fresh process group (initialised for it, as Ray Train would, over the group's own
addresses), environment, working directory and CUDA context. Output lines and the sealed
envelope reach the driver through the job's collector actor, as for a Ray Train run.

This module is the driver's side: reserving a group, starting a job on it, pooling it. What
runs on each worker is :mod:`prefect_sgpu.ray.warm_rank`.

Functions that call Ray Train's own API (``ray.train.report``, ``prepare_model``) need a
Ray Train run: leave ``keep_warm`` at 0 for them.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from prefect_sgpu.compute.warm_pool import Pooled, WarmPool
from prefect_sgpu.ray.warm_rank import PRELOAD, SETUP_FAILED, WarmRank

#: how many times in all a job's ranks start when its process group cannot be formed (``SETUP_FAILED``)
SETUP_ATTEMPTS = 3


@dataclass(kw_only=True)
class WarmGroup(Pooled):
    """A placement group and one warm actor per rank, in rank order, for jobs of one shape."""

    placement_group: Any
    actors: list[Any]
    #: per rank: (node rank, local rank, local world size)
    layout: list[tuple[int, int, int]]
    addresses: list[str]
    runs: list[Any] = field(default_factory=list)
    #: the running job's start (config, collector, backend), kept to start its ranks again
    launch: Any = None

    def healthy(self) -> bool:
        if self.closed:
            return False
        import ray

        try:
            ray.get([a.where.remote() for a in self.actors], timeout=30)
            return True
        except Exception:  # noqa: BLE001 - a dead actor or node: the group is not reused
            return False

    def start(self, config: dict[str, Any], collector: Any, backend: str | None) -> None:
        import ray

        self.launch = (config, collector, backend)
        port = ray.get(self.actors[0].free_port.remote())
        world = len(self.actors)
        self.runs = []
        for rank, actor in enumerate(self.actors):
            node, local, local_world = self.layout[rank]
            identity = {"rank": rank, "node": node, "local_rank": local, "backend": backend, "cwd": os.getcwd(),
                        "env": {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": local,
                                "LOCAL_WORLD_SIZE": local_world, "GROUP_RANK": node, "NODE_RANK": node,
                                "MASTER_ADDR": self.addresses[0], "MASTER_PORT": port}}
            self.runs.append(actor.run.remote(config, identity, collector))

    def outcomes(self) -> tuple[bool, list[str], list[int]]:
        """Whether every rank of the running job ended; what failed, in words; the ranks that ended
        because the process group could not be formed (``SETUP_FAILED``). Nothing waits."""
        import ray

        ready, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        failed: list[str] = []
        setup: list[int] = []
        for rank, ref in enumerate(self.runs):
            if ref not in ready:
                continue
            try:
                code = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the actor died: reported as the run's error
                failed.append(f"rank {rank}'s warm worker: {type(exc).__name__}: {exc}")
                continue
            if code == SETUP_FAILED:
                setup.append(rank)
                failed.append(f"rank {rank} could not join the job's process group (its log says why)")
            elif code and code < 0:
                failed.append(f"rank {rank} was killed by signal {-code}")
            elif code:
                failed.append(f"rank {rank} exited with code {code}")
        return len(ready) == len(self.runs), failed, setup

    def start_again(self) -> bool:
        """Start the job's ranks again after its process group could not be formed; False (nothing
        started) when a rank already ran the function, whose effects a second start would repeat."""
        import ray

        self.stop(0.0)
        if self.closed or any(ray.get([a.ran_function.remote() for a in self.actors], timeout=60)):
            return False
        self.start(*self.launch)
        return True

    def stop(self, grace: float) -> None:
        import ray

        if not self.runs:
            return
        try:
            ray.get([a.stop.remote(grace) for a in self.actors], timeout=grace + 30)
            ray.wait(self.runs, num_returns=len(self.runs), timeout=30)
        except Exception:  # noqa: BLE001 - a group that cannot stop its job is closed, not reused
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        import ray

        if ray.is_initialized():
            _dismantle(self.actors, self.placement_group)


def _dismantle(actors: list[Any], placement_group: Any) -> None:
    """Kill the actors and remove their placement group; what is already gone is fine."""
    import ray

    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already gone
            pass
    try:
        ray.util.remove_placement_group(placement_group)
    except Exception:  # noqa: BLE001 - already gone
        pass


def create_group(key: tuple[Any, ...], scaling: dict[str, Any], runtime_env: dict[str, Any],
                 deadline: float, cancel: threading.Event) -> WarmGroup:
    """Reserve the workers' bundles as Ray Train would and start one warm actor in each; ranks go
    node by node (as Ray Train orders its workers). Nothing is left when this raises."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = dict(scaling["resources_per_worker"])
    if "accelerator_type" in scaling:
        bundle[f"accelerator_type:{scaling['accelerator_type']}"] = 0.001
    count = int(scaling["num_workers"])
    pg = ray.util.placement_group([dict(bundle)] * count, strategy=scaling["placement_strategy"],
                                  name=f"sgpu-warm-{uuid.uuid4().hex[:8]}")
    actors: list[Any] = []
    try:
        while not ray.wait([pg.ready()], timeout=1.0)[0]:
            if cancel.is_set() or time.monotonic() > deadline:
                raise TimeoutError("the warm group's placement group was not ready in time")
        cls = ray.remote(WarmRank)
        gpus = bundle.get("GPU", 0)
        options = {"num_cpus": bundle.get("CPU", 0), "num_gpus": gpus, "max_concurrency": 4,
                   "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")} or None}
        if runtime_env:
            options["runtime_env"] = runtime_env
        for index in range(count):
            actors.append(cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=index), **options).remote(PRELOAD))
        where = ray.get([a.where.remote() for a in actors])
        order = sorted(range(count), key=lambda i: (where[i][0], where[i][1], i))
        actors = [actors[i] for i in order]
        where = [where[i] for i in order]
        nodes: list[tuple[str, str]] = list(dict.fromkeys(where))
        layout = []
        for rank, place in enumerate(where):
            peers = [i for i, w in enumerate(where) if w == place]
            layout.append((nodes.index(place), peers.index(rank), len(peers)))
        return WarmGroup(key=key, placement_group=pg, actors=actors, layout=layout,
                         addresses=[w[0] for w in where])
    except BaseException:
        _dismantle(actors, pg)
        raise


#: this process's idle warm groups (one Ray connection per process)
RAY_POOL = WarmPool()
