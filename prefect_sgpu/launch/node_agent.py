"""The program every node runs: torch elastic's agent around the rank entry point.

Locally it is started by :class:`~prefect_sgpu.compute.local.LocalProcessCompute` (in its
own PID and mount namespace when possible); on a VM the bootstrap starts it. It
joins the c10d rendezvous hosted by node 0 (on node 0's address only, under an id derived
from the job key and its gang: :mod:`prefect_sgpu.launch.rendezvous`), lets torch elastic start and watch the
ranks, writes its sealed ``NodeStatus`` with each failed rank's exit code, and stops
everything when the driver's heartbeat stops changing (the driver died).

The job key comes in ``SGPU_PAYLOAD_KEY`` (the local compute's environment, or the EC2
bootstrap, which reads it from SSM): with it the agent verifies the heartbeat and
seals its status; the ranks verify the payload and seal their envelopes.
"""

from __future__ import annotations

import argparse
import inspect
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

#: stands for "no NUMA binding" while a LaunchConfig is built without asking torch about CUDA
_NO_NUMA_QUERY = object()

if TYPE_CHECKING:
    from prefect_sgpu.protocol.jobfolder import JobFolder


class StopNode(Exception):
    """Raised in the main thread by the early signal handler (:func:`install_early_signal_handlers`),
    before torch installs its own; other node programs (the Ray node) catch it to stop the same way."""


def install_early_signal_handlers() -> None:
    """SIGTERM, SIGINT and SIGHUP raise :class:`StopNode` in the main thread.

    As PID 1 of a namespace, signals without a handler are ignored: this installs one so a stop
    during rendezvous is honoured. torch elastic replaces it once ranks run."""
    def handler(signum: int, _frame: Any) -> None:
        raise StopNode(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handler)


def watch_heartbeat(folder: "JobFolder", ttl: float, why: dict[str, str]) -> None:
    """Stop this node when the driver's heartbeat has not advanced for ``ttl`` seconds (the reason
    goes into ``why`` for the node's status: the driver names it instead of the ranks' collateral errors).

    Measured on this node's monotonic clock from the last *new* sealed heartbeat (its
    sequence number grew), so clock skew does not matter and a forged or replayed
    heartbeat cannot keep a node alive past its driver.
    """
    from prefect_sgpu.protocol.jobfolder import HEARTBEAT_STOP

    last_seq = -1
    seen = time.monotonic()
    while True:
        time.sleep(min(ttl / 4, 5.0))
        beat = folder.heartbeat()
        now = time.monotonic()
        if beat is not None and beat.seq > last_seq:
            last_seq, seen = beat.seq, now
        elif now - seen > ttl:
            why["stopped"] = f"{HEARTBEAT_STOP} for {now - seen:.0f}s (ttl {ttl:g}s)"
            print(f"[sgpu-agent] {why['stopped']}: stopping this node", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return


def _silent_ranks(job_dir: Path, timeout: float, mine: set[int]) -> dict[int, tuple[int, float, str]]:
    """This node's live ranks with no progress (and no output) for ``timeout`` s: rank -> (pid, silent, step)."""
    from prefect_sgpu.protocol import jobfolder
    from prefect_sgpu.runtime import PROGRESS_DIR, finished_marker

    now = time.time()
    silent: dict[int, tuple[int, float, str]] = {}
    for path in (job_dir / PROGRESS_DIR).glob("rank-*"):
        try:
            fields = path.read_text().split()  # "pid [step total time]"
            rank, pid = int(path.name[len("rank-"):]), int(fields[0])
            step = fields[1] if len(fields) > 1 else ""
            last = path.stat().st_mtime
        except (OSError, ValueError):
            continue
        if pid not in mine:
            continue  # finished, or another node's rank (local nodes share one job folder)
        try:
            if int(finished_marker(job_dir, rank).read_text().split()[0]) == pid:
                continue  # returned from the function; a forked rank waits for its node's others
        except (OSError, ValueError, IndexError):
            pass
        try:
            last = max(last, (job_dir / jobfolder.log_key(rank)).stat().st_mtime)
        except OSError:
            pass
        if now - last > timeout:
            silent[rank] = (pid, now - last, step)
    return silent


def _dump_stacks(job_dir: Path, silent: dict[int, tuple[int, float, str]]) -> dict[str, dict[str, Any]]:
    """Ask each silent rank for its Python stacks (SIGUSR1: faulthandler writes them to its log)."""
    from prefect_sgpu.protocol import jobfolder

    sizes: dict[int, int] = {}
    for rank, (pid, _, _) in silent.items():
        log = job_dir / jobfolder.log_key(rank)
        sizes[rank] = log.stat().st_size if log.exists() else 0
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(2.0)
    found: dict[str, dict[str, Any]] = {}
    for rank, (_pid, silent_s, step) in sorted(silent.items()):
        stack = ""
        try:
            with open(job_dir / jobfolder.log_key(rank), "rb") as fh:
                fh.seek(sizes[rank])
                stack = fh.read(16000).decode("utf-8", "replace")
        except OSError:
            pass
        found[str(rank)] = {"silent_s": round(silent_s, 1), "step": step, "stack": stack[-4000:]}
    return found


def _watch_progress(job_dir: Path, timeout: float, hung: dict[str, dict[str, Any]]) -> None:
    """The hang watchdog: when a live rank of this node made no progress for ``timeout`` seconds,
    record every silent rank's stack in ``hung`` and stop this node (the driver raises JobHung)."""
    import psutil

    me = psutil.Process()
    while True:
        time.sleep(min(max(timeout / 6, 0.5), 10.0))
        try:
            mine = {p.pid for p in me.children(recursive=True)}
        except psutil.Error:
            continue
        silent = _silent_ranks(job_dir, timeout, mine)
        if silent:
            hung.update(_dump_stacks(job_dir, silent))
            print(f"[sgpu-agent] rank(s) {sorted(silent)} made no progress for {timeout:g}s (hang_timeout): "
                  "stopping this node", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return


def node_parser(prog: str) -> argparse.ArgumentParser:
    """The arguments every node program of a job takes: its job, its folder, its place in the gang."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--run-id", required=True)
    p.add_argument("--job-dir", required=True)
    p.add_argument("--node-index", type=int, required=True)
    p.add_argument("--nnodes", type=int, required=True)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from prefect_sgpu.protocol.jobfolder import RANK_STARTS  # the driver checks its setting against the same names

    p = node_parser("prefect-sgpu-node-agent")
    p.add_argument("--nproc-per-node", type=int, required=True)
    p.add_argument("--rdzv-endpoint", required=True)
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--heartbeat-ttl", type=float, default=0.0)
    p.add_argument("--join-timeout", type=float, default=600.0)
    p.add_argument("--hang-timeout", type=float, default=0.0, help="0: no hang watchdog")
    p.add_argument("--shm-size", default="")
    p.add_argument("--local-addr", default=None,
                   help="this node's address; also tells simulated nodes on one host apart")
    p.add_argument("--rank-start", choices=RANK_STARTS, default="auto",
                   help="auto: fork on a node whose ranks use no GPU, spawn where they may")
    p.add_argument("--min-nodes", type=int, default=0,
                   help="an elastic job: its ranks start once this many nodes joined (0: --nnodes)")
    p.add_argument("--elastic-wait", type=int, default=-1,
                   help="an elastic job: seconds its first nodes wait for the rest once min joined (-1: torch's)")
    p.add_argument("--lost-after", type=int, default=0,
                   help="an elastic job: seconds after which the rendezvous counts a silent node's agent as gone "
                        "(three missed keep-alives; 0: torch's 15)")
    return p.parse_args(argv)


def elastic_options(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    """The fewest nodes torch elastic starts the ranks with, and the rendezvous options that go with it:
    an elastic job's (``--min-nodes`` below ``--nnodes``) wait for the rest of its nodes once min joined
    (``last_call_timeout``); a later node joins at the next round, when the running nodes restart their
    ranks (a membership change, which torch elastic does not count against ``max_restarts``); a node whose
    agent went silent for ``--lost-after`` seconds is dropped at the next round."""
    fewest = args.min_nodes or args.nnodes
    if not 1 <= fewest <= args.nnodes:
        raise ValueError(f"--min-nodes={args.min_nodes}: 1 to --nnodes={args.nnodes}")
    extra: dict[str, Any] = {}
    if fewest < args.nnodes and args.elastic_wait >= 0:
        extra["last_call_timeout"] = args.elastic_wait
    if fewest < args.nnodes and getattr(args, "lost_after", 0) > 0:
        # a lost node's agent stops its keep-alives; the others' rendezvous drops it after the last missed
        # one and meets again without it (torch's DynamicRendezvousHandler: keep_alive_interval x
        # keep_alive_max_attempt, 5 s x 3 by default)
        extra["keep_alive_interval"] = max(1, args.lost_after // 3)
        extra["keep_alive_max_attempt"] = 3
    return fewest, extra


def ranks_may_use_cuda() -> bool:
    """Could this node's ranks use CUDA? Answered without initializing it (a forked rank cannot
    use CUDA once its parent did): the launcher's device, else the driver's device files."""
    device = os.environ.get("SGPU_DEVICE", "").strip().lower()
    if device:
        return device == "cuda"
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl")


def rank_start_method(requested: str, forked: bool) -> str:
    """``fork`` or ``spawn`` for this node's ranks.

    A warm node's agent always forks. ``auto`` forks where the ranks use no GPU: the ranks then
    skip importing torch again (about 2 s of CPU each), and there is no CUDA state or NUMA binding
    that a fork could lose. Where they may use a GPU, ranks are new interpreters as under torchrun,
    each bound to its GPU's NUMA node by torch elastic.
    """
    from prefect_sgpu.protocol.jobfolder import RANK_STARTS

    if forked:
        return "fork"
    if requested not in RANK_STARTS:
        raise ValueError(f"rank start {requested!r}: one of {', '.join(RANK_STARTS)}")
    if requested != "auto":
        return requested
    return "spawn" if ranks_may_use_cuda() else "fork"


def rendezvous_run_id(environ: Mapping[str, str]) -> str:
    """The rendezvous id this agent joins under: its gang's (``SGPU_GANG``, 0 when absent), derived
    from the job key in ``SGPU_PAYLOAD_KEY``. A late agent of an earlier gang then never meets the
    agents of a later one, even at the same node 0 address and port."""
    from prefect_sgpu.launch import rendezvous
    from prefect_sgpu.protocol.jobfolder import GANG_ENV

    raw = environ.get(GANG_ENV) or "0"
    gang = int(raw) if raw.isdigit() else -1
    if gang < 0:
        raise ValueError(f"{GANG_ENV}={raw!r}: allowed is a gang number >= 0")
    return rendezvous.rendezvous_id(environ["SGPU_PAYLOAD_KEY"], gang)


def job_folder(job_dir: str | Path) -> "JobFolder":
    """This node's job folder, with the job key from the environment."""
    from prefect_sgpu.protocol.jobfolder import JobFolder

    return JobFolder.local(job_dir, os.environ["SGPU_PAYLOAD_KEY"])


def run(args: argparse.Namespace, forked: bool = False) -> int:
    """Run this node's part of the job with torch elastic; ``forked``: on a warm node, whose ranks
    are always forked from this agent (torch already imported). A cold agent starts them as
    ``--rank-start`` says (:func:`rank_start_method`)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from prefect_sgpu.launch import rendezvous

    job_dir = Path(args.job_dir)
    folder = job_folder(job_dir)
    if args.shm_size:  # our own mount namespace: a private /dev/shm, as on a separate host
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.shm_size}", "tmpfs", "/dev/shm"],
                       check=True)
    os.environ["SGPU_JOB_DIR"] = str(job_dir)
    os.environ["SGPU_RUN_ID"] = args.run_id
    # ranks get a Prefect home of the job's own: no profile of the user's (and so no API key in one)
    prefect_home = job_dir / "prefect-home"
    prefect_home.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ["PREFECT_HOME"] = str(prefect_home)
    os.environ["PREFECT_PROFILES_PATH"] = str(prefect_home / "profiles.toml")
    why: dict[str, str] = {}  # set by a watchdog that stopped this node
    if args.heartbeat_ttl > 0:
        threading.Thread(
            target=watch_heartbeat, args=(folder, args.heartbeat_ttl, why), daemon=True
        ).start()

    hung: dict[str, dict[str, Any]] = {}
    if args.hang_timeout > 0:
        threading.Thread(target=_watch_progress, args=(job_dir, args.hang_timeout, hung), daemon=True).start()

    start = rank_start_method(getattr(args, "rank_start", "auto"), forked)
    accepted = inspect.signature(LaunchConfig).parameters
    # older torch (2.11) has no shutdown_timeout: its agent then waits its own default
    newer: dict[str, Any] = {"shutdown_timeout": 10} if "shutdown_timeout" in accepted else {}
    if start == "fork" and "numa_options" in accepted:
        # Without numa_options, LaunchConfig asks torch whether the accelerator is available to
        # choose a NUMA binding; on a GPU that query initializes CUDA in this agent, and the
        # ranks forked from it then cannot use CUDA at all. A placeholder skips the query and
        # is cleared below: forked ranks are not NUMA-bound.
        newer["numa_options"] = _NO_NUMA_QUERY
    fewest, elastic_configs = elastic_options(args)
    config = LaunchConfig(
        min_nodes=fewest,
        max_nodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        run_id=rendezvous_run_id(os.environ),  # this gang's, on no command line
        role="sgpu",
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_backend=rendezvous.BACKEND,  # torch's c10d, its stores on this node's address only
        rdzv_configs={"is_host": False, "join_timeout": args.join_timeout, **elastic_configs},
        max_restarts=args.max_restarts,
        monitor_interval=0.1,
        start_method=start,
        logs_specs=rendezvous.logs_specs(str(job_dir / "agent" / f"node-{args.node_index}")),
        local_addr=args.local_addr,
        **newer,
    )
    if getattr(config, "numa_options", None) is _NO_NUMA_QUERY:
        config.numa_options = None
    status: dict[str, Any] = {"node": args.node_index, "host": socket.gethostname(), "exit_code": 0,
                              "failures": {}}
    from prefect_sgpu.protocol.jobfolder import NodeStatus

    hosted: list[Any] = []  # node 0's rendezvous store, alive as long as this agent
    try:
        rendezvous.register()
        if args.node_index == 0:  # every agent, this one too, joins it as a client
            from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

            hosted.append(rendezvous.host_store(*parse_rendezvous_endpoint(args.rdzv_endpoint, 29400)))
        if start == "fork":
            import gc

            from prefect_sgpu.launch.rank_main import forked_rank

            gc.freeze()  # what this agent imported stays out of the collector: forks keep sharing its pages

            elastic_launch(config, forked_rank)()
        else:
            elastic_launch(config, sys.executable)("-u", "-m", "prefect_sgpu.launch.rank_main",
                                                   f"--run-id={args.run_id}")
    except ChildFailedError as exc:
        status["exit_code"] = 1
        for rank, failure in exc.failures.items():
            status["failures"][str(rank)] = {
                "exit_code": failure.exitcode,
                "signal": failure.signal_name() if failure.exitcode < 0 else None,
                "local_rank": failure.local_rank,
            }
    except (StopNode, SignalException, KeyboardInterrupt) as exc:
        status.update(exit_code=143, stopped=f"signal {exc}")
    except Exception as exc:  # noqa: BLE001 - rendezvous or agent errors end the node
        if not _left_out(args, exc):
            status.update(exit_code=2, error=f"{type(exc).__name__}: {exc}")
        print(f"[sgpu-agent] node {args.node_index}: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
    from prefect_sgpu.runtime import PREEMPT_FILE

    if hung:
        status["hung"] = dict(hung)
    if why.get("stopped"):
        status["stopped"] = why["stopped"]
    try:
        status["notice"] = (job_dir / PREEMPT_FILE).read_text().strip() or "reclaim notice"
    except OSError:
        pass
    folder.put_status(args.node_index, NodeStatus(**status))
    return int(status["exit_code"])


def _left_out(args: argparse.Namespace, exc: BaseException) -> bool:
    """An elastic job's node that never joined a round, whose rendezvous the gang closed (it ended, well
    or not, without this node): not this node's failure. The nodes that ran the ranks report how it went."""
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    from prefect_sgpu.launch import rendezvous

    if not isinstance(exc, RendezvousClosedError) or rendezvous.JOINED_ROUNDS:
        return False
    if not args.min_nodes or args.min_nodes >= args.nnodes:
        return False
    print(f"[sgpu-agent] node {args.node_index}: the job ended before this node joined it "
          f"(an elastic job runs on {args.min_nodes} to {args.nnodes} nodes)", file=sys.stderr, flush=True)
    return True


def node_main(parse: Callable[[list[str] | None], argparse.Namespace],
              body: Callable[[argparse.Namespace], int], argv: list[str] | None) -> int:
    """A node process's entry point: stop signals honoured from the first instruction, 143 on a stop."""
    install_early_signal_handlers()
    args = parse(argv)
    try:
        return body(args)
    except StopNode:
        return 143


def main(argv: list[str] | None = None) -> int:
    return node_main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
