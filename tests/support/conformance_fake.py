"""The fake cloud in the conformance suite: the remote-node wing with no AWS at all.

Its machines are local processes (:mod:`support.fake_provider`) running the real node
bootstrap over :mod:`support.fake_node_host`; the store is a local folder. A second cloud
is this: one provider, one node host, one case. :class:`FakeEnvCase` runs what EC2 runs on a bare
image: the driver ships its environment, each machine's stage builds or reuses the venv and starts
the node host in it.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from support.conformance import control_files
from support.fake_node_host import secret_path
from support.fake_provider import FakeCompute, FakeEnvCompute, FakeProvider
from support.processes import job_processes

from prefect_sgpu.protocol import jobfolder

HEARTBEAT_TTL_S = 10.0


class FakeCase:
    """Machines of the fake cloud, one job's own."""

    name = "fake"

    def __init__(self, workdir: Path, rendezvous_port: int, keep_warm: float = 0.0) -> None:
        self.provider = FakeProvider(workdir / "cloud", workdir / "store", HEARTBEAT_TTL_S)
        self.compute = FakeCompute(self.provider, rendezvous_port=rendezvous_port, keep_warm=keep_warm)

    def options(self, **overrides: Any) -> dict[str, Any]:
        return {"gpus": 2, "gpu_type": "A10", "remote": True, "mlflow": False, "compute": self.compute,
                **overrides}

    def launched_for(self, job: Any) -> str:
        return str(job.run_id)

    def leftovers(self, run_id: str) -> list[str]:
        left = [f"machine {m.id} of {m.launch_id}" for m in self.provider.machines.values()
                if m.launch_id == run_id and m.proc.poll() is None]
        # a warm lease's machines carry the lease id, which starts with the run id that launched it
        left += [p for p in job_processes(run_id) if f"--run-id={run_id}-lease" not in p]
        left += [f"secret {name}" for name in (jobfolder.ssm_key_parameter(run_id, self.compute.store.scope),
                                               jobfolder.ssm_secrets_parameter(run_id, self.compute.store.scope))
                 if secret_path(self.provider.secrets, name).exists()]
        return left + control_files(self.provider.store_root / run_id)

    def leave_behind(self, run_id: str, dead: bool) -> None:
        """A machine that never boots, the run's key as a secret, a job folder; a dead run's files
        dated back ten TTLs (the local store's clock is its files' mtimes)."""
        self.provider.boot = False
        try:
            self.provider.provision(run_id, 1, False, threading.Event())
        finally:
            self.provider.boot = True
        store = self.compute.store
        self.provider.put_secret(jobfolder.ssm_key_parameter(run_id, store.scope), jobfolder.new_key(), "a job's key")
        folder = jobfolder.JobFolder(store, run_id, jobfolder.new_key())
        folder.put_payload(b"payload")
        folder.beat()
        if dead:
            then = time.time() - 10 * HEARTBEAT_TTL_S
            for path in (store.root / run_id).rglob("*"):
                os.utime(path, (then, then))

    @contextmanager
    def stalled_acquire(self) -> Iterator[None]:
        """Machines start, but none boots the node half: acquire waits for agents that never come."""
        self.provider.boot = False
        try:
            yield
        finally:
            self.provider.boot = True

    def check_sent(self, job: Any, shown: dict[str, Any]) -> None:
        """What dry_run showed is what the nodes read: the shape provisioned, each node's sealed command."""
        plan = shown["plan"]
        nodes = plan["nodes"] if isinstance(plan, dict) else plan.nodes
        assert (self.launched_for(job), nodes) in self.provider.sent
        sent = self.compute.sent_launches[job.run_id]
        allocation = job.allocation
        endpoint = next(a.split("=", 1)[1] for a in sent[0] if a.startswith("--rdzv-endpoint="))
        places = {"<node-0>:<port>": endpoint, **{f"<node-{n.index}>": n.address for n in allocation.nodes}}
        expected = [[places.get(arg.split("=", 1)[1], arg.split("=", 1)[1]).join([arg.split("=", 1)[0] + "=", ""])
                     if "=<node-" in arg else arg for arg in shlex.split(n["command"])] for n in shown["nodes"]]
        assert [sent[i] for i in sorted(sent)] == expected

    def close(self) -> None:
        self.compute.close()
        self.provider.close()


class FakeWarmCase(FakeCase):
    """The fake cloud's machines kept as a warm lease between jobs; the lease ends when the case closes."""

    name = "fake_warm"

    def __init__(self, workdir: Path, rendezvous_port: int) -> None:
        super().__init__(workdir, rendezvous_port, keep_warm=60)

    def launched_for(self, job: Any) -> str:
        from prefect_sgpu.compute.remote.lease import lease_id

        return lease_id(job.run_id)

    def check_sent(self, job: Any, shown: dict[str, Any]) -> None:
        assert shown["keep_warm"] == 60
        super().check_sent(job, shown)

    def close(self) -> None:
        """End every lease: nothing of any is left (machines, keys, control files)."""
        self.compute.close()
        leases = {m.launch_id for m in self.provider.machines.values()}
        left = {lease: self.leftovers(lease) for lease in sorted(leases)}
        self.provider.close()
        assert not any(left.values()), f"what the case's leases left: {left}"


class FakeEnvCase(FakeCase):
    """The fake cloud shipping the driver's environment: its machines are bare images that boot through the
    real environment stage over the fake transport, with one venv folder (``env_root``) for every machine
    of the session, as the EC2 ``bare`` fixture has (a venv build costs a minute: later jobs reuse it)."""

    name = "fake_env"

    def __init__(self, workdir: Path, rendezvous_port: int, env_root: Path) -> None:
        self.env_root = env_root
        self.provider = FakeProvider(workdir / "cloud", workdir / "store", HEARTBEAT_TTL_S, env_root=env_root)
        self.compute = FakeEnvCompute(self.provider, rendezvous_port=rendezvous_port)

    def options(self, **overrides: Any) -> dict[str, Any]:
        """The driver's own modules stay out: a test worker's set of them grows with every test module it
        imports, and each set would be a new venv to build (tests/test_environment.py proves them)."""
        return super().options(**{"environment": {"auto_modules": False}, **overrides})

    def venv(self, job: Any) -> Path:
        """Where the machines' stage keeps the venv of ``job``'s environment."""
        return self.env_root / f"{job.spec.environment.digest}-{sys.platform}-{platform.machine()}"

    def check_sent(self, job: Any, shown: dict[str, Any]) -> None:
        """As the fake cloud's, and: the environment is in the store by its manifest, and every machine's
        stage built or reused the job's venv, then started the node host in it."""
        from prefect_sgpu.environment import ship as environment_ship

        super().check_sent(job, shown)
        environment = job.spec.environment
        manifest = f"{environment.digest}/manifest-{environment_ship.manifest_sha256(environment)}.json"
        assert self.compute.store.get(environment_ship.STORE_FOLDER, manifest), manifest
        assert (self.venv(job) / ".complete").exists(), sorted(p.name for p in self.env_root.iterdir())
        consoles = [(m.home / "console.log").read_text(errors="replace")
                    for m in self.provider.machines.values() if m.launch_id == self.launched_for(job)]
        assert consoles and all(f"environment {environment.digest[:16]} at {self.venv(job)}" in c
                                for c in consoles), consoles
