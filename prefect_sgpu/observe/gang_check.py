"""The gang check: every rank of a torch elastic job joins one short check before the user's function.

What it checks, in order (each step bounded by ``SGPU_GANG_CHECK_TIMEOUT_S``, 300 s by default: ranks of a
loaded or large job may start minutes apart; a rank that fails says so at once, whatever this is):

1. **Presence.** Each rank writes where it runs (node, host, instance id, device) under keys of its
   own in the workers' store (the one torch elastic's agents host for the ranks' process groups).
   A rank that never arrives is named, with its node's host and instance taken from a peer there.
2. **Device** (ranks on a GPU). The rank's GPU computes a sum whose value is known; where
   ``nvidia-ml-py`` is installed, NVML must report no uncorrectable ECC error since boot (volatile)
   and no hardware slowdown (thermal, power brake), which are named as warnings.
3. **Reachability** (two nodes or more). Each node's first rank listens on the address its
   backend sends from and connects to the previous and the next node's; a node on every broken
   link is named at once (a process group would wait out its timeout).
4. **A process group of the job's backend** (nccl on GPUs, gloo on CPU), on keys of its own in
   the store, so the user's ``init_process_group`` later starts as if the check had not run.
5. **Known results.** ``all_gather`` of ``rank + 1`` from every rank: a wrong entry names its rank;
   ``all_reduce`` of the same must give ``world * (world + 1) / 2``.
6. **Links.** Around a ring over the nodes, one link at a time, each node's first rank asks the
   previous node's first rank for a buffer a few times; the median time gives the link's bandwidth.
   A link slower than the faster half of the links (their median) by ``SLOW_FACTOR`` is named
   slow, and a node on every slow link (with three nodes or more) is named a slow node. Slowness is reported, not fatal.
7. **EFA** (GPUs on two nodes or more of an EFA type): NCCL's transport and an all-reduce's bus bandwidth,
   refused on TCP sockets or under the family's floor (:mod:`prefect_sgpu.observe.nccl_transport`).

A rank whose step fails writes its error to the store and counts it; every other rank sees the
count within a fifth of a second, stops waiting, and all raise the same
:class:`~prefect_sgpu.errors.GangCheckFailed` that names each failing rank with its node, host and
instance id: a broken node costs seconds, not a collective timeout. Rank 0 returns the report
(the driver puts it in ``JobResult.gang_check`` and the task's artifact).

Standard library at import; torch is imported when the check runs.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from prefect_sgpu.observe import nccl_transport

#: set to "1" in every rank by the driver when the job's ``gang_check`` is on
ENV = "SGPU_GANG_CHECK"
#: seconds each step of the check may take before the ranks that did not finish it are named
TIMEOUT_ENV = "SGPU_GANG_CHECK_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
#: bytes each node sends its neighbour per timed exchange
BYTES_ENV = "SGPU_GANG_CHECK_BYTES"
DEFAULT_BYTES = 16 * 1024 * 1024
#: timed exchanges per link (one more goes first, untimed, to open the connection)
EXCHANGES = 3
#: a link this many times slower than the faster half of the links (their median) is named slow
SLOW_FACTOR = 4.0
#: seconds a failing rank waits for its peers' errors before it raises (they see the failure in 0.1 s)
GRACE_S = 3.0
_POLL_S = 0.2
#: seconds a node's first rank tries to connect to a neighbour before it calls the link broken
PROBE_TIMEOUT_S = 10.0


class _PeerFailed(Exception):
    """Another rank failed a step: this one stops waiting for it."""


class _StepFailed(Exception):
    """This rank found a fault; ``blame`` names the ranks at fault when they are not this one."""

    def __init__(self, message: str, blame: list[int] | None = None) -> None:
        super().__init__(message)
        self.blame = list(blame or [])


def enabled() -> bool:
    return os.environ.get(ENV) == "1" and int(os.environ.get("WORLD_SIZE") or 1) > 1


def run_if_enabled() -> dict[str, Any] | None:
    """Run the check when the job asked for it (rank 0 gets the report, other ranks None).
    Raises ``GangCheckFailed``."""
    if not enabled() or not os.environ.get("MASTER_ADDR"):
        return None
    return GangCheck.from_environment().run()


class GangCheck:
    def __init__(self, store: Any, group_store: Any, run_id: str, rank: int, world: int, local_rank: int,
                 local_world: int, node: int, timeout: float, nbytes: int, device: str) -> None:
        # two connections to one store: a process group blocks its connection while it waits for a
        # peer, and the notice board must still answer then
        self.store, self.group_store, self.run_id, self.rank, self.world = store, group_store, run_id, rank, world
        self.local_rank, self.local_world, self.node = local_rank, local_world, node
        self.nodes = max(1, world // max(1, local_world))
        self.timeout, self.nbytes, self.device = timeout, nbytes, device
        self.warnings: list[str] = []
        #: the EFA check's findings (transport, bus bandwidth), where it ran
        self.network: dict[str, Any] | None = None

    @classmethod
    def from_environment(cls) -> "GangCheck":
        import datetime

        import torch.distributed as dist

        timeout = float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)
        def connect() -> Any:
            client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
            # keys of its own for each restart, gang and membership round (an elastic job's round after a node
            # joined is no restart): a later round never reads an earlier one's listeners
            return dist.PrefixStore(f"sgpu-gang-check/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
                                    f"{os.environ.get('SGPU_GANG', '0')}/{os.environ.get('SGPU_MEMBERSHIP_ROUND', '0')}",
                                    client)

        from prefect_sgpu import runtime

        return cls(connect(), connect(), runtime.run_id() or "?", runtime.rank(), runtime.world_size(),
                   runtime.local_rank(), runtime.local_world_size(), runtime.node_rank(), timeout,
                   int(os.environ.get(BYTES_ENV) or DEFAULT_BYTES), "cuda" if runtime.uses_gpu() else "cpu")

    # --- the store as the check's notice board -------------------------------------------------

    def _failures(self) -> int:
        return int(self.store.add("failed", 0))

    def _has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def _json(self, key: str) -> Any:
        return json.loads(self.store.get(key).decode()) if self._has(key) else None

    def _step(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one step in a helper thread; stop waiting when it ends, when a peer fails, or at the timeout."""
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = exc

        thread = threading.Thread(target=target, name=f"sgpu-gang-check-{name}", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout
        while True:
            thread.join(_POLL_S)
            if not thread.is_alive():
                break
            if self._failures():
                raise _PeerFailed(f"{name}: stopped because another rank failed the check")
            if time.monotonic() > deadline:
                raise _StepFailed(f"{name} did not finish within {self.timeout:g} s")
        if "error" in box:
            error = box["error"]
            if isinstance(error, (_StepFailed, _PeerFailed)):
                raise error
            raise _StepFailed(f"{name}: {type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}")
        return box.get("value")

    # --- the check --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any] | None:
        started = time.monotonic()
        try:
            return self._run(started)
        except (_StepFailed, _PeerFailed) as exc:
            self._fail(exc)
            raise AssertionError("unreachable")  # _fail raises

    def _run(self, started: float) -> dict[str, Any] | None:
        me = {"node": self.node, "host": socket.gethostname(), "instance": os.environ.get("SGPU_INSTANCE_ID") or "",
              "device": self.device}
        self.store.set(f"id/{self.rank}", json.dumps(me))
        self.store.add("present", 1)
        self._wait_present()
        if self.device == "cuda":
            self._step("device check", self._check_device)
        if self.nodes > 1:
            self._step("reachability", self._reachability)
        debug = self._nccl_debug_on() if self._efa_expected() else {}
        try:
            self._step("process group", self._init_group)
            try:
                self._step("known results", self._known_results)
                links = self._step("link exchange", self._exchange) if self.nodes > 1 else []
                if self._efa_expected():
                    self.network = self._step("EFA transport", self._efa_transport)
                self._step("barrier", self._barrier)
            finally:
                self._destroy_group()
        finally:
            nccl_transport.restore_env(debug)
        if self.rank != 0:
            return None
        return self._report(started, links)

    # --- EFA: the transport NCCL chose and the bus bandwidth it reaches (observe/nccl_transport.py) ---

    def _efa_expected(self) -> bool:
        return (self.device == "cuda" and self.nodes > 1 and os.environ.get(nccl_transport.EFA_ENV) == "1"
                and os.environ.get(nccl_transport.REQUIRED_ENV, "1") != "0")

    def _nccl_log(self) -> Path:
        return Path(os.environ.get("SGPU_JOB_DIR") or tempfile.gettempdir()) / "nccl" / f"gang-check-rank-{self.rank}.log"

    def _nccl_debug_on(self) -> dict[str, str | None]:
        """NCCL's INFO lines into a file of the check's own, for its process group; the previous values."""
        self._nccl_log().parent.mkdir(parents=True, exist_ok=True)
        return nccl_transport.set_env(nccl_transport.debug_env(os.environ, self._nccl_log()))

    def _efa_transport(self) -> dict[str, Any]:
        """A timed all-reduce of ``SGPU_GANG_CHECK_BUS_BYTES`` (256 MiB) after one untimed; its slowest rank's
        median time gives nccl-tests' bus bandwidth; NCCL's log gives the transport. Refused: Socket, or a
        bus bandwidth under the family's floor."""
        return self._judge_network(*self._timed_all_reduce())

    def _timed_all_reduce(self) -> tuple[float, int]:
        """The slowest rank's median seconds of the all-reduce, and its bytes."""
        import torch
        import torch.distributed as dist

        from prefect_sgpu import runtime

        nbytes = int(os.environ.get(nccl_transport.BUS_BYTES_ENV) or nccl_transport.DEFAULT_BUS_BYTES)
        buffer = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=runtime.device())
        times = []
        for i in range(EXCHANGES + 1):  # the first sets up the connections: not timed
            torch.cuda.synchronize()
            began = time.perf_counter()
            dist.all_reduce(buffer)
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - began)
        slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=runtime.device())
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # every rank decides on the same figure
        return float(slowest.item()), buffer.numel() * 4

    def _judge_network(self, seconds: float, nbytes: int) -> dict[str, Any]:
        """The transport in this rank's NCCL log and the bus bandwidth, against the family's floor."""
        bus = nccl_transport.bus_bandwidth(nbytes, seconds, self.world)
        try:
            lines = self._nccl_log().read_text(errors="replace").splitlines()
        except OSError:
            lines = []  # the job set NCCL_DEBUG itself: the bandwidth alone decides
        transport, evidence = nccl_transport.transport_from_log(lines)
        floor = nccl_transport.floor_from(os.environ.get(nccl_transport.FLOOR_ENV))
        itype = os.environ.get(nccl_transport.INSTANCE_TYPE_ENV, "")
        problem = nccl_transport.verdict(itype, transport, evidence, bus, floor, nbytes)
        if problem:
            raise _StepFailed(problem)
        return {"transport": transport or "unknown", "bus GB/s": round(bus, 2), "floor GB/s": floor,
                "bytes": nbytes, "instance type": itype}

    def _wait_present(self) -> None:
        deadline = time.monotonic() + self.timeout
        while int(self.store.add("present", 0)) < self.world:
            if self._failures():
                raise _PeerFailed("presence: stopped because another rank failed the check")
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world) if not self._has(f"id/{r}")]
                raise _StepFailed(f"rank(s) {missing} did not reach the gang check within {self.timeout:g} s",
                                  blame=missing)
            time.sleep(_POLL_S)

    def _check_device(self) -> None:
        import torch

        from prefect_sgpu import runtime

        faults, warnings = nccl_transport.cuda_findings(torch.cuda.is_available(), torch.version.cuda,
                                                        nccl_transport.driver_cuda_version())
        if faults:
            raise _StepFailed("; ".join(faults))
        self.warnings.extend(warnings)
        dev = runtime.device()
        values = torch.arange(4096, device=dev, dtype=torch.float32)
        total = float(values.sum().item())
        if total != 4095 * 4096 / 2:
            raise _StepFailed(f"GPU {dev} computed {total:g} for a sum of 8386560")
        faults, warnings = _nvml_findings(torch.cuda.current_device())
        if faults:
            raise _StepFailed("; ".join(faults))
        self.warnings.extend(warnings)

    def _reachability(self) -> None:
        """Each node's first rank listens on the address its backend will use and connects to the
        previous and the next node's: a node that reaches no peer (or none reaches) is named at
        once, where a process group would wait out its timeout."""
        if self.local_rank == 0:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                listener.bind((data_address(self.device), 0))
                listener.listen(16)
                host, port = listener.getsockname()[:2]
                self.store.set(f"probe/{self.node}", f"{host}:{port}")
                self.store.add("probes", 1)
                threading.Thread(target=_accept_all, args=(listener,), daemon=True).start()
                while int(self.store.add("probes", 0)) < self.nodes:
                    time.sleep(_POLL_S)
                reached: dict[str, str] = {}
                for peer in sorted({(self.node + 1) % self.nodes, (self.node - 1) % self.nodes} - {self.node}):
                    host, _, port = self.store.get(f"probe/{peer}").decode().rpartition(":")
                    try:
                        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
                        reached[str(peer)] = ""
                    except OSError as exc:
                        reached[str(peer)] = f"{host}:{port}: {exc.strerror or exc}"
                self.store.set(f"reach/{self.node}", json.dumps(reached))
                self.store.add("reached", 1)
                while int(self.store.add("reached", 0)) < self.nodes:
                    time.sleep(_POLL_S)
            finally:
                listener.close()
        else:
            while int(self.store.add("reached", 0)) < self.nodes:
                time.sleep(_POLL_S)
        failed = {(node, int(peer)): error for node in range(self.nodes)
                  for peer, error in json.loads(self.store.get(f"reach/{node}").decode()).items() if error}
        if failed:
            ends = set.intersection(*({a, b} for a, b in failed))
            culprits = sorted(ends) if ends else sorted({n for link in failed for n in link})
            raise _StepFailed("no connection: " + "; ".join(f"node {a} -> node {b} ({error})"
                                                            for (a, b), error in sorted(failed.items())),
                              blame=[n * self.local_world for n in culprits])

    def _init_group(self) -> None:
        import datetime

        import torch.distributed as dist

        kwargs: dict[str, Any] = {}
        backend = "gloo"
        if self.device == "cuda":
            from prefect_sgpu import runtime

            backend, kwargs["device_id"] = "nccl", runtime.device()
        dist.init_process_group(backend, store=dist.PrefixStore("pg", self.group_store), rank=self.rank,
                                world_size=self.world, timeout=datetime.timedelta(seconds=self.timeout), **kwargs)

    def _tensor(self, values: list[float]) -> Any:
        import torch

        return torch.tensor(values, dtype=torch.float64, device=self.device)

    def _known_results(self) -> None:
        import torch.distributed as dist

        gathered = [self._tensor([0.0]) for _ in range(self.world)]
        dist.all_gather(gathered, self._tensor([self.rank + 1.0]))
        wrong = {r: float(t.item()) for r, t in enumerate(gathered) if float(t.item()) != r + 1.0}
        if wrong:
            raise _StepFailed("all_gather gave " + ", ".join(f"{v:g} for rank {r} (expected {r + 1})"
                                                            for r, v in sorted(wrong.items())), blame=sorted(wrong))
        total = self._tensor([self.rank + 1.0])
        dist.all_reduce(total)
        want = self.world * (self.world + 1) / 2
        if float(total.item()) != want:
            raise _StepFailed(f"all_reduce gave {float(total.item()):g}, expected {want:g}")

    def _exchange(self) -> list[dict[str, Any]]:
        """Each link of the ring over the nodes, one at a time (node n -> n+1, between the nodes'
        first ranks): the receiver asks with one byte, the sender answers with the buffer; the
        median of the timed rounds gives the link's bandwidth. One link at a time, so that a slow
        link slows no other's measure."""
        import torch
        import torch.distributed as dist

        if self.local_rank == 0:
            buffer = torch.ones(self.nbytes, dtype=torch.uint8, device=self.device)
            ask = torch.ones(1, dtype=torch.uint8, device=self.device)
            for src in range(self.nodes):
                dst = (src + 1) % self.nodes
                if self.node == src:
                    for _ in range(EXCHANGES + 1):
                        dist.recv(ask, dst * self.local_world)
                        dist.send(buffer, dst * self.local_world)
                elif self.node == dst:
                    self._receive(src, buffer, ask)
        if self.rank != 0:
            return []
        return [json.loads(self.store.get(f"link/{n}").decode()) for n in range(self.nodes)]

    def _receive(self, src: int, buffer: Any, ask: Any) -> None:
        import torch
        import torch.distributed as dist

        times = []
        for i in range(EXCHANGES + 1):  # the first opens the connection: not timed
            buffer.zero_()
            if self.device == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
            dist.send(ask, src * self.local_world)
            dist.recv(buffer, src * self.local_world)
            if self.device == "cuda":
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - began)
        if int(buffer[0].item()) != 1 or int(buffer[-1].item()) != 1:
            raise _StepFailed(f"the bytes node {src} sent arrived changed", blame=[src * self.local_world])
        seconds = statistics.median(times)
        self.store.set(f"link/{self.node}", json.dumps(
            {"src": src, "dst": self.node, "seconds": seconds, "GB/s": self.nbytes / seconds / 1e9}))

    def _barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def _destroy_group(self) -> None:
        import torch.distributed as dist

        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the user's own group starts from scratch either way
            pass

    def _where(self) -> dict[int, dict[str, Any]]:
        """Every rank's place: its own word where it arrived, else its node's peers'."""
        where: dict[int, dict[str, Any]] = {}
        for rank in range(self.world):
            where[rank] = self._json(f"id/{rank}") or {"node": rank // max(1, self.local_world)}
        for rank, info in where.items():
            if "host" not in info:
                peer = next((w for w in where.values() if w.get("node") == info["node"] and "host" in w), None)
                if peer is not None:
                    info.update(host=peer["host"], instance=peer.get("instance", ""))
        return where

    def _report(self, started: float, links: list[dict[str, Any]]) -> dict[str, Any]:
        where = self._where()
        rows = []
        for link in links:
            src, dst = where.get(link["src"] * self.local_world, {}), where.get(link["dst"] * self.local_world, {})
            rows.append({"from node": link["src"], "to node": link["dst"],
                         "from": src.get("instance") or src.get("host", ""), "to": dst.get("instance") or dst.get("host", ""),
                         "GB/s": round(link["GB/s"], 3), "ms": round(link["seconds"] * 1000, 2)})
        slow_links, slow_nodes = slow(rows)
        return {"seconds": round(time.monotonic() - started, 3), "ranks": self.world, "nodes": self.nodes,
                "backend": "nccl" if self.device == "cuda" else "gloo", "bytes": self.nbytes, "links": rows,
                "slow_links": slow_links, "slow_nodes": slow_nodes, "warnings": self._all_warnings(),
                **({"network": self.network} if self.network else {}),
                "where": {str(r): w for r, w in where.items()}}

    def _all_warnings(self) -> list[str]:
        if self.warnings:
            self.store.set(f"warn/{self.rank}", json.dumps(self.warnings))
        found = []
        for rank in range(self.world):
            found.extend(f"rank {rank}: {w}" for w in (self._json(f"warn/{rank}") or []))
        return found

    # --- failure ------------------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        from prefect_sgpu.errors import GangCheckFailed

        blame = list(getattr(exc, "blame", []))
        # a rank that names others (missing, or with a wrong value) is not itself at fault
        collateral = isinstance(exc, _PeerFailed) or bool(blame and self.rank not in blame)
        record = {"error": str(exc), "collateral": collateral, "blame": blame}
        try:
            self.store.set(f"err/{self.rank}", json.dumps(record))
            self.store.add("failed", 1)
            deadline = time.monotonic() + GRACE_S  # the peers' own errors, which arrive within a poll
            while time.monotonic() < deadline and not all(self._has(f"err/{r}") for r in range(self.world)):
                time.sleep(_POLL_S)
            failed = self._compose()
        except Exception:  # noqa: BLE001 - the store itself failed: say what this rank saw
            failed = {self.rank: {"node": self.node, "host": socket.gethostname(),
                                  "instance": os.environ.get("SGPU_INSTANCE_ID") or "", **record}}
        raise GangCheckFailed(self.run_id, failed, f"{self.world} ranks on {self.nodes} node(s)") from None

    def _compose(self) -> dict[int, dict[str, Any]]:
        where = self._where()
        failed: dict[int, dict[str, Any]] = {}
        records = {rank: self._json(f"err/{rank}") for rank in range(self.world)}
        for rank, record in records.items():  # each rank's own word first
            if record is not None:
                failed[rank] = {**where[rank], "error": record["error"], "collateral": record["collateral"]}
        for rank, record in records.items():  # then whom it named: a named rank is at fault, even one
            for blamed in (record or {}).get("blame") or []:  # that stopped for another's error itself
                if blamed != rank and (blamed not in failed or failed[blamed].get("collateral")):
                    failed[blamed] = {**where[int(blamed)], "error": f"named by rank {rank}: {record['error']}",
                                      "collateral": False}
        return failed


def data_address(device: str) -> str:
    """The IPv4 address this rank's backend sends from: the first interface of ``GLOO_SOCKET_IFNAME``
    (CPU) or ``NCCL_SOCKET_IFNAME`` (GPU) where one is named, else the host name's address, as gloo's
    default device takes it."""
    import fcntl
    import struct

    names = os.environ.get("NCCL_SOCKET_IFNAME" if device == "cuda" else "GLOO_SOCKET_IFNAME", "")
    name = names.split(",")[0].strip().lstrip("=")
    if not name or name.startswith("^"):
        return socket.gethostbyname(socket.gethostname())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:  # SIOCGIFADDR: the interface's IPv4 address
            packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        except OSError as exc:
            raise _StepFailed(f"no IPv4 address on network interface {name!r} (named by "
                              f"{'NCCL' if device == 'cuda' else 'GLOO'}_SOCKET_IFNAME): {exc.strerror or exc}") from None
    return socket.inet_ntoa(packed[20:24])


def _accept_all(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # closed: the probe is over
        conn.close()


def slow(links: list[dict[str, Any]], factor: float = SLOW_FACTOR) -> tuple[list[str], list[int]]:
    """The links far slower than the faster half of them, and the nodes on every one of them (named only
    where the links tell nodes apart: three nodes or more)."""
    if len(links) < 2:
        return [], []
    # the reference is the faster half's median: one slow node slows two links of a ring, which with
    # three nodes is most of them
    speeds = sorted((link["GB/s"] for link in links), reverse=True)
    reference = statistics.median(speeds[: (len(speeds) + 1) // 2])
    bad = [link for link in links if link["GB/s"] * factor < reference]
    named = [f"node {link['from node']} -> node {link['to node']}: {link['GB/s']:g} GB/s against "
             f"{reference:.3g} GB/s on the faster links" for link in bad]
    if not bad or len(links) < 3:
        return named, []
    common = set.intersection(*({link["from node"], link["to node"]} for link in bad))
    return named, sorted(common) if len(common) == 1 else []


def describe(report: dict[str, Any]) -> tuple[str, list[str]]:
    """The log line of a passed check, and one warning per slow link, slow node or GPU warning."""
    links = "; ".join(f"node {link['from node']} -> {link['to node']} {link['GB/s']:g} GB/s"
                      for link in report.get("links") or [])
    info = (f"gang check passed: {report['ranks']} rank(s) on {report['nodes']} node(s) in {report['seconds']:g} s "
            f"over {report['backend']}" + (f"; links: {links}" if links else ""))
    network = report.get("network")
    if network:
        info += f"; network: {network['transport']}, all-reduce {network['bus GB/s']:g} GB/s bus bandwidth"
    warnings = [f"gang check: slow link {text}" for text in report.get("slow_links") or []]
    warnings += [f"gang check: node {node} is on every slow link" for node in report.get("slow_nodes") or []]
    warnings += [f"gang check: {text}" for text in report.get("warnings") or []]
    return info, warnings


def _nvml_findings(device_index: int) -> tuple[list[str], list[str]]:
    """What NVML says is wrong with this GPU: faults (uncorrectable ECC errors) and warnings
    (hardware slowdown); nothing where ``nvidia-ml-py`` is not installed."""
    try:
        import pynvml
    except ImportError:
        return [], []
    faults: list[str] = []
    found: list[str] = []
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML: nothing to read
        return [], []
    try:
        visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        index = int(visible[device_index]) if visible and visible[device_index].isdigit() else device_index
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        try:
            ecc = pynvml.nvmlDeviceGetTotalEccErrors(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                     pynvml.NVML_VOLATILE_ECC)
            if ecc:
                faults.append(f"GPU {index}: {ecc} uncorrectable ECC error(s) since boot")
        except pynvml.NVMLError:
            pass  # ECC off or not supported on this GPU
        try:
            reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
            named = {"hardware slowdown": getattr(pynvml, "nvmlClocksThrottleReasonHwSlowdown", 0),
                     "thermal slowdown": getattr(pynvml, "nvmlClocksThrottleReasonHwThermalSlowdown", 0),
                     "power brake": getattr(pynvml, "nvmlClocksThrottleReasonHwPowerBrakeSlowdown", 0)}
            hits = [name for name, bit in named.items() if bit and reasons & bit]
            if hits:
                found.append(f"GPU {index} is throttled: " + ", ".join(hits))
        except pynvml.NVMLError:
            pass
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return faults, found
