"""A fake cloud for the remote-node wing: its machines are local processes, and no AWS is involved.

:class:`FakeProvider` implements :class:`prefect_sgpu.compute.remote.provider.Provider` (machine
states, terminate, secrets, cost, and the leftovers a sweeper finds and removes); :class:`FakeCompute` is the whole of a cloud's compute on
top of :class:`~prefect_sgpu.compute.remote.nodes.RemoteNodeCompute`: it plans a request and
boots machines. Each machine runs :mod:`support.fake_node_host` (the real node bootstrap over
a local job store). With ``env_root`` the fake cloud ships the driver's environment as EC2 does
(:class:`FakeEnvCompute`): its machines are bare images that boot through the real environment
stage (:mod:`prefect_sgpu.launch.node_env` over :mod:`support.fake_stage`), which builds or reuses
a venv under ``env_root`` and starts the node host in it. With
:class:`support.fake_node_host.FakeNodeHost` and the conformance case in
:mod:`support.conformance_fake`, this is what adding a cloud takes.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.ec2_simulator import bare_image, pid_namespaces
from support.fake_node_host import secret_path
from support.processes import remove_machine_cgroups, wait_gone

from prefect_sgpu.environment import Environment
from prefect_sgpu.environment import ship as environment_ship
from prefect_sgpu.launch import node_env
from prefect_sgpu.protocol import jobfolder
from prefect_sgpu.compute.remote.nodes import RemoteAllocation, RemoteNodeCompute, RemoteRequest
from prefect_sgpu.compute.remote.provider import CloudLeftover, LeftoverScan
from prefect_sgpu.compute.remote.sweep import Sweeper
from prefect_sgpu.errors import JobCancelled, LaunchTimeout
from prefect_sgpu.spec import JobSpec, plan_remote
from prefect_sgpu.store import LocalStore

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS = REPO_ROOT / "tests"


@dataclass
class FakeMachine:
    id: str
    private_ip: str
    launch_id: str
    index: int
    proc: subprocess.Popen[bytes]
    home: Path


@dataclass
class FakeProvider:
    """Machines are processes under ``workdir``; secrets are files in ``workdir/secrets`` (0600)."""

    workdir: Path
    store_root: Path
    heartbeat_ttl_s: float
    #: False: machines start but never boot the node half (a stalled acquire)
    boot: bool = True
    #: an image whose node half cannot start: the machine prints this and powers off
    broken_image: str = ""
    #: what the machines' image has in place of the driver's versions (``prefect_sgpu.protocol.versions``)
    image_versions: dict[str, str] = field(default_factory=dict)
    #: where the machines' environment stage keeps the venvs it builds (one disk for every machine, as a
    #: machine keeps its venvs across boots); None: the machines run in the driver's own venv
    env_root: Path | None = None
    machines: dict[str, FakeMachine] = field(default_factory=dict)
    #: what each provision was asked for: (launch id, nodes)
    sent: list[tuple[str, int]] = field(default_factory=list)
    dead_states: tuple[str, ...] = ("terminated",)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        # each machine its own loopback address (all of 127.0.0.0/8 is local on Linux), as each VM
        # has its own: node 0 hosts the rendezvous on its address, and only node 0 may take it
        octet = 64 + int.from_bytes(os.urandom(1), "big") % 128
        self.addresses = (f"127.{octet}.{n // 250}.{n % 250 + 2}" for n in itertools.count())
        self.secrets = self.workdir / "secrets"
        self.secrets.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.namespaces = pid_namespaces()  # a machine ends as a whole, as a terminated VM does

    def provision(self, launch_id: str, nodes: int, lease: bool, cancel: threading.Event,
                  gang: int = 0, environment: Environment | None = None) -> list[FakeMachine]:
        """``gang``: which gang of its job a cold machine serves (its boot arguments say, as EC2's
        user-data does); ``environment``: the job's, built by each machine's stage when it builds on
        the node and this cloud has ``env_root``."""
        self.sent.append((launch_id, nodes))
        booted = []
        for index in range(nodes):
            if cancel.is_set():
                raise JobCancelled(f"{launch_id} was cancelled while its machines started")
            booted.append(self._boot(launch_id, index, lease, gang, environment))
        return booted

    def _boot(self, launch_id: str, index: int, lease: bool, gang: int = 0,
              environment: Environment | None = None) -> FakeMachine:
        machine_id, address = f"fake-{uuid.uuid4().hex[:12]}", next(self.addresses)
        home = self.workdir / machine_id
        home.mkdir(parents=True)
        argv = [sys.executable, "-m", "support.fake_node_host", f"--store={self.store_root}",
                f"--run-id={launch_id}", f"--machine-id={machine_id}", f"--index={index}", f"--address={address}",
                f"--secrets={self.secrets}", f"--node-dir={home / 'jobs'}", f"--machine-dir={home}",
                f"--heartbeat-ttl={self.heartbeat_ttl_s:g}", *(["--lease"] if lease else []),
                *([f"--gang={gang}"] if gang else [])]
        staged = (self.boot and not self.broken_image and self.env_root is not None
                  and environment_ship.builds_on_node(environment))
        if not self.boot:
            argv = [sys.executable, "-c", "import time; time.sleep(3600)"]  # up, but never announces itself
        elif self.broken_image:
            argv = [sys.executable, "-c", f"import sys; print({self.broken_image!r}); sys.exit(1)"]
        elif staged:
            assert environment is not None
            argv = [*self._stage_argv(home, launch_id, machine_id, index, environment), "--", *argv[1:]]
        env = {
            "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
            "PYTHONPATH": f"{REPO_ROOT}:{TESTS}",
            "HOME": str(home), "LANG": "C.UTF-8",
            "PREFECT_SGPU_HOME": str(home / "sgpu-home"),
            "SGPU_DEVICE": "cpu", "PREFECT_SGPU_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        if os.environ.get("TORCH_EXTENSIONS_DIR"):
            env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
        if self.image_versions:
            env["SGPU_FAKE_IMAGE_VERSIONS"] = json.dumps(self.image_versions)
        if staged:
            env.update(self._bare_env())
        if self.namespaces:
            argv = [shutil.which("unshare") or "unshare", "--pid", "--fork", "--kill-child=SIGKILL",
                    "--mount-proc", "--", *argv]
        with open(home / "console.log", "ab") as out:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=home)
        machine = FakeMachine(machine_id, address, launch_id, index, proc, home)
        with self._lock:
            self.machines[machine_id] = machine
        return machine

    def _stage_argv(self, home: Path, launch_id: str, machine_id: str, index: int,
                    environment: Environment) -> list[str]:
        """What EC2's user-data runs first, on this machine: the stage's carried text, written out and run
        by the image's Python over the fake cloud's transport; the node host's arguments follow ``--``."""
        stage = home / "stage"
        stage.mkdir()
        (stage / environment_ship.STAGE_MAIN).write_text(environment_ship.stage_text())
        return [str(bare_image() / "bin" / "python"), str(stage / environment_ship.STAGE_MAIN),
                f"--store={self.store_root}", f"--run-id={launch_id}", f"--environment={environment.digest}",
                f"--manifest={environment_ship.manifest_sha256(environment)}",
                "--transport=support.fake_stage", f"--secrets={self.secrets}", f"--machine-id={machine_id}",
                f"--index={index}"]

    def _bare_env(self) -> dict[str, str]:
        """A bare image's machine, as the EC2 simulator's: the image's Python (pip only) first on ``PATH``, no
        uv (the stage fetches the pinned wheel from a package index on 127.0.0.1, then installs offline from
        uv's cache), and this repository's tests alone on ``PYTHONPATH`` (the fake transport and node host:
        prefect-sgpu comes from the venv the stage builds)."""
        from support.wheel_index import uv_index

        assert self.env_root is not None
        self.env_root.mkdir(parents=True, exist_ok=True)
        return {
            "PATH": f"{bare_image() / 'bin'}:/usr/local/bin:/usr/bin:/bin",
            "PYTHONPATH": str(TESTS),
            "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR") or str(Path.home() / ".cache" / "uv"),
            "UV_OFFLINE": "1", "UV_PYTHON_DOWNLOADS": "never", "UV_NO_PROGRESS": "1",
            node_env.ENV_ROOT_ENV: str(self.env_root),
            node_env.UV_INDEX_ENV: uv_index().url,
        }

    # -- the Provider protocol ----------------------------------------------------------

    def instance_states(self, ids: list[str]) -> dict[str, str]:
        states = {}
        for machine_id in (i for i in ids if i):
            machine = self.machines.get(machine_id)
            states[machine_id] = "running" if machine is not None and machine.proc.poll() is None else "terminated"
        return states

    def terminate(self, launch_id: str) -> list[str]:
        return self.terminate_machines([m.id for m in list(self.machines.values()) if m.launch_id == launch_id])

    def terminate_machines(self, ids: list[str]) -> list[str]:
        gone = []
        for machine in [self.machines[i] for i in ids if i in self.machines]:
            if machine.proc.poll() is None:
                try:
                    os.killpg(machine.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                gone.append(machine.id)
            machine.proc.wait(timeout=30)
            # a terminated VM is gone as a whole: wait for the node host, its namespace's init, too
            wait_gone(f"--machine-id={machine.id}")
            remove_machine_cgroups(machine.id)
        return gone

    def put_secret(self, name: str, value: str, description: str, kms_key_id: str | None = None) -> None:
        path = secret_path(self.secrets, name)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(value)
        os.replace(tmp, path)

    def delete_secret(self, name: str) -> bool:
        path = secret_path(self.secrets, name)
        existed = path.exists()
        path.unlink(missing_ok=True)
        return existed

    def cost(self, instances: list[Any], started: float, ended: float) -> dict[str, Any]:
        hours = len(instances) * max(0.0, ended - started) / 3600
        return {"instance_hours": round(hours, 6), "usd": 0.0}

    def find_leftovers(self, store: Any) -> LeftoverScan:
        """Machines still up and the secrets of runs, all of them this cloud's one store's (the
        machines' store): another store finds nothing. A machine records the provider's TTL."""
        scan = LeftoverScan()
        if store.root_uri != LocalStore(self.store_root).root_uri:
            return scan
        with self._lock:
            machines = list(self.machines.values())
        scan.found += [CloudLeftover(m.launch_id, "machine", "machine", m.id, self.heartbeat_ttl_s)
                       for m in machines if m.proc.poll() is None]
        for path in sorted(self.secrets.iterdir()):
            name = urllib.parse.unquote(path.name)
            run_id = name.removeprefix(jobfolder.ssm_root(store.scope)).split("/")[0]
            if name in (jobfolder.ssm_key_parameter(run_id, store.scope),
                        jobfolder.ssm_secrets_parameter(run_id, store.scope)):
                scan.found.append(CloudLeftover(run_id, "secret", "secret", name))
        return scan

    def remove_leftovers(self, run_id: str, leftovers: list[CloudLeftover], wait: bool = True) -> list[CloudLeftover]:
        gone = set(self.terminate(run_id)) if any(x.category == "machine" for x in leftovers) else set()
        removed = [x for x in leftovers if x.category == "machine" and x.name in gone]
        return removed + [x for x in leftovers if x.category == "secret" and self.delete_secret(x.name)]

    def close(self) -> None:
        for launch_id in {m.launch_id for m in self.machines.values()}:
            self.terminate(launch_id)


class FakeCompute(RemoteNodeCompute):
    """The fake cloud's compute: a local job store the machines share, machines from :class:`FakeProvider`."""

    name = "fake"

    def __init__(self, provider: FakeProvider, *, rendezvous_port: int, keep_warm: float = 0.0,
                 agent_timeout_s: float = 90.0) -> None:
        super().__init__(provider, LocalStore(provider.store_root), agent_timeout_s=agent_timeout_s,
                         rendezvous_port=rendezvous_port, poll_interval_s=0.2, node_silence_s=30.0,
                         keep_warm=keep_warm)
        self.heartbeat_ttl_s = provider.heartbeat_ttl_s
        #: per run, each node's launch document as the nodes read it from the store (sealed, verified)
        self.sent_launches: dict[str, dict[int, list[str]]] = {}

    def start(self, allocation: Any, launch: Any) -> None:
        super().start(allocation, launch)
        read = {n.index: allocation.folder.launch(n.index, instance_id=n.instance_id) for n in allocation.nodes}
        self.sent_launches[allocation.run_id] = {i: list(doc.argv) for i, doc in read.items() if doc is not None}

    def default_store(self) -> LocalStore:
        return self.store

    def sweeper(self, tracking_uri: str | None = None, **options: Any) -> Sweeper:
        """The fake cloud's sweeper: its store, its provider's leftovers, its nodes' TTL."""
        options.setdefault("ttl_s", self.heartbeat_ttl_s)
        return Sweeper(self.store, cloud=self.provisioner, tracking_uri=tracking_uri, **options)

    def plan(self, spec: JobSpec, run_id: str) -> RemoteRequest:
        from prefect_sgpu.compute.remote.lease import lease_id

        return RemoteRequest(run_id=run_id, compute=self.name, plan=plan_remote(spec), spec=spec,
                             heartbeat_ttl_s=self.heartbeat_ttl_s, agent_timeout_s=self.agent_timeout_s,
                             keep_warm=self.keep_warm, lease_id=lease_id(run_id) if self.keep_warm > 0 else "")

    def replan(self, request: Any, gang: int) -> RemoteRequest:
        from dataclasses import replace

        from prefect_sgpu.compute.remote.lease import lease_id

        return replace(request, lease_id=lease_id(request.run_id, gang)) if request.lease_id else request

    def _provision(self, allocation: RemoteAllocation, launch_id: str, deadline: float,
                   cancel: threading.Event) -> list[Any]:
        request = allocation.request
        if time.monotonic() >= deadline:
            raise LaunchTimeout(request.run_id, request.spec.timeout, phase="provisioning")
        gang = 0 if request.lease_id else allocation.folder.gang  # a lease's assignment names the gang
        return self.provisioner.provision(launch_id, request.plan.nodes, bool(request.lease_id), cancel, gang,
                                          request.spec.environment)

    #: a lost node's machine is replaced alone, the others kept (as on EC2)
    replaces_nodes = True

    def _provision_node(self, allocation: RemoteAllocation, node: int, deadline: float,
                        cancel: threading.Event) -> Any:
        lease = allocation.lease
        environment = allocation.request.spec.environment
        self.provisioner.sent.append((lease.lease_id if lease else allocation.run_id, 1))
        if lease is not None:  # the lease's assignment names the gang
            return self.provisioner._boot(lease.lease_id, node, True, environment=environment)
        return self.provisioner._boot(allocation.run_id, node, False, allocation.folder.gang, environment)

    def _console_output(self, machine_id: str) -> str:
        machine = self.provisioner.machines.get(machine_id)
        log = machine.home / "console.log" if machine is not None else None
        return log.read_text(errors="replace") if log is not None and log.exists() else ""

    def _lease_key(self, request: Any) -> tuple[Any, ...]:
        return ("fake", str(self.store.root_uri), request.plan.nodes, request.plan.procs_per_node)


class FakeEnvCompute(FakeCompute):
    """The fake cloud shipping the driver's environment, as EC2 does: the driver uploads its manifest and
    files to the store, each machine's stage builds (or reuses) the venv under the provider's ``env_root``."""

    ships_environment = True

    def __init__(self, provider: FakeProvider, *, rendezvous_port: int, keep_warm: float = 0.0,
                 agent_timeout_s: float = 600.0) -> None:
        if provider.env_root is None:
            raise ValueError("a cloud that ships the environment needs its machines' env_root")
        super().__init__(provider, rendezvous_port=rendezvous_port, keep_warm=keep_warm,
                         agent_timeout_s=agent_timeout_s)
