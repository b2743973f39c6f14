"""The process torch elastic starts for every rank.

It sends its own stdout/stderr to ``logs/rank-N.log`` in the node's job folder
(the driver tails those files), loads and verifies the payload, runs the user's
function or script, and writes a signed result envelope. The payload key is taken
out of the environment before user code runs.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def _redirect_output(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def _run_script(call: Any) -> int:
    import runpy

    path = Path(call.path)
    if not path.is_file():  # not on this node's disk: run the copy shipped in the payload
        path = Path(os.environ["SGPU_JOB_DIR"]) / "script" / Path(call.path).name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(call.source)
    sys.argv = [str(path), *call.argv]
    sys.path.insert(0, str(path.parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code in (None, 0):
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0


def _watchdog_hooks() -> None:
    """What the node's hang watchdog needs: a first progress mark, and stacks on SIGUSR1."""
    import faulthandler
    import signal

    from prefect_sgpu import runtime

    runtime.progress(force=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


class _CollectiveTimeouts:
    """Give ``torch.distributed``'s default process-group timeouts the job's value, even when user
    code calls ``dist.init_process_group`` itself: patched when that module is first imported."""

    MODULE = "torch.distributed.distributed_c10d"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def apply(self, module: Any) -> None:
        import datetime

        value = datetime.timedelta(seconds=self.seconds)
        module.default_pg_timeout = value
        if getattr(module, "default_pg_nccl_timeout", None) is not None:
            module.default_pg_nccl_timeout = value

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.MODULE:
            return None
        import importlib.machinery

        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, apply = spec.loader, self.apply
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            apply(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def install(self) -> None:
        module = sys.modules.get(self.MODULE)
        if module is not None:
            self.apply(module)
        else:
            sys.meta_path.insert(0, self)


def _connect_ray(address: str) -> None:
    """A ``@ray_launch`` driver starts connected to its job's cluster, as a Databricks notebook is:
    ``ray.cluster_resources()`` and friends work with no ``ray.init()``, and a ``ray.init()`` in the
    function (any arguments) is answered with the existing connection instead of an error."""
    import functools

    import ray

    ray.init(address=address)
    original = ray.init

    @functools.wraps(original)
    def init(*args: Any, **kwargs: Any) -> Any:
        if ray.is_initialized():
            kwargs["ignore_reinit_error"] = True
        return original(*args, **kwargs)

    ray.init = init


def _shutdown_process_group() -> None:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort after the user's code finished
        pass


def _system_metrics(rank: int) -> Any:
    """MLflow's system-metrics monitor for this rank (node id ``rank-N``), or None.

    On when the job's environment turns on MLflow's own switch,
    ``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=true``, and the call has an MLflow run: CPU,
    memory, disk and network (and GPU utilisation and memory where ``nvidia-ml-py`` is
    installed) go to the job's run as ``system/rank-N/...`` every
    ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` seconds (MLflow's default: 10). The switch
    is then taken out of the rank's environment, so a ``mlflow.start_run()`` in user code
    does not start a second monitor.
    """
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not run_id or os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "").strip().lower() not in ("true", "1"):
        return None
    os.environ.pop("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING")
    os.environ["MLFLOW_SYSTEM_METRICS_NODE_ID"] = f"rank-{rank}"
    try:
        monitor = _KeptMonitor(run_id, f"rank-{rank}", os.environ.get("MLFLOW_TRACKING_URI"))
        monitor.start()
        return monitor
    except Exception as exc:  # noqa: BLE001 - metrics must never fail the rank
        print(f"[sgpu] MLflow system metrics are off for rank {rank}: {exc}", file=sys.stderr, flush=True)
        return None


class _KeptMonitor:
    """MLflow's ``SystemMetricsMonitor``, started again after a store error.

    MLflow's monitor loop ends for good the first time it cannot read the run or log a batch
    (a busy SQLite store, a tracking server restarting). Here its loop runs in a thread of
    ours: when it ends while the run is still RUNNING and the rank still works, a new monitor
    resumes after the last logged step, after a pause that doubles up to 30 s. It ends when
    the run ends or ``finish()`` is called.
    """

    def __init__(self, run_id: str, node_id: str, tracking_uri: str | None) -> None:
        import threading

        self.run_id, self.node_id, self.tracking_uri = run_id, node_id, tracking_uri
        self.stop = threading.Event()
        self.current: Any = None
        self.restarts = 0
        self.unlogged: list[Any] = []  # samples a failed monitor could not log
        self.thread = threading.Thread(target=self._keep, name="sgpu-system-metrics", daemon=True)

    def _new(self) -> Any:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(self.run_id, node_id=self.node_id, tracking_uri=self.tracking_uri,
                                       resume_logging=self.restarts > 0)
        monitor._shutdown_event = self.stop  # its loop waits on, and ends with, our stop
        monitor.mlflow_logger.data, self.unlogged = self.unlogged, []
        return monitor

    def start(self) -> None:
        self.current = self._new()  # a monitor that cannot be built at all turns metrics off
        self.thread.start()

    def _keep(self) -> None:
        pause = 1.0
        while not self.stop.is_set():
            try:
                if self.current is None:
                    self.current = self._new()
                self.current.monitor()  # returns on finish(), when the run ends, or on a store error
                if self.stop.is_set() or not self._running():
                    return
            except Exception:  # noqa: BLE001 - a failed restart is tried again
                pass
            self._flush()
            self.current = None
            self.restarts += 1
            if self.stop.wait(pause):
                return
            pause = min(pause * 2, 30.0)

    def _running(self) -> bool:
        from mlflow.tracking import MlflowClient

        try:
            return MlflowClient(self.tracking_uri).get_run(self.run_id).info.status == "RUNNING"
        except Exception:  # noqa: BLE001 - an unreadable store is the error being ridden out
            return True

    def _flush(self) -> None:
        logger = self.current.mlflow_logger if self.current is not None else None
        try:
            if logger is not None and logger.data:
                logger.flush()
        except Exception:  # noqa: BLE001 - kept for the next monitor
            self.unlogged = logger.data[-1000:]

    def finish(self) -> None:
        """Stop sampling and log what was sampled last."""
        self.stop.set()
        self.thread.join(timeout=30)
        monitor = self.current
        if monitor is not None:
            try:
                monitor.mlflow_logger.flush()
            except Exception:  # noqa: BLE001 - the rank's outcome is already decided
                pass


def run_payload(sealed: bytes, key: str, run_id: str, base: dict[str, Any]) -> tuple[Any, int]:
    """Run a rank's call from its sealed payload: the envelope for every outcome, and the exit code.

    The payload is verified (this job's key, this run id) before anything is unpickled.
    ``base`` holds the rank's identity; start and finish times are added. Shared by
    torchrun ranks and Ray Train workers.
    """
    from prefect_sgpu.protocol import jobfolder
    from prefect_sgpu.protocol import payload

    base = {**base, "started": time.time()}
    exit_code = 0
    tracked_run = os.environ.get("MLFLOW_RUN_ID")  # MLflow unsets it when user code resumes the run
    monitor = _system_metrics(int(base.get("rank", 0)))
    try:
        call = payload.load(jobfolder.unseal(sealed, key, "payload", run_id, what=jobfolder.PAYLOAD))
        if os.environ.get("SGPU_RAY_ADDRESS"):  # the driver of a @ray_launch job
            _connect_ray(os.environ["SGPU_RAY_ADDRESS"])
        if isinstance(call, payload.ScriptCall):
            exit_code = _run_script(call)
            if exit_code:
                raise SystemExit(exit_code)
            value = None
        else:
            value = call.fn(*call.args, **call.kwargs)
        _finish_background_checkpoints()
        base["finished"] = time.time()
        envelope = payload.success_envelope(base, value)
        if not envelope.ok:
            print(envelope.exc_message, file=sys.stderr)
            exit_code = 1
    except BaseException as exc:  # noqa: BLE001 - every outcome gets an envelope
        base["finished"] = time.time()
        tb = traceback.format_exc()
        if isinstance(exc, SystemExit) and isinstance(exc.code, int):
            exit_code = exc.code or 1
        else:
            exit_code = 1
            traceback.print_exc()
        envelope = payload.failure_envelope(base, exc, tb, exit_code)
    finally:
        if monitor is not None:
            try:
                monitor.finish()  # logs what it sampled last
            except Exception:  # noqa: BLE001 - the rank's outcome is already decided
                pass
        _leave_tracked_run(tracked_run)
    return envelope, exit_code


def _leave_tracked_run(run_id: str | None) -> None:
    """Leave the job's MLflow run open for the driver to end.

    MLflow's fluent API makes a run it resumes from ``MLFLOW_RUN_ID`` (any ``mlflow.log_*`` in
    user code does) the process's active run, and ends it FINISHED when the process exits.
    One run is shared by every rank, so the first rank to finish would mark it finished while
    the others still train, and their system-metrics monitors, which stop at a run that is not
    RUNNING, would log nothing more. Here the run is taken off the rank's active runs with its
    status left RUNNING; the driver ends it once every rank is done, with the job's outcome.
    Runs the user's code started itself are left to MLflow.
    """
    mlflow = sys.modules.get("mlflow")
    if not run_id or mlflow is None:
        return
    try:
        active = mlflow.active_run()
        if active is not None and active.info.run_id == run_id:
            mlflow.end_run(status="RUNNING")
    except Exception as exc:  # noqa: BLE001 - the rank's outcome is already decided
        print(f"[sgpu] could not leave the MLflow run {run_id} open: {exc}", file=sys.stderr, flush=True)


def main() -> int:
    from prefect_sgpu.protocol import jobfolder
    from prefect_sgpu.observe import mlflow_relay
    from prefect_sgpu.protocol import payload, rank_progress

    from prefect_sgpu.store import process_request_counts

    requests_before = process_request_counts()  # a forked rank's parent's stores are not this job's
    key = os.environ.pop("SGPU_PAYLOAD_KEY")
    mlflow_relay.arm(key)  # relayed MLflow records are sealed (with a key derived from this one)
    rank_progress.arm(key)  # so are progress files (runtime.progress), with a key of their own
    folder = jobfolder.JobFolder.local(os.environ["SGPU_JOB_DIR"], key)
    folder.gang = int(os.environ.get(jobfolder.GANG_ENV) or 0)  # the result is bound to this gang
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    node = int(os.environ.get("GROUP_RANK", 0))
    _redirect_output(folder.path(jobfolder.log_key(rank)))
    _watchdog_hooks()
    from prefect_sgpu.runtime import default_timeout

    _CollectiveTimeouts(default_timeout().total_seconds()).install()

    from prefect_sgpu.launch import nccl_env

    nccl_env.apply()  # an EFA node: NCCL told to use EFA, before any communicator exists
    base = {"rank": rank, "node": node, "local_rank": local_rank, "host": socket.gethostname(),
            "world_size": int(os.environ.get("WORLD_SIZE") or 0)}
    checked = _gang_check(base)
    if isinstance(checked, payload.Envelope):  # the check failed: the function does not run
        envelope, exit_code = checked, checked.exit_code
    else:
        sealed = folder.store.get(folder.run_id, jobfolder.PAYLOAD) or b""
        envelope, exit_code = run_payload(sealed, key, folder.run_id, {**base, **checked})
    folder.put_result(rank, payload.dump_envelope(envelope))
    _report_requests(rank, requests_before)
    _mark_finished(rank)
    _shutdown_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    return exit_code


def _gang_check(base: dict[str, Any]) -> Any:
    """Run the job's gang check (:mod:`prefect_sgpu.observe.gang_check`) where it is on: what the envelope
    carries from it (rank 0: the report), or the failure envelope that ends this rank."""
    from prefect_sgpu.observe import gang_check
    from prefect_sgpu.protocol import payload

    started = time.time()
    try:
        report = gang_check.run_if_enabled()
    except BaseException as exc:  # noqa: BLE001 - every outcome gets an envelope
        print(f"[sgpu] {exc}", file=sys.stderr, flush=True)
        return payload.failure_envelope({**base, "started": started, "finished": time.time()}, exc,
                                        traceback.format_exc(), 1)
    return {"gang_check": report} if report is not None else {}


def _report_requests(rank: int, before: dict[str, int]) -> None:
    """What this rank's own object stores (checkpoints, shard sets) sent during the job, left for its node to
    report with its own (:mod:`prefect_sgpu.protocol.node_requests`); a cost figure, never the rank's failure."""
    from prefect_sgpu.store import process_request_counts

    job_dir = os.environ.get("SGPU_JOB_DIR")
    mine = {k: n - before.get(k, 0) for k, n in process_request_counts().items() if n > before.get(k, 0)}
    if job_dir and mine:  # only a store that counts (S3) has any: no import for the rest
        from prefect_sgpu.protocol import node_requests

        try:
            node_requests.write_rank(Path(job_dir), rank, mine)
        except OSError as exc:
            print(f"[sgpu] this rank's S3 request counts are not reported: {exc}", file=sys.stderr, flush=True)


def _mark_finished(rank: int) -> None:
    """Tell this node's hang watchdog that this rank (this pid) is done with the job's function."""
    from prefect_sgpu.runtime import finished_marker

    job_dir = os.environ.get("SGPU_JOB_DIR")
    if not job_dir:
        return
    marker = finished_marker(Path(job_dir), rank)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_name(f".{marker.name}.{os.getpid()}")
        tmp.write_text(f"{os.getpid()}\n")
        os.replace(tmp, marker)
    except OSError:
        pass  # a job folder that is gone: nothing is watching


def apply_thread_count() -> None:
    """Give torch the job's ``OMP_NUM_THREADS`` in a rank forked from a process that imported torch
    before the job's environment existed (a cold rank reads it when it imports torch)."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def forked_rank() -> None:
    """A rank forked from a warm node's agent (torch elastic's ``fork`` start method).

    The warm node imported torch before the job's environment existed: the thread count
    is set from the job's ``OMP_NUM_THREADS`` here. Exit handlers registered during the job
    (MLflow's flush) run as in a cold rank; a failed rank leaves with its exit code, which
    torch elastic reports as it does for a cold one.
    """
    import atexit

    from prefect_sgpu.launch.rendezvous import close_hosted_sockets

    _default_stop_signals()
    close_hosted_sockets()
    apply_thread_count()
    code = main()
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if code:
        os._exit(code)


def _finish_background_checkpoints() -> None:
    """A ``Checkpointer(async_save=True)`` save still under way when the function returned ends
    before the rank does (its failure fails the rank): the last checkpoint is complete, not lost
    with the process."""
    if "prefect_sgpu.pipeline.async_save" in sys.modules:
        from prefect_sgpu.pipeline import async_save

        async_save.wait_all()


def _default_stop_signals() -> None:
    """Give a forked rank the stop signals' dispositions a new interpreter has.

    A fork inherits its agent's handlers: torch elastic's turns SIGTERM into a
    ``SignalException`` raised inside the user's code, so a rank the agent stops (because
    another rank died) would end with an error of its own, reported as if it had failed
    first. Like a spawned rank, a forked one dies of the signal.
    """
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _exit(code: int) -> None:
    """Leave without the interpreter's teardown.

    The outcome is already in the envelope. Python's own atexit handlers still run
    (MLflow flushes queued metrics there), but C++ destructors of libraries' background
    threads (gloo, NCCL watchdogs) sometimes abort a process that finished fine
    ("terminate called without an active exception"), which would turn a good rank
    into a failed one.
    """
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    _exit(main())
