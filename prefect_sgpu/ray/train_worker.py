"""What each Ray Train worker runs for a job on an existing Ray cluster.

The same contract as a torchrun rank (``launch/rank_main.py``): torch's environment
variables (RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK, ...) so ``prefect_sgpu.runtime``
works, the job's environment and MLflow run, the payload verified with the job's
key and run id before it is unpickled, and one envelope with the value or the
exception. Ray's object store replaces the job folder as the channel: output lines
and the envelope go to the job's collector actor, which the driver reads (a
``ray://`` client cannot see the workers' disks) and seals into the job folder.
"""

from __future__ import annotations

import builtins
import os
import socket
import sys
import threading
import time
from typing import Any

FLUSH_INTERVAL_S = 0.2


class Collector:
    """A resource-free actor holding a job's output lines and envelope bodies until the driver reads them.

    It also keeps when each rank last showed life (started, printed, reported progress), by its
    own clock, so the driver's hang watchdog needs no clock shared with the workers.
    """

    def __init__(self) -> None:
        self._lines: list[tuple[int, int, str]] = []
        self._results: dict[int, bytes] = {}
        self._seen: dict[int, float] = {}
        self._steps: dict[int, str] = {}
        self._groups: dict[str, Any] = {}

    def placed(self, group_id: str) -> None:
        """A rank runs in the placement group ``group_id`` (hex: Ray Train's, for this run)."""
        import ray
        from ray.util.placement_group import PlacementGroup

        self._groups[group_id] = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id)))

    def remove_placement_groups(self) -> list[str]:
        """Remove the placement groups the job's ranks ran in that outlived the run; their ids.

        Ray Train's controller removes it asynchronously as the run ends; under load that was
        seen to take longer than 20 s after the job returned, its CPUs or GPUs held meanwhile.
        Removed here, the group is gone when ``release`` returns."""
        import ray

        removed = []
        for group_id, group in self._groups.items():
            if ray.util.placement_group_table(group).get("state") not in (None, "REMOVED"):
                ray.util.remove_placement_group(group)
                removed.append(group_id)
        return removed

    def put_lines(self, lines: list[tuple[int, int, str]]) -> None:
        self._lines.extend(lines)
        now = time.monotonic()
        for rank, _node, _text in lines:
            self._seen[rank] = now

    def alive(self, rank: int, step: int | None = None) -> None:
        """Rank ``rank`` started or reported progress (``runtime.progress``)."""
        self._seen[rank] = time.monotonic()
        if step is not None:
            self._steps[rank] = str(step)

    def drain(self) -> list[tuple[int, int, str]]:
        lines, self._lines = self._lines, []
        return lines

    def put_result(self, rank: int, blob: bytes) -> None:
        self._results[rank] = blob

    def results(self) -> dict[int, bytes]:
        return dict(self._results)

    def silent(self, timeout: float) -> dict[int, tuple[float, str]]:
        """Started ranks without a result that showed no life for ``timeout`` s: rank -> (seconds, last step)."""
        now = time.monotonic()
        return {rank: (now - seen, self._steps.get(rank, "")) for rank, seen in self._seen.items()
                if rank not in self._results and now - seen > timeout}


def _plain_print(*objects: Any, sep: str | None = " ", end: str | None = "\n", file: Any = None,
                 flush: bool = False) -> None:
    """``print`` writing to stdout, as in a torchrun rank (Ray Train routes it to a logger)."""
    stream = file if file is not None else sys.stdout
    stream.write((" " if sep is None else sep).join(map(str, objects)) + ("\n" if end is None else end))
    if flush:
        stream.flush()


class OutputToCollector:
    """Send everything written to fds 1 and 2 (Python, C extensions, subprocesses) to the collector.

    A copy still goes to the worker's own Ray log file.
    """

    def __init__(self, collector: Any, rank: int, node: int) -> None:
        self.collector = collector
        self.rank = rank
        self.node = node
        self._saved: tuple[int, int] | None = None
        self._reader: threading.Thread | None = None
        self._pending: list[tuple[int, int, str]] = []
        self._lock = threading.Lock()
        self._last_ref: Any = None
        self._stop_flushing = threading.Event()
        self._flusher: threading.Thread | None = None
        self._progress: list[int | None] = []  # progress reported since the last flush (its last step)
        self._remove_listener: Any = None

    def _on_progress(self, step: int | None) -> None:
        with self._lock:
            self._progress[:] = [step]

    def __enter__(self) -> "OutputToCollector":
        from prefect_sgpu import runtime

        self.collector.alive.remote(self.rank)  # started: the hang watchdog counts from here
        self._remove_listener = runtime.add_progress_listener(self._on_progress)
        sys.stdout.flush()
        sys.stderr.flush()
        read_fd, write_fd = os.pipe()
        self._saved = (os.dup(1), os.dup(2))
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._print = builtins.print
        builtins.print = _plain_print
        self._reader = threading.Thread(target=self._read, args=(read_fd,), name="sgpu-output", daemon=True)
        self._reader.start()
        # a line is sent within FLUSH_INTERVAL_S even when nothing is written after it
        self._flusher = threading.Thread(target=self._flush_periodically, name="sgpu-output-flush", daemon=True)
        self._flusher.start()
        return self

    def _flush_periodically(self) -> None:
        while not self._stop_flushing.wait(FLUSH_INTERVAL_S):
            self.flush()

    def _read(self, fd: int) -> None:
        partial = b""
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while True:
                data = pipe.read(65536)
                if not data:
                    break
                if self._saved is not None:
                    try:
                        os.write(self._saved[0], data)
                    except OSError:
                        pass
                *lines, partial = (partial + data).split(b"\n")
                with self._lock:
                    self._pending += [(self.rank, self.node, raw.decode("utf-8", "replace").rstrip("\r"))
                                      for raw in lines]
        if partial:
            with self._lock:
                self._pending.append((self.rank, self.node, partial.decode("utf-8", "replace")))

    def flush(self) -> None:
        with self._lock:  # held while submitting, so batches reach the actor in order
            batch, self._pending = self._pending, []
            if batch:
                self._last_ref = self.collector.put_lines.remote(batch)
            if self._progress:
                (step,), self._progress = self._progress, []
                self.collector.alive.remote(self.rank, step)

    def __exit__(self, *exc: Any) -> None:
        import ray

        sys.stdout.flush()
        sys.stderr.flush()
        builtins.print = self._print
        if self._remove_listener is not None:
            self._remove_listener()
        assert self._saved is not None
        os.dup2(self._saved[0], 1)  # closes the pipe's last write end: the reader sees EOF
        os.dup2(self._saved[1], 2)
        if self._reader is not None:
            self._reader.join(timeout=10)
        self._stop_flushing.set()
        if self._flusher is not None:
            self._flusher.join(timeout=10)
        os.close(self._saved[0])
        os.close(self._saved[1])
        self._saved = None
        self.flush()
        if self._last_ref is not None:
            ray.get(self._last_ref)


def _set_rank_env(config: dict[str, Any]) -> tuple[int, int, int]:
    import ray.train

    ctx = ray.train.get_context()
    rank, node, local = ctx.get_world_rank(), ctx.get_node_rank(), ctx.get_local_rank()
    os.environ.update(config["env"])
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(ctx.get_world_size()), "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(ctx.get_local_world_size()), "GROUP_RANK": str(node), "NODE_RANK": str(node),
    })
    return rank, node, local


def run_rank(config: dict[str, Any]) -> None:
    """``train_loop_per_worker`` of the job's TorchTrainer."""
    import ray

    from prefect_sgpu.protocol import payload
    from prefect_sgpu.launch.rank_main import run_payload

    rank, node, local = _set_rank_env(config)
    if (group := ray.get_runtime_context().get_placement_group_id()) is not None:
        ray.get(config["collector"].placed.remote(group))  # known before user code can end the process
    base = {"rank": rank, "node": node, "local_rank": local, "host": socket.gethostname()}
    with OutputToCollector(config["collector"], rank, node):
        envelope, _ = run_payload(config["payload"], config["key"], config["run_id"], base)
    # the body travels through Ray's object store; the driver seals it into the job folder
    ray.get(config["collector"].put_result.remote(rank, payload.dump_envelope(envelope)))
    if not envelope.ok:  # fail the Ray Train run, so the other workers are stopped
        raise RuntimeError(f"rank {rank} failed: {envelope.exc_type}: {envelope.exc_message}")
