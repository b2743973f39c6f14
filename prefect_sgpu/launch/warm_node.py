"""A warm node: one long-lived process per node that has torch imported and forks a fresh
node agent for every job.

A cold launch pays for a new interpreter and ``import torch`` in the agent and again in
every rank (seconds). A warm node pays for them once: it imports torch, torch elastic and
the rank entry point, then waits. For each job it forks a node agent (torch elastic's own
launcher, as on a cold node) whose ranks are forked from it in turn, so a warm launch
starts ranks without importing anything.

Nothing of one job reaches the next:

- every job's agent and ranks are fresh forks of this process, which never runs user code,
  never initialises a process group and never touches CUDA: no process group, CUDA
  context, imported user module or global of an earlier job exists in them;
- the agent's environment is replaced by the job's whole (not merged into this one), and
  it starts in the job's working directory;
- when the agent has exited, every process left on this node (a daemon a rank started) is
  killed before the job is reported ended; this process is PID 1 of the node's namespace
  (or a child subreaper without namespaces), so orphans are its children to find;
- a node with its own ``/dev/shm`` empties it before every job.

The driver speaks to it over its stdin and stdout, one JSON object a line::

    -> {"op": "launch", "argv": [...node agent args...], "env": {...}, "cwd": "...", "out": "...",
        "cgroup": ".../cgroup.procs" (optional: the job's cgroup, entered right after the fork)}
    <- {"started": pid}                 ... later: {"exited": code}
    -> {"op": "stop", "grace": 10}      the job's agent gets SIGTERM, everything SIGKILL after grace
    EOF on stdin (the driver closed it, or died): everything is killed and this process exits.

The job key and secrets travel in the launch line over the pipe, never on disk.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

#: imported once here, so that no job imports them again
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.distributed.elastic.multiprocessing",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
    "torch.distributed.launcher.api",
    "torch.nn.parallel",
    "cloudpickle",
    "psutil",
    "prefect_sgpu.protocol.jobfolder",
    "prefect_sgpu.protocol.payload",
    "prefect_sgpu.runtime",
    "prefect_sgpu.checkpoints",
    "prefect_sgpu.launch.node_agent",
    "prefect_sgpu.launch.rank_main",
    # what an agent and its ranks import lazily at every job (seen with PYTHONPROFILEIMPORTTIME=1 in a
    # warm node's forks): imported here, a warm job's ranks no longer pay them each time
    "prefect_sgpu.launch.rendezvous",
    "prefect_sgpu.launch.nccl_env",
    "prefect_sgpu.observe.gang_check",
    "prefect_sgpu.observe.mlflow_relay",
    "prefect_sgpu.protocol.rank_progress",
    "prefect_sgpu.protocol.node_requests",  # a rank with S3 stores reports their requests at its end
    "encodings.idna",
    "multiprocessing.popen_fork",
    "multiprocessing.queues",
)


class WarmNode:
    """This process's state: the job's agent, if one runs, and the channel to the driver."""

    def __init__(self, proto: Any, shm: bool) -> None:
        self.proto = proto
        self.shm = shm
        self.agent: int | None = None
        self.lock = threading.Lock()
        self.children = threading.Condition()
        self.kill_timer: threading.Timer | None = None

    def say(self, **message: Any) -> None:
        with self.lock:
            self.proto.write(json.dumps(message) + "\n")
            self.proto.flush()

    # -- one job -------------------------------------------------------------------------

    def launch(self, message: dict[str, Any]) -> None:
        if self.agent is not None:
            self.say(error=f"a job's agent (pid {self.agent}) still runs on this node")
            return
        if self.shm:
            _empty("/dev/shm")
        sys.stdout.flush()
        sys.stderr.flush()
        with self.children:
            pid = os.fork()
            if pid == 0:  # the job's node agent
                run_agent(message, self.proto.fileno())
            self.agent = pid
            self.children.notify_all()
        self.say(started=pid)

    def stop(self, grace: float) -> None:
        agent = self.agent
        if agent is None:
            return
        try:
            os.killpg(agent, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if self.kill_timer is None:
            self.kill_timer = threading.Timer(max(grace, 0.0), _kill_all, kwargs={"reap": False})
            self.kill_timer.daemon = True
            self.kill_timer.start()

    def reap(self) -> None:
        """Reap every child (orphans too); when the agent ended, kill what is left and report."""
        while True:
            with self.children:
                while self.agent is None and not _has_children():
                    self.children.wait(1.0)
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                time.sleep(0.05)
                continue
            with self.children:  # launch() holds it from fork to recording the agent's pid
                if pid != self.agent:
                    continue
            code = os.waitstatus_to_exitcode(status)
            _kill_all()  # what the job's ranks left behind; the agent's own ranks have ended
            if self.kill_timer is not None:
                self.kill_timer.cancel()
                self.kill_timer = None
            self.agent = None
            self.say(exited=code)


def _has_children() -> bool:
    try:
        import psutil

        return bool(psutil.Process().children())
    except Exception:  # noqa: BLE001 - assume there are, waitpid will tell
        return True


def _kill_all(reap: bool = True) -> None:
    """SIGKILL every process below this one and (``reap``) reap it, until none is left. Only the
    reaper thread reaps while it runs: it alone must see the agent's exit status."""
    import psutil

    me = psutil.Process()
    for _ in range(50):
        try:
            left = me.children(recursive=True)
        except psutil.Error:
            return
        if not left:
            return
        for proc in left:
            try:
                proc.kill()
            except psutil.Error:
                pass
        if not reap:
            return
        for proc in left:
            try:
                os.waitpid(proc.pid, 0)
            except (ChildProcessError, OSError):
                pass  # not ours to reap (yet): its parent was killed, it comes back to us as an orphan
        time.sleep(0.01)


def _empty(folder: str) -> None:
    for entry in Path(folder).iterdir():
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink()
        except OSError:
            pass


def run_agent(message: dict[str, Any], proto_fd: int, forked: bool = True, namespaces: bool = False,
              title: bool = False) -> None:
    """In the forked child: become the job's node agent, then leave without this process's teardown.

    ``forked``: its ranks are always forked (a warm node's agent); else they start as the job
    asks, as on a cold agent. ``namespaces``: the agent runs as PID 1 of its own PID and mount
    namespaces (:func:`_enter_namespaces`). ``title``: it shows a cold agent's command line."""
    code = 2
    try:
        os.setsid()  # its own process group: a stop signals the agent and its ranks, not the warm node
        if message.get("cgroup"):  # the job's cgroup, before anything of the job runs: all of it dies with it
            try:
                with open(message["cgroup"], "w") as fh:
                    fh.write(str(os.getpid()))
            except OSError as exc:
                print(f"the job's agent could not enter its cgroup ({exc}): its processes are ended by pid",
                      file=sys.stderr)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        atexit._clear()  # the warm node's exit handlers are not the job's
        command = " ".join([sys.executable, "-m", "prefect_sgpu.launch.node_agent", *message["argv"]])
        if title:
            _set_title(command)
        out = os.open(message["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.close(proto_fd)
        if namespaces:
            _enter_namespaces(f"{NAMESPACE_TITLE} -- {command}" if title else None)
        env: dict[str, str] = message["env"]
        os.environ.clear()
        os.environ.update(env)
        import tempfile

        tempfile.tempdir = None  # found again from the job's TMPDIR, not the one this process saw first
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[:0] = extra
        os.chdir(message["cwd"])
        from prefect_sgpu.launch import node_agent

        node_agent.install_early_signal_handlers()
        code = node_agent.node_main(node_agent.parse_args,
                                    lambda args: node_agent.run(args, forked=forked), message["argv"])
    except BaseException:  # noqa: BLE001 - whatever happens, the child must not return into the warm node
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


#: the command line of the process that holds a forked agent's namespaces (as ``unshare`` does a cold one's)
NAMESPACE_TITLE = "prefect-sgpu-node-namespace"


def _set_title(title: str) -> None:
    """Show ``title`` as this process's command line (``ps``, psutil): the job's run id is on it."""
    try:
        import setproctitle
    except ImportError:  # optional (the torch extra brings it): the command line stays the parent's
        return
    setproctitle.setproctitle(title)


_CLONE_NEWNS, _CLONE_NEWPID = 0x00020000, 0x20000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
_PR_SET_PDEATHSIG = 1


def _enter_namespaces(outer_title: str | None) -> None:
    """Continue as PID 1 of new PID and mount namespaces, with a /proc of its own.

    What ``unshare --mount --propagation private --pid --fork --mount-proc --kill-child=SIGTERM``
    does for a cold agent: this process stays outside, waits for the namespace's first process
    (which returns from here) and exits as it did: with its exit code, or by its signal. Its
    stop signals reach that process through the process group both are in, and it ends with
    SIGTERM if this process is killed."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWPID), "unshare(CLONE_NEWNS | CLONE_NEWPID)")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    pid = os.fork()
    if pid == 0:
        check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
        check(libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None), "mount /proc")
        return
    if outer_title:
        _set_title(outer_title)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the process group's stop is for the agent inside
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def preload() -> list[str]:
    """Import the modules of ``PRELOAD`` (a missing optional one is said on stderr) and freeze the
    collector, so that forked agents share those pages; returns the modules imported. The warm
    node and the agent template both preload this way."""
    loaded = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception as exc:  # noqa: BLE001 - an optional module: the job imports it if it needs it
            print(f"[sgpu-warm] not preloaded: {name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    gc.collect()
    gc.freeze()  # what was imported stays out of the collector: forks keep sharing its pages
    return loaded


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefect-sgpu-warm-node")
    p.add_argument("--node-index", type=int, required=True)
    p.add_argument("--shm-size", default="", help="mount a private /dev/shm of this size (own mount namespace)")
    args = p.parse_args(argv)

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # stray prints must not corrupt the channel
    os.close(null)
    if args.shm_size:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.shm_size}", "tmpfs", "/dev/shm"], check=True)
    if os.getpid() != 1:  # without a PID namespace, orphans of a job still come back to this process
        from prefect_sgpu.procs.processes import become_subreaper

        become_subreaper()
    node = WarmNode(proto, shm=bool(args.shm_size))

    def on_signal(signum: int, _frame: Any) -> None:
        _kill_all()
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    loaded = preload()
    threading.Thread(target=node.reap, name="reaper", daemon=True).start()
    node.say(ready=os.getpid(), preloaded=loaded, node=args.node_index)
    for line in sys.stdin.buffer:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        op = message.get("op")
        if op == "launch":
            node.launch(message)
        elif op == "stop":
            node.stop(float(message.get("grace", 10.0)))
    _kill_all()  # the driver is gone, or let this node go
    return 0


if __name__ == "__main__":
    sys.exit(main())
