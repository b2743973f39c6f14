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

Functions that call Ray Train's own API (``ray.train.report``, ``prepare_model``) need a
Ray Train run: leave ``keep_warm`` at 0 for them.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any

from prefect_sgpu.compute.warm_pool import Pooled, WarmPool

#: what each actor's fork server imports once
PRELOAD = ["torch", "torch.distributed", "cloudpickle", "prefect_sgpu.payload", "prefect_sgpu.jobfolder",
           "prefect_sgpu.runtime", "prefect_sgpu.launch.rank_main"]
FORWARD_INTERVAL_S = 0.2
#: a rank's exit code when the job's process group could not be formed (before any rank ran the
#: function): the driver starts the job's ranks again, up to ``SETUP_ATTEMPTS`` times in all
SETUP_FAILED = 75
SETUP_ATTEMPTS = 3


def _noop() -> None:
    return None


def _rank_child(config: dict[str, Any], identity: dict[str, Any], log_path: str, result: Any) -> None:
    """One job's rank, in a process forked from the actor's fork server."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(config["env"])
    os.environ.update({k: str(v) for k, v in identity["env"].items()})
    os.chdir(identity["cwd"])
    import torch.distributed as dist

    from prefect_sgpu import payload, runtime
    from prefect_sgpu.launch.rank_main import apply_thread_count, run_payload

    apply_thread_count()
    # progress reaches the collector through the actor's forwarder, which watches this file
    runtime.add_progress_listener(lambda step: _write_progress(log_path, step))

    base = {k: identity[k] for k in ("rank", "node", "local_rank")} | {"host": socket.gethostname()}
    code = 1
    try:
        try:
            backend = identity["backend"] or ("nccl" if runtime.uses_gpu() else "gloo")
            dist.init_process_group(backend=backend, timeout=runtime.default_timeout(),
                                    **({"device_id": runtime.device()} if backend == "nccl" else {}))
            # every rank is in before any runs the function: a rank that could not join stops the
            # job before the function ran anywhere, so the job may be started again (SETUP_FAILED)
            dist.barrier()
        except BaseException:  # noqa: BLE001 - said in the rank's log, told by the exit code
            traceback.print_exc()
            print(f"rank {identity['rank']}: the process group over {identity['env']['MASTER_ADDR']}:"
                  f"{identity['env']['MASTER_PORT']} could not be formed", file=sys.stderr)
            code = SETUP_FAILED
            return
        with open(f"{log_path}.began", "w"):
            pass
        envelope, code = run_payload(config["payload"], config["key"], config["run_id"], base)
        result.send_bytes(payload.dump_envelope(envelope))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the outcome is already decided
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _write_progress(log_path: str, step: int | None) -> None:
    tmp = f"{log_path}.progress.tmp"
    with open(tmp, "w") as fh:
        fh.write("" if step is None else str(step))
    os.replace(tmp, f"{log_path}.progress")


class WarmRank:
    """One rank's long-lived Ray actor: a fork server with torch imported, a child per job."""

    def __init__(self, preload: list[str]) -> None:
        import multiprocessing as mp
        import tempfile

        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(preload)
        started = self.ctx.Process(target=_noop)  # start the fork server now, not in the first job
        started.start()
        started.join()
        self.folder = tempfile.mkdtemp(prefix="sgpu-warm-rank-")
        self.child: Any = None
        self.lock = threading.Lock()
        #: whether the last job's rank got as far as running the function
        self.began = False

    def where(self) -> tuple[str, str]:
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def free_port(self) -> int:
        """A port for the job's c10d store on this actor's node: outside the ephemeral range and reserved
        machine-wide (:mod:`prefect_sgpu.compute.ports`). A port from binding port 0 can be taken by any
        outgoing connection (a rank's gloo socket) before the store binds it, and two groups could be
        handed the same one."""
        import ray

        from prefect_sgpu.compute.ports import free_port

        return free_port(ray.util.get_node_ip_address())

    def run(self, config: dict[str, Any], identity: dict[str, Any], collector: Any) -> int:
        """Run one job's rank to its end; its output goes to ``collector`` as it comes, its envelope last."""
        import ray

        rank = identity["rank"]
        log_path = os.path.join(self.folder, f"{config['run_id']}-rank-{rank}.log")
        self.began = False
        receive, send = self.ctx.Pipe(duplex=False)
        with self.lock:
            self.child = self.ctx.Process(target=_rank_child, args=(config, identity, log_path, send), daemon=False)
            self.child.start()
        send.close()
        forwarder = _Forwarder(log_path, collector, rank, identity["node"])
        forwarder.start()
        body = None
        try:
            while self.child.is_alive() or receive.poll():
                if receive.poll(0.1):
                    try:
                        body = receive.recv_bytes()
                    except EOFError:
                        break
            self.child.join()
        finally:
            forwarder.stop()
        if body is not None:
            ray.get(collector.put_result.remote(rank, body))
        code = self.child.exitcode
        self.began = os.path.exists(f"{log_path}.began")
        with self.lock:
            self.child = None
        for leftover in (log_path, f"{log_path}.progress", f"{log_path}.began"):
            try:
                os.unlink(leftover)
            except OSError:
                pass
        return 0 if body is not None and code == 0 else (code or 1)

    def ran_function(self) -> bool:
        """Whether the last job's rank process got as far as the function (past the process group)."""
        return self.began

    def busy(self) -> bool:
        """Whether a job's rank process runs here."""
        with self.lock:
            return self.child is not None and self.child.is_alive()

    def stop(self, grace: float) -> None:
        """Stop the running job's rank: SIGTERM, SIGKILL after ``grace``."""
        with self.lock:
            child = self.child
        if child is None or not child.is_alive():
            return
        child.terminate()
        child.join(grace)
        if child.is_alive():
            child.kill()
            child.join(10)


class _Forwarder:
    """Send the lines a rank's log gains to the job's collector, every ``FORWARD_INTERVAL_S``."""

    def __init__(self, path: str, collector: Any, rank: int, node: int) -> None:
        self.path, self.collector, self.rank, self.node = path, collector, rank, node
        self.offset = 0
        self.partial = b""
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.last: Any = None
        self.progress_mtime = 0.0

    def start(self) -> None:
        self.collector.alive.remote(self.rank)  # started: the hang watchdog counts from here
        self.thread.start()

    def _loop(self) -> None:
        while not self.done.wait(FORWARD_INTERVAL_S):
            self._send()

    def _send(self, final: bool = False) -> None:
        try:
            progress = f"{self.path}.progress"
            mtime = os.stat(progress).st_mtime
            if mtime != self.progress_mtime:
                self.progress_mtime = mtime
                with open(progress) as fh:
                    step = fh.read().strip()
                self.collector.alive.remote(self.rank, int(step) if step.isdigit() else None)
        except OSError:
            pass
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        if final and self.partial:
            lines, self.partial = [*lines, self.partial], b""
        if lines:
            self.last = self.collector.put_lines.remote(
                [(self.rank, self.node, raw.decode("utf-8", "replace").rstrip("\r")) for raw in lines])

    def stop(self) -> None:
        import ray

        self.done.set()
        self.thread.join(timeout=10)
        self._send(final=True)
        if self.last is not None:
            ray.get(self.last)


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
