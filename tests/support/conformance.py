"""What the compute conformance suite needs from each compute: one ``ComputeCase`` per compute.

A case says how to run a job on its compute with ``@distributed`` (``options``), what a
job may have left behind (``leftovers``: processes, instances, groups, parameters, Ray
actors, control files), how to make ``acquire`` wait (``stalled_acquire``, for the
timeout and cancel behaviours during acquire; None when acquire never waits), how to
check that what ``dry_run`` showed is what was sent (``check_sent``), and, for a compute with a
cloud, what a driver killed mid-run leaves there for the sweeper (``leave_behind``).
Adding a compute means writing one case and listing it in ``tests/compute/conftest.py``.
"""

from __future__ import annotations

import os
import shlex
import tempfile
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from support.processes import job_processes

#: the computes the suite runs against (fixtures ``<name>_case`` in tests/compute/conftest.py)
CASES = ["local", "local_spawn", "local_warm", "ray", "ray_warm", "ec2", "ec2_warm", "fake", "fake_warm"]
#: those whose acquire can be made to wait (timeout and cancel during acquire)
STALLABLE: list[str] = ["local", "local_warm", "ray", "ray_warm", "ec2", "ec2_warm", "fake", "fake_warm"]
#: those with a cloud whose leftovers the sweeper removes through the provider (``leave_behind``)
SWEEPABLE: list[str] = ["fake", "ec2"]
#: those whose machines build the driver's shipped environment in a venv of their own (``env_root``,
#: ``venv``): a build costs a minute or more, so they join only the values test and the environment's own
ENVIRONMENT_SHIPPING: list[str] = ["fake_env"]


class ComputeCase(Protocol):
    name: str

    def options(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments for ``@distributed`` (resources, compute, store) on this compute."""

    def leftovers(self, run_id: str) -> list[str]:
        """Everything of job ``run_id`` that still exists and should not: empty after every outcome."""

    stalled_acquire: Callable[[], AbstractContextManager[None]] | None

    def check_sent(self, job: Any, shown: dict[str, Any]) -> None:
        """Assert that what ``job.dry_run()`` showed (``shown``) is what the compute sent."""


class SweepableCase(ComputeCase, Protocol):
    def leave_behind(self, run_id: str, dead: bool) -> None:
        """What a driver killed mid-run leaves of ``run_id``: a machine up, its key in the cloud's
        secrets, a job folder with payload and heartbeat; ``dead``: that heartbeat past the run's TTL
        and grace when this returns, else fresh."""


class EnvironmentShippingCase(ComputeCase, Protocol):
    #: the folder the machines' environment stage keeps its venvs in
    env_root: Path

    def venv(self, job: Any) -> Path:
        """The venv the machines' stage built (or reused) for ``job``'s environment."""


def control_files(store_uri_of_job: Path) -> list[str]:
    """Control files left in a local job folder (logs, agent output and checkpoints may stay)."""
    from prefect_sgpu.protocol import jobfolder

    left = []
    for name in jobfolder.CONTROL:
        path = store_uri_of_job / name
        if path.exists() and (path.is_file() or any(path.iterdir())):
            left.append(str(path))
    return left


class LocalCase:
    """Local processes: the embedded default."""

    name = "local"

    def options(self, **overrides: Any) -> dict[str, Any]:
        return {"gpus": 4, "nodes": 2, "mlflow": False, **overrides}

    def leftovers(self, run_id: str) -> list[str]:
        job_dir = Path(os.environ["PREFECT_SGPU_HOME"]) / "jobs" / run_id
        return job_processes(run_id) + control_files(job_dir)

    @contextmanager
    def stalled_acquire(self) -> Iterator[None]:
        """Four fake GPUs, every one leased by someone else: a CUDA job waits for them."""
        from prefect_sgpu.compute import leases

        fake = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "PREFECT_SGPU_DEVICE": "cuda",
                "PREFECT_SGPU_LEASE_DIR": tempfile.mkdtemp(prefix="sgpu-leases-")}
        saved = {key: os.environ.get(key) for key in fake}
        os.environ.update(fake)
        blocker, _ = leases.try_lease(["0", "1", "2", "3"], 4, "someone-else")
        assert blocker is not None
        try:
            yield
            blocker.close()
            after, _ = leases.try_lease(["0", "1", "2", "3"], 4, "check")
            assert after is not None, "the job that waited holds no GPU afterwards"
            after.close()
        finally:
            blocker.close()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def check_sent(self, job: Any, shown: dict[str, Any]) -> None:
        allocation = job.allocation
        sent = [list(allocation.processes[i].args) for i in sorted(allocation.processes)]
        endpoint = next(a.split("=", 1)[1] for a in sent[0] if a.startswith("--rdzv-endpoint="))
        places = {"<node-0>:<port>": endpoint, **{f"<node-{n.index}>": n.address for n in allocation.nodes}}
        expected = [[places.get(arg.split("=", 1)[1], arg.split("=", 1)[1]).join([arg.split("=", 1)[0] + "=", ""])
                     if "=<node-" in arg else arg for arg in shlex.split(n["command"])] for n in shown["nodes"]]
        assert sent == expected


class LocalSpawnCase(LocalCase):
    """Local processes whose ranks are new interpreters (``PREFECT_SGPU_RANK_START=spawn``), as on a
    GPU node: on CPU the agent forks them unless told otherwise."""

    name = "local_spawn"

    def check_sent(self, job: Any, shown: dict[str, Any]) -> None:
        super().check_sent(job, shown)
        assert all("--rank-start=spawn" in shlex.split(n["command"]) for n in shown["nodes"])


def warm_node_descendants() -> list[str]:
    """Processes below this driver's idle warm nodes: what a finished job left on a warm node."""
    import psutil

    from prefect_sgpu.compute.warm_pool import POOL

    found = []
    for warm in POOL.idle():
        for node in warm.nodes:
            try:
                root = psutil.Process(node.pid)
                found += [f"{p.pid}: {' '.join(p.cmdline())}" for p in root.children(recursive=True)
                          if "prefect_sgpu.launch.warm_node" not in " ".join(p.cmdline())
                          and p.status() != psutil.STATUS_ZOMBIE]
            except psutil.Error:
                continue
    return found


class LocalWarmCase(LocalCase):
    """Local processes on warm nodes: each job's agent and ranks forked from a node process
    that outlives the job. Nothing of the job may be left below those nodes."""

    name = "local_warm"

    def __init__(self) -> None:
        from prefect_sgpu.compute.local import LocalProcessCompute

        self.compute = LocalProcessCompute(keep_warm=60)

    def options(self, **overrides: Any) -> dict[str, Any]:
        return super().options(compute=self.compute, **overrides)

    def leftovers(self, run_id: str) -> list[str]:
        return super().leftovers(run_id) + warm_node_descendants()

    def check_sent(self, job: Any, shown: dict[str, Any]) -> None:
        allocation = job.allocation
        assert allocation.warm is None, "released: the warm nodes went back to the pool"
        sent = [allocation.warm_sent[i] for i in sorted(allocation.warm_sent)]
        assert len(sent) == len(shown["nodes"])
        endpoint = next(a.split("=", 1)[1] for a in sent[0] if a.startswith("--rdzv-endpoint="))
        places = {"<node-0>:<port>": endpoint, **{f"<node-{n.index}>": n.address for n in allocation.nodes}}
        for node, args in zip(shown["nodes"], sent):
            words = shlex.split(node["command"])
            agent = words[words.index("prefect_sgpu.launch.node_agent") + 1:]
            agent = [a for a in agent if not a.startswith("--shm-size=")]
            expected = [a.split("=", 1)[0] + "=" + places[a.split("=", 1)[1]] if "=<node-" in a else a for a in agent]
            assert args == expected
        assert shown["keep_warm"] == 60
