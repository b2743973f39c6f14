"""Run one distributed job from start to finish, and clean up on every path.

Order matters: everything that can be checked (resources, payload) is checked
before the store, MLflow or any process is touched; once anything exists, a
``finally`` stops every rank, releases the compute and ends the MLflow run.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from prefect_sgpu import payload as payload_mod
from prefect_sgpu.compute import Allocation, Compute, Node, NodeLaunch
from prefect_sgpu.compute.ports import free_port  # noqa: F401 - kept importable from here
from prefect_sgpu.errors import JobCancelled, LaunchTimeout, RankFailedError
from prefect_sgpu.logs import LogTailer, RankLogSink
from prefect_sgpu.spec import JobOptions, Plan, Resources
from prefect_sgpu.store import Store, rank_key
from prefect_sgpu.tracking import TrackedRun, active_parent, mlflow_available, start_run

logger = logging.getLogger("prefect_sgpu.driver")

HEARTBEAT_INTERVAL_S = 2.0

def heartbeat_ttl() -> float:
    """Seconds without a driver heartbeat after which nodes stop themselves."""
    return float(os.environ.get("PREFECT_SGPU_HEARTBEAT_TTL", 60.0))

POLL_INTERVAL_S = 0.05


@dataclass
class RankReport:
    rank: int
    node: int
    host: str
    exit_code: int
    duration_s: float


@dataclass
class JobResult:
    """What a finished job leaves behind, beyond the values."""

    run_id: str
    values: list[Any]
    plan: Plan
    ranks: list[RankReport] = field(default_factory=list)
    mlflow_run_id: str | None = None
    mlflow_tracking_uri: str | None = None
    logs_uri: str = ""
    duration_s: float = 0.0
    #: what the compute charged for, when it knows (EC2: instance-hours and estimated USD)
    cost: dict[str, Any] | None = None


class Launcher:
    """What each node runs. The default: torch elastic with ``procs_per_node`` ranks."""

    name = "torchrun"

    def node_argv(self, job: "Job", plan: Plan, node: Node, endpoint: str) -> list[str]:
        return [
            sys.executable, "-m", "prefect_sgpu.launch.node_agent",
            f"--run-id={job.run_id}", f"--job-dir={job.store.uri(job.run_id)}",
            f"--node-index={node.index}", f"--nnodes={plan.nodes}",
            f"--nproc-per-node={plan.procs_per_node}", f"--rdzv-endpoint={endpoint}",
            f"--local-addr={node.address}", f"--max-restarts={job.options.max_restarts}",
            f"--heartbeat-ttl={heartbeat_ttl():g}", f"--join-timeout={min(job.options.timeout, 600):g}",
        ]

    def result_ranks(self, plan: Plan) -> list[int]:
        """The ranks whose envelopes make up the job's values, in order."""
        return list(range(plan.world_size))


TorchrunLauncher = Launcher


def new_run_id(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:32] or "job"
    return f"{slug}-{uuid.uuid4().hex[:10]}"


class Job:
    """One call of a distributed function or script."""

    def __init__(
        self,
        call: payload_mod.FunctionCall | payload_mod.ScriptCall,
        resources: Resources,
        options: JobOptions,
        compute: Compute,
        store: Store,
        sink: RankLogSink | None = None,
        cancel_event: threading.Event | None = None,
        tags: dict[str, str] | None = None,
        launcher: "Launcher | None" = None,
    ) -> None:
        self.call = call
        self.resources = resources
        self.options = options
        self.compute = compute
        self.store = store
        self.sink = sink or RankLogSink(call.name)
        self.cancel_event = cancel_event or threading.Event()
        self.tags = tags or {}
        self.launcher = launcher or TorchrunLauncher()
        self.run_id = new_run_id(call.name)
        self.plan: Plan | None = None
        self.tracked: TrackedRun | None = None
        self.allocation: Allocation | None = None
        self.started_at = 0.0
        self._prepared: tuple[Plan, bytes, str] | None = None
        self.mlflow_parent = active_parent() if options.mlflow else None

    # -- preparation (nothing spent) ---------------------------------------------

    def prepare(self) -> tuple[Plan, bytes, str]:
        """Plan and payload, checked and built once; raises before anything is started."""
        if self._prepared is None:
            plan = self.compute.plan(self.resources)
            key = payload_mod.new_key()
            self._prepared = (plan, payload_mod.build(self.call, key), key)
        return self._prepared

    def launches(self, plan: Plan, allocation: Allocation, key: str, endpoint: str) -> list[NodeLaunch]:
        job_dir = self.store.uri(self.run_id)
        env = {
            **self.options.env,
            "SGPU_RUN_ID": self.run_id,
            "SGPU_JOB_DIR": job_dir,
            "SGPU_PAYLOAD_KEY": key,
            "PYTHONUNBUFFERED": "1",
            **(self.tracked.env if self.tracked else {}),
        }
        return [
            NodeLaunch(node=node, argv=self.launcher.node_argv(self, plan, node, endpoint), env=dict(env))
            for node in allocation.nodes
        ]

    def dry_run(self) -> dict[str, Any]:
        """The plan and each node's command, without starting anything."""
        plan, _blob, _key = self.prepare()
        alloc = Allocation(self.run_id, plan, [Node(i, f"<node-{i}>") for i in range(plan.nodes)])
        launches = self.launches(plan, alloc, "<redacted>", "<node-0>:<port>")
        return {"plan": plan, **self.compute.dry_run(self.run_id, plan, launches)}

    # -- run ------------------------------------------------------------------

    def run(self) -> JobResult:
        plan, blob, key = self.prepare()
        self.plan = plan
        self.started_at = time.monotonic()
        deadline = self.started_at + self.options.timeout
        outcome = "KILLED"
        tailer: LogTailer | None = None
        try:
            self.store.put(self.run_id, "payload.bin", blob)
            self._beat()
            if self.options.mlflow and mlflow_available():
                self.tracked = start_run(
                    self.call.name,
                    tags={"sgpu.run_id": self.run_id, **self.tags},
                    params={"sgpu.gpus": self.resources.gpus, "sgpu.nodes": plan.nodes,
                            "sgpu.procs_per_node": plan.procs_per_node,
                            "sgpu.gpu_type": self.resources.gpu_type or plan.device},
                    parent=self.mlflow_parent,
                )
            self.sink.info(
                f"{self.call.name}: starting {plan.world_size} rank(s) on {plan.nodes} node(s) "
                f"[{plan.device}], job {self.run_id}"
            )
            execute = getattr(self.compute, "execute", None)
            if execute is not None:  # computes that run whole jobs themselves (an existing Ray cluster)
                result: JobResult = execute(self)
            else:
                tailer = LogTailer(self.store, self.run_id, plan.procs_per_node, self.sink.line).start()
                self.allocation = self.compute.acquire(self.run_id, plan, cancel=self.cancel_event)
                endpoint = self.compute.rendezvous_endpoint(self.allocation)
                for launch in self.launches(plan, self.allocation, key, endpoint):
                    self.compute.start(self.allocation, launch)
                codes = self._wait(deadline)
                tailer.poll()
                result = self._collect(plan, key, codes)
            outcome = "FINISHED"
        except (RankFailedError, LaunchTimeout):
            outcome = "FAILED"
            raise
        except BaseException as exc:
            outcome = "FAILED" if getattr(exc, "sgpu_failure", None) is not None else "KILLED"
            raise
        finally:
            self._cleanup(outcome, tailer)
        if self.allocation is not None:  # known only once the compute was released
            result.cost = self.allocation.info.get("cost")
        return result

    def collect(self, plan: Plan, codes: dict[int, int]) -> JobResult:
        """Values in rank order from the envelopes in the store, else the first failing rank's error.

        For computes that run whole jobs (``execute``): they put each rank's envelope and,
        on failure, ``nodes/node-<i>.json`` into the store, then report through here.
        """
        return self._collect(plan, self.prepare()[2], codes)

    def _beat(self) -> None:
        self.store.put(self.run_id, "heartbeat", f"{time.time():.3f}".encode())

    def _wait(self, deadline: float) -> dict[int, int]:
        assert self.allocation is not None
        codes: dict[int, int] = {}
        last_beat = time.monotonic()
        while True:
            for node in self.allocation.nodes:
                if node.index not in codes:
                    code = self.compute.poll(self.allocation, node)
                    if code is not None:
                        codes[node.index] = code
            if len(codes) == len(self.allocation.nodes) or any(codes.values()):
                return codes
            now = time.monotonic()
            if self.cancel_event.is_set():
                raise JobCancelled(f"job {self.run_id} was cancelled; every rank was stopped")
            if now > deadline:
                raise LaunchTimeout(self.run_id, self.options.timeout)
            if now - last_beat > HEARTBEAT_INTERVAL_S:
                self._beat()
                last_beat = now
            self.cancel_event.wait(POLL_INTERVAL_S)

    def _envelopes(self, key: str) -> dict[int, payload_mod.Envelope]:
        found: dict[int, payload_mod.Envelope] = {}
        for k in self.store.list(self.run_id, "results"):
            blob = self.store.get(self.run_id, k)
            if blob:
                env = payload_mod.load_envelope(blob, key)
                found[env.rank] = env
        return found

    def _collect(self, plan: Plan, key: str, codes: dict[int, int]) -> JobResult:
        if any(codes.values()):
            if self.allocation is not None:
                self.compute.stop(self.allocation)  # the other nodes, before reading envelopes
            raise self._failure(key, codes)
        envelopes = self._envelopes(key)
        expected = self.launcher.result_ranks(plan)
        missing = [r for r in expected if r not in envelopes]
        if missing:
            raise RankFailedError(missing[0], None, None, None,
                                  f"rank(s) {missing} exited without a result")
        bad = [e for e in envelopes.values() if not e.ok]
        if bad:
            raise self._failure(key, codes)
        values = [envelopes[r].value() for r in expected]
        ranks = [RankReport(e.rank, e.node, e.host, e.exit_code, e.finished - e.started)
                 for e in (envelopes[r] for r in expected)]
        return JobResult(
            run_id=self.run_id, values=values, plan=plan, ranks=ranks,
            mlflow_run_id=self.tracked.run_id if self.tracked else None,
            mlflow_tracking_uri=self.tracked.tracking_uri if self.tracked else None,
            logs_uri=self.store.uri(self.run_id, "logs"),
            duration_s=time.monotonic() - self.started_at,
        )

    def _failure(self, key: str, codes: dict[int, int]) -> BaseException:
        """The first failing rank's own exception (with rank/host notes), else RankFailedError."""
        failed = sorted((e for e in self._envelopes(key).values() if not e.ok), key=lambda e: e.finished)
        if failed:
            first = failed[0]
            info = RankFailedError(first.rank, first.host, first.exit_code, first.traceback,
                                   f"{first.exc_type}: {first.exc_message}", node=first.node)
            original = first.exception()
            if original is None or not isinstance(original, Exception):
                return info
            original.sgpu_failure = info  # type: ignore[attr-defined]
            original.add_note(
                f"[prefect-sgpu] raised in rank {first.rank} (node {first.node}) on {first.host}, "
                f"exit code {first.exit_code}, job {self.run_id}\nRemote traceback:\n"
                + (first.traceback or "").rstrip()
            )
            return original
        import json

        for index, code in sorted(codes.items()):
            if not code:
                continue
            raw = self.store.get(self.run_id, f"nodes/node-{index}.json")
            status = json.loads(raw) if raw else {}
            failures = status.get("failures") or {}
            if failures:
                rank, fail = min(failures.items(), key=lambda kv: int(kv[0]))
                how = f"killed by {fail['signal']}" if fail.get("signal") else "exited"
                return RankFailedError(int(rank), status.get("host"), fail.get("exit_code"), None,
                                       f"{how} without a Python exception (see its log)", node=index)
            return RankFailedError(None, status.get("host"), code, None,
                                   status.get("error") or f"node {index}'s agent exited with code {code}",
                                   node=index)
        return RankFailedError(None, None, None, None, "the job failed without a report")

    def _cleanup(self, outcome: str, tailer: LogTailer | None) -> None:
        try:
            if self.allocation is not None:
                try:
                    self.compute.stop(self.allocation)
                finally:
                    self.compute.release(self.allocation)
        finally:
            if tailer is not None:
                tailer.close()
            if self.tracked is not None:
                self.tracked.end(outcome)
            for key in ("payload.bin", "results"):
                self.store.delete(self.run_id, key)
