"""One rank of a warm worker group, on a Ray worker: the actor that keeps a fork server with
torch imported, and the process it forks for each job's rank.

This is what runs on the cluster's nodes; the driver's side of a warm group (reserving it,
starting a job on it, pooling it) is :mod:`prefect_sgpu.ray.warm_group`, which says what a
warm group is for. Every job's rank is a new process forked from the fork server (which never
runs user code), with a fresh process group, environment, working directory and CUDA context.
Its output lines and sealed envelope reach the driver through the job's collector actor.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import traceback
from typing import Any

#: what each actor's fork server imports once
PRELOAD = ["torch", "torch.distributed", "cloudpickle", "prefect_sgpu.protocol.payload", "prefect_sgpu.protocol.jobfolder",
           "prefect_sgpu.runtime", "prefect_sgpu.launch.rank_main"]
FORWARD_INTERVAL_S = 0.2
#: a rank's exit code when the job's process group could not be formed (before any rank ran the
#: function): the driver starts the job's ranks again (:mod:`prefect_sgpu.ray.warm_group`)
SETUP_FAILED = 75


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

    from prefect_sgpu import runtime
    from prefect_sgpu.protocol import payload
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
