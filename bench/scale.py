"""Provisioning at scale on EC2 (simulated): AWS calls and seconds per launch for 8, 32 and 128 nodes.

Runs offline, like the test suite and ``bench/faults.py``: a moto server (``ThreadedMotoServer``
on 127.0.0.1) behind the tests' fault proxy (``tests/support/aws_fault_proxy.py``: it adds the
placement groups moto lacks), a fresh VPC in 127.0.0.0/8 and bucket per size, real boto3 clients.
The driver side is the project's own code, called as ``Job`` calls it:
``EC2InstanceCompute.from_settings`` -> ``plan`` -> (payload and first heartbeat) -> ``acquire``
-> ``start`` -> ``poll`` -> ``release`` -> ``JobFolder.delete_control_files``. A 1-node launch
first warms imports and is not reported.

**Counting.** Every AWS API call the *driver* makes is counted at the boto3 level with botocore's
event system, on the one boto3 session the compute and its S3 store are built from:
``before-call.<service>.<Operation>`` (one per API call: each paginator page and each waiter poll
counts), ``after-call`` (error answers, e.g. ``GetObject -> NoSuchKey``, and each call's latency)
and ``before-send`` (HTTP requests, retries included). The simulator and the nodes use other
sessions and are not counted. Calls of acquire's heartbeat thread are labelled ``[heartbeat]``:
they grow with time, not with nodes. (The proxy's request log would see everyone's calls mixed.)

**Timing** (phases are the compute's own progress lines, read by a logging handler): ``acquire``
from its start to RunInstances sent (sweep, SSM key, subnets, AMI, groups before it), to
"running" (the ``instance_running`` waiter, DescribeInstances), to the first and the last
"agent up": acquire returns once it has read and verified every node's sealed
``nodes/node-<i>.alive`` (bound to its index and instance id), which is what "ready" means
there. For stubs, the moment the last one wrote its alive is reported too (the difference is
the driver's own polling lag). ``start``: one sealed launch document per node. One full
``poll`` pass (one listing of the node documents, whose versions say which alive documents
changed, and instance states: what the driver's loop does every 5 s; the listing alone every
second). ``release``: terminate by id and tag, wait for "terminated",
delete the groups and the SSM key. Its TerminateInstances includes the simulated power-off: the
proxy answers only once the simulator has stopped the nodes.

**Node side: what is real and what is stubbed.** Real everywhere: the driver, moto, one
RunInstances for all nodes, the simulator loop of ``tests/support/ec2_simulator.py`` (watches
moto, reads each instance's user-data with DescribeInstanceAttribute, serves it its own fake
IMDSv2, powers it off when EC2 says terminated). *real bootstrap* rows (sizes up to
``--real-up-to``, default 8): that simulator runs each instance's user-data as a process (bash,
then ``python -m prefect_sgpu.launch.bootstrap``; the launch document's node agent only sleeps,
so no torch). 128 such processes, each polling the store every second, do not fit on a 2-core
machine, and 32 would swamp one the test suite shares. *stub* rows (every size): the same
simulator hands each instance to ONE helper process (this file with ``--node-host``) that runs
a thread per instance doing what the bootstrap does up to "agent up", with the bootstrap's own
code: the bootstrap arguments from the instance's user-data, instance id / launch index /
local-ipv4 from its IMDSv2 (token PUT, GETs), ``NodeBootstrap.read_key`` (SSM GetParameter of
the job key), ``publish_alive`` (the sealed alive document); then it idles until powered off.
Not in a stub: bash, the backstop, a Python start-up per node, refreshed alive documents,
reading the launch document, the node agent; stub threads share one boto3 client per service.
Not simulated at all: a real VM's boot (minutes on EC2) and AWS's own latencies.

**The proxy is switched to HTTP/1.1** in this process (``--proxy-http10`` leaves it as the
tests use it): on HTTP/1.0 ``http.server`` never answers the ``Expect: 100-continue`` botocore
sends with every S3 PutObject body, so each PutObject waits botocore's 1 s timeout before
sending the body anyway, a cost AWS does not have.

    ./dev bench scale [--quick] [--sizes 8,32,128] [--real-up-to 8] [--waiter-delay 0.5] [--proxy-http10]

``--quick``: 8 and 32 nodes, stub node side only (under ~90 s, for ``bench all``). Under ~5
minutes by default on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

#: what the tests' EC2 environment uses (support.conformance_ec2), longer where 128 nodes need it
HEARTBEAT_TTL_S = 60.0
AGENT_TIMEOUT_S = 240.0
RUNNING_TIMEOUT_S = 180.0
#: the driver's own cadences (prefect_sgpu.driver.job)
POLL_INTERVAL_S = 0.05
HEARTBEAT_INTERVAL_S = 2.0


# --- the stub node side: one helper process, one thread per instance ---------------------


def node_host() -> int:
    """``--node-host``: JSON lines on stdin (``boot``, ``off``), answers on stdout (``up``, ``off``, ``error``)."""
    from prefect_sgpu import aws
    from prefect_sgpu.launch import bootstrap as bs
    from prefect_sgpu.launch import ec2_host as eh
    from prefect_sgpu.launch.ec2_stage import imds_get, imds_token
    from prefect_sgpu.launch.node_host import NodeIdentity
    from prefect_sgpu.store.s3 import S3Store

    logging.getLogger("urllib3").setLevel(logging.ERROR)  # "connection pool is full" with 128 threads
    out_lock, client_lock = threading.Lock(), threading.Lock()
    clients: dict[tuple[str, str | None, str | None], Any] = {}
    stops: dict[str, threading.Event] = {}
    threads: dict[str, threading.Thread] = {}

    def say(**message: Any) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()

    def client(service: str, region: str | None, endpoint: str | None) -> Any:
        with client_lock:  # creating clients is not thread-safe; using them is
            key = (service, region, endpoint)
            if key not in clients:
                clients[key] = aws.client(service, region=region, endpoint_url=endpoint)
            return clients[key]

    def boot(iid: str, imds: str, user_data: str, node_dir: str) -> None:
        stop = stops[iid]
        try:
            line = next(x for x in user_data.splitlines() if " -m prefect_sgpu.launch.bootstrap " in x)
            argv = [a for a in shlex.split(line) if not a.startswith("--backstop-marker")]
            assert argv[1:3] == ["-m", "prefect_sgpu.launch.bootstrap"], argv
            args = bs.parse_args(argv[3:])
            token = imds_token((2.0,), base=imds)
            identity = NodeIdentity(instance_id=imds_get("instance-id", token, (2.0,), base=imds),
                                    launch_index=int(imds_get("ami-launch-index", token, (2.0,), base=imds)),
                                    private_ip=imds_get("local-ipv4", token, (2.0,), base=imds))
            store = S3Store(args.store, region=args.region, endpoint_url=args.endpoint_url,
                            client=client("s3", args.region, args.endpoint_url),
                            kms_key_id=args.store_kms_key, bucket_owner=args.bucket_owner)
            host = eh.EC2NodeHost(args.region, args.endpoint_url)
            host._clients["ssm"] = client("ssm", args.region, args.endpoint_url)
            node = bs.NodeBootstrap(store, args.run_id, identity, Path(node_dir), args.heartbeat_ttl,
                                    interval=args.interval, host=host)
            if stop.is_set():
                return
            key = node.read_key()
            if key is None or stop.is_set():
                return
            node.use_key(key)
            node.publish_alive(force=True)
            say(op="up", iid=iid, t=time.time())
            stop.wait()
        except Exception as exc:  # noqa: BLE001 - reported to the bench, which fails loudly
            if not stop.is_set():
                say(op="error", iid=iid, error=f"{type(exc).__name__}: {exc}")

    for raw in sys.stdin:
        msg = json.loads(raw)
        iid = msg["iid"]
        if msg["op"] == "boot":
            stops[iid] = threading.Event()
            threads[iid] = threading.Thread(target=boot, name=f"node-{iid}", daemon=True,
                                            args=(iid, msg["imds"], msg["user_data"], msg["node_dir"]))
            threads[iid].start()
        elif msg["op"] == "off":
            if iid in stops:
                stops[iid].set()
                threads[iid].join(timeout=20)
            say(op="off", iid=iid, alive=bool(iid in threads and threads[iid].is_alive()))
    return 0


class _HostedNode:
    """What the simulator keeps as a node's process: a thread in the helper process."""

    def __init__(self, host: "NodeHost", iid: str) -> None:
        self.host, self.iid = host, iid
        self.pid = host.proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.host.wait_off(self.iid, timeout):
            raise subprocess.TimeoutExpired(f"node {self.iid}", timeout or 0)
        self.returncode = 0
        return 0


class NodeHost:
    """The driver-side end of the ``--node-host`` helper process."""

    def __init__(self, env: dict[str, str], workdir: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--node-host"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
                                     cwd=workdir)
        self.up: dict[str, float] = {}
        self.errors: list[str] = []
        self._off: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="node-host-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            if msg["op"] == "up":
                self.up[msg["iid"]] = msg["t"]
            elif msg["op"] == "off":
                if msg.get("alive"):
                    self.errors.append(f"{msg['iid']}: its thread outlived power-off")
                self._event(msg["iid"]).set()
            else:
                self.errors.append(f"{msg['iid']}: {msg.get('error')}")

    def _event(self, iid: str) -> threading.Event:
        with self._lock:
            return self._off.setdefault(iid, threading.Event())

    def _send(self, **message: Any) -> None:
        assert self.proc.stdin is not None
        with self._lock:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()

    def boot(self, iid: str, imds_url: str, user_data: str, node_dir: Path) -> _HostedNode:
        self._event(iid)
        self._send(op="boot", iid=iid, imds=imds_url, user_data=user_data, node_dir=str(node_dir))
        return _HostedNode(self, iid)

    def power_off(self, iid: str) -> None:
        self._send(op="off", iid=iid)

    def wait_off(self, iid: str, timeout: float | None) -> bool:
        return self._event(iid).wait(timeout)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _stub_simulator_class() -> type:
    from support.ec2_simulator import EC2Simulator, SimulatedNode

    class StubSimulator(EC2Simulator):
        """The tests' simulator, booting each instance as a stub thread in the helper process."""

        host: NodeHost

        def _boot(self, inst: dict[str, Any]) -> SimulatedNode:  # as EC2Simulator._boot, minus the process
            iid = inst["InstanceId"]
            user_data, moto_ip, address, imds, _credentials = self._identity(inst)
            home = self.workdir / iid
            home.mkdir(parents=True, exist_ok=True)
            proc = self.host.boot(iid, imds.url, user_data, home / "jobs")
            return SimulatedNode(iid, int(inst.get("AmiLaunchIndex", 0)), moto_ip, address, imds,
                                 proc, home / "console.log", user_data)  # type: ignore[arg-type]

        def _power_off(self, node: SimulatedNode) -> None:
            node.killed = True
            self.host.power_off(node.instance_id)
            try:
                node.proc.wait(timeout=25)
            except subprocess.TimeoutExpired:
                self.errors.append(f"{node.instance_id}: the stub did not stop")

    return StubSimulator


# --- counting and phases -----------------------------------------------------------------


class CallCounter:
    """Every API call made through one boto3 session, by (service, operation), from botocore's events."""

    def __init__(self, session: Any) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()
        self.errors: Counter[tuple[str, str, str]] = Counter()
        self.seconds: Counter[tuple[str, str]] = Counter()
        self.sends = 0
        self._lock = threading.Lock()
        events = session.events  # boto3.Session -> the botocore session's emitter, copied into each client
        events.register("before-call", self._before_call)
        events.register("after-call", self._after_call)
        events.register("before-send", self._before_send)

    @staticmethod
    def _name(event_name: str) -> tuple[str, str]:
        _, service, operation = event_name.split(".", 2)
        if threading.current_thread().name.startswith(("sgpu-ec2-beat", "sgpu-ec2-lease")):
            operation += " [heartbeat]"
        return service, operation

    def _before_call(self, event_name: str, context: Any = None, **_: Any) -> None:
        if isinstance(context, dict):
            context["sgpu_bench_t0"] = time.monotonic()
        with self._lock:
            self.calls[self._name(event_name)] += 1

    def _after_call(self, event_name: str, parsed: Any = None, context: Any = None, **_: Any) -> None:
        code = (parsed or {}).get("Error", {}).get("Code") if isinstance(parsed, dict) else None
        name = self._name(event_name)
        t0 = context.get("sgpu_bench_t0") if isinstance(context, dict) else None
        with self._lock:
            if code:
                self.errors[(*name, str(code))] += 1
            if t0 is not None:
                self.seconds[name] += time.monotonic() - t0

    def _before_send(self, **_: Any) -> None:
        with self._lock:
            self.sends += 1

    def snapshot(self) -> "Snapshot":
        with self._lock:
            return Snapshot(Counter(self.calls), Counter(self.errors), self.sends, Counter(self.seconds))


@dataclass
class Snapshot:
    calls: Counter
    errors: Counter
    sends: int
    seconds: Counter = field(default_factory=Counter)

    def __sub__(self, other: "Snapshot") -> "Snapshot":
        return Snapshot(self.calls - other.calls, self.errors - other.errors, self.sends - other.sends,
                        Counter({k: v - other.seconds.get(k, 0.0) for k, v in self.seconds.items()}))

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def per_node(self) -> int:
        """Calls of the operations that are made once per node per look (store reads of node documents)."""
        reads = ("GetObject", "ListObjectsV2")
        return sum(n for (svc, op), n in self.calls.items() if svc == "s3" and op in reads)

    def without_heartbeat(self) -> int:
        return sum(n for (_svc, op), n in self.calls.items() if not op.endswith("[heartbeat]"))


class Phases(logging.Handler):
    """The compute's progress lines ("requested", "provisioning", "running", "agent up"), timed and
    with the call counter read at each (the line is logged in the acquiring thread, between calls)."""

    def __init__(self, counter: CallCounter) -> None:
        super().__init__(logging.INFO)
        self.counter = counter
        self.marks: list[tuple[float, str, str, Snapshot]] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if not text.startswith("[ec2 "):
            return
        body = text.split("] ", 1)[1]
        phase, _, detail = body.partition(": ")
        self.marks.append((time.monotonic(), phase, detail, self.counter.snapshot()))

    def first(self, phase: str, startswith: str = "") -> tuple[float, Snapshot]:
        t, _p, _d, snap = next(m for m in self.marks if m[1] == phase and m[2].startswith(startswith))
        return t, snap

    def last(self, phase: str) -> tuple[float, Snapshot]:
        t, _p, _d, snap = [m for m in self.marks if m[1] == phase][-1]
        return t, snap


# --- one size ------------------------------------------------------------------------------


@dataclass
class Result:
    nodes: int
    node_side: str
    plan_calls: int = 0
    prep_calls: int = 0
    acquire_s: float = 0.0
    to_sent_s: float = 0.0
    to_running_s: float = 0.0
    first_up_s: float = 0.0
    last_up_s: float = 0.0
    nodes_reported_s: float | None = None  # last stub "up" (its alive written), from acquire's start
    acquire: Snapshot | None = None
    acquire_parts: dict[str, Snapshot] = field(default_factory=dict)
    start_s: float = 0.0
    start: Snapshot | None = None
    poll_s: float = 0.0
    poll: Snapshot | None = None
    release_s: float = 0.0
    release: Snapshot | None = None
    cleanup_s: float = 0.0
    cleanup: Snapshot | None = None
    gone: int = 0


@contextmanager
def environment(aws: Any, proxy: Any, workdir: Path, stub: bool,
                waiter_delay: float) -> Iterator[tuple[dict, Any]]:
    """What ``support.conformance_ec2.ec2_environment`` sets up (bucket, settings, simulator, the proxy's
    power-off hook, the leak checks at the end), with the stub simulator when asked."""
    from support.aws_fixtures import create_network, free_port, live_instances
    from support.ec2_simulator import EC2Simulator

    network = create_network(aws)
    bucket = f"sgpu-scale-{uuid.uuid4().hex[:12]}"
    aws.client("s3").create_bucket(Bucket=bucket)
    settings = {
        "region": aws.region, "subnet_ids": network.subnet_ids, "instance_profile": aws.instance_profile(),
        "ami_id": aws.image_id(), "store_uri": f"s3://{bucket}/jobs", "endpoint_url": aws.endpoint_url,
        "heartbeat_ttl_s": HEARTBEAT_TTL_S, "agent_timeout_s": AGENT_TIMEOUT_S, "rendezvous_port": free_port(),
        "running_timeout_s": RUNNING_TIMEOUT_S, "waiter_delay_s": waiter_delay,
    }
    node_env = {k: v for k, v in aws.env.items() if k not in ("AWS_ENDPOINT_URL", "AWS_SECURITY_TOKEN",
                                                               "AWS_SESSION_TOKEN")}
    host = None
    if stub:
        host = NodeHost({"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT),
                         "HOME": str(workdir), "LANG": "C.UTF-8", "AWS_CONFIG_FILE": os.devnull,
                         "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                         "PREFECT_SGPU_HOME": str(workdir / "sgpu-home"),
                         **node_env}, workdir)
        cls = _stub_simulator_class()
        simulator = cls(aws.client("ec2"), node_env, workdir)
        simulator.host = host
    else:
        simulator = EC2Simulator(aws.client("ec2"), node_env, workdir)
    simulator.start()
    proxy.on_terminate = lambda ids: simulator.wait_powered_off(ids, timeout=60)
    try:
        yield settings, (simulator, host)
        leaked = [i["InstanceId"] for i in live_instances(aws.client("ec2"))]
        assert not leaked, f"instances left running: {leaked}"
        assert simulator.wait_powered_off(list(simulator.nodes), timeout=30), simulator.describe()
        assert not simulator.errors, simulator.errors
        assert host is None or not host.errors, host.errors
    finally:
        proxy.on_terminate = None
        simulator.close()
        if host is not None:
            host.close()


def run_size(aws: Any, proxy: Any, nodes: int, stub: bool, waiter_delay: float, gpu_type: str) -> Result:
    from prefect_sgpu.compute.base import JobLaunch, NodeCommand
    from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute
    from prefect_sgpu.driver.job import new_run_id
    from prefect_sgpu.driver.heartbeat import DriverHeartbeat
    from prefect_sgpu.protocol.jobfolder import JobFolder, new_key
    from prefect_sgpu.spec import JobSpec

    result = Result(nodes, "stub" if stub else "real bootstrap")
    workdir = Path(tempfile.mkdtemp(prefix=f"sgpu-bench-scale-{nodes}-"))
    with environment(aws, proxy, workdir, stub, waiter_delay) as (settings, (simulator, host)):
        session = aws.session()
        counter = CallCounter(session)  # before any client of this session exists
        compute = EC2InstanceCompute.from_settings(settings, session=session)
        phases = Phases(counter)
        progress_logger = logging.getLogger("prefect_sgpu.compute.remote.nodes")
        progress_logger.addHandler(phases)
        progress_logger.setLevel(logging.INFO)
        try:
            spec = JobSpec(gpus=nodes, nodes=nodes, gpu_type=gpu_type, remote=True, mlflow=False, timeout=1800)
            run_id = new_run_id("scale")
            s0 = counter.snapshot()
            request = compute.plan(spec, run_id)
            s1 = counter.snapshot()
            result.plan_calls = (s1 - s0).total
            folder = JobFolder(compute.store, run_id, new_key())
            folder.put_payload(b"bench/scale.py: no payload is run")  # what Job._run writes before acquire
            heartbeat = DriverHeartbeat(folder).start()  # the driver's own, as Job._run keeps it
            s2 = counter.snapshot()
            result.prep_calls = (s2 - s1).total

            t0 = time.monotonic()
            allocation = compute.acquire(request, folder, t0 + 1800, threading.Event())
            t1 = time.monotonic()
            s3 = counter.snapshot()
            result.acquire_s, result.acquire = t1 - t0, s3 - s2
            t_sent, snap_sent = phases.first("provisioning", "run_instances")
            t_launched, snap_launched = phases.first("provisioning", "launched")
            t_running, snap_running = phases.first("running")
            t_first, _ = phases.first("agent up")
            t_last, _ = phases.last("agent up")
            result.to_sent_s, result.to_running_s = t_sent - t0, t_running - t0
            result.first_up_s, result.last_up_s = t_first - t0, t_last - t0
            result.acquire_parts = {
                "before run_instances (sweep, SSM key, subnets, AMI, groups)": snap_sent - s2,
                "run_instances": snap_launched - snap_sent,
                "wait for running": snap_running - snap_launched,
                "wait for agents": s3 - snap_running,
            }
            if host is not None and len(host.up) == nodes:
                # the helper's wall clock -> this process's monotonic clock
                wall_t0 = time.time() - (time.monotonic() - t0)
                result.nodes_reported_s = max(host.up.values()) - wall_t0

            # start: one sealed launch document per node (a node agent that only sleeps: real
            # bootstraps run it, stubs never read it)
            argv = ["python3", "-c", "import time; time.sleep(3600)"]
            launch = JobLaunch(env={}, commands=[NodeCommand(n.index, argv) for n in allocation.nodes],
                               rendezvous=compute.rendezvous_endpoint(allocation))
            t2 = time.monotonic()
            compute.start(allocation, launch)
            t3 = time.monotonic()
            s4 = counter.snapshot()
            result.start_s, result.start = t3 - t2, s4 - s3

            # one full pass of the driver's poll (Job._wait calls it every 50 ms; the compute lists the
            # node documents at most every poll_interval_s = 1 s, and asks for instance states every 5 s)
            allocation.polled = allocation.states_checked = 0.0
            compute.poll(allocation)
            t4 = time.monotonic()
            s5 = counter.snapshot()
            result.poll_s, result.poll = t4 - t3, s5 - s4

            released = compute.release(allocation)
            t5 = time.monotonic()
            s6 = counter.snapshot()
            result.release_s, result.release, result.gone = t5 - t4, s6 - s5, len(released.gone)
            heartbeat.stop()
            folder.delete_control_files()  # what Job._cleanup does last
            t6 = time.monotonic()
            result.cleanup_s, result.cleanup = t6 - t5, counter.snapshot() - s6
        finally:
            progress_logger.removeHandler(phases)
    shutil.rmtree(workdir, ignore_errors=True)  # the nodes' home folders (powered off by now)
    return result


# --- report --------------------------------------------------------------------------------


def _ops(snap: Snapshot | None) -> str:
    if snap is None:
        return ""
    return ", ".join(f"{svc}:{op} {n} ({1000 * snap.seconds[(svc, op)] / n:.0f} ms)"
                     for (svc, op), n in sorted(snap.calls.items()))


def _errors(snap: Snapshot | None) -> str:
    if snap is None or not snap.errors:
        return ""
    return ", ".join(f"{op}->{code} {n}" for (_svc, op, code), n in sorted(snap.errors.items()))


def _provisioning(snap: Snapshot) -> int:
    """EC2, SSM and STS calls: what provisions and tears down (everything but the job store)."""
    return sum(n for (svc, _op), n in snap.calls.items() if svc != "s3")


def report(results: list[Result], args: argparse.Namespace) -> None:
    import boto3
    import moto

    for r in results:
        assert r.acquire and r.start and r.poll and r.release and r.cleanup
        print(f"\n### {r.nodes} nodes, node side: {r.node_side}")
        print(f"plan: {r.plan_calls} AWS calls; payload + first heartbeat before acquire: {r.prep_calls} calls")
        up = "" if r.nodes_reported_s is None else f" (the last stub wrote its alive at {r.nodes_reported_s:.2f} s)"
        print(f"acquire {r.acquire_s:.2f} s: run_instances sent at {r.to_sent_s:.2f} s, running at "
              f"{r.to_running_s:.2f} s, first agent up seen at {r.first_up_s:.2f} s, last at {r.last_up_s:.2f} s{up}")
        print(f"acquire: {r.acquire.total} calls ({r.acquire.sends} HTTP requests, retries included): "
              f"{_ops(r.acquire)}")
        print(f"  error answers: {_errors(r.acquire) or 'none'}")
        for name, snap in r.acquire_parts.items():
            print(f"  {name}: {snap.total}: {_ops(snap)}")
        print(f"start {r.start_s:.2f} s, {r.start.total} calls: {_ops(r.start)}")
        print(f"one full poll pass {r.poll_s:.2f} s, {r.poll.total} calls: {_ops(r.poll)}")
        print(f"  error answers: {_errors(r.poll) or 'none'}")
        print(f"release {r.release_s:.2f} s, {r.release.total} calls ({r.gone} things removed): {_ops(r.release)}")
        print(f"control-file cleanup after release {r.cleanup_s:.2f} s, {r.cleanup.total} calls: {_ops(r.cleanup)}")

    rows = [r for r in results if r.node_side == "stub"] or results  # the same node side at every size
    load = os.getloadavg()
    machine = f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()}, load {load[0]:.1f})"

    every_op = sorted({k for r in rows for s in (r.acquire, r.start, r.poll, r.release) if s for k in s.calls})
    print("\nDriver API calls per operation: acquire + start + one poll pass + release (stub node side)\n")
    print("| operation | " + " | ".join(f"{r.nodes} nodes" for r in rows) + " |")
    print("| --- |" + " --- |" * len(rows))
    for key in every_op:
        cells = [" + ".join(str(s.calls[key] if s else 0) for s in (r.acquire, r.start, r.poll, r.release))
                 for r in rows]
        print(f"| {key[0]}:{key[1]} | " + " | ".join(cells) + " |")

    print(f"\n| date | machine | versions | nodes | node side | launch calls (acquire + start) | acquire calls: "
          "EC2/SSM / S3 node-document reads / S3 heartbeat | start calls (S3 PutObject) | acquire s: running / "
          "all agents up (driver saw the last alive after) | poll pass: calls / s | release calls | release s "
          "(TerminateInstances incl. simulated power-off) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        assert r.acquire and r.start and r.poll and r.release
        heartbeat = r.acquire.total - r.acquire.without_heartbeat()
        lag = "" if r.nodes_reported_s is None else f" (+{r.last_up_s - r.nodes_reported_s:.2f})"
        terminate = r.release.seconds.get(("ec2", "TerminateInstances"), 0.0)
        print(f"| {dt.date.today()} | {machine} | boto3 {boto3.__version__}, moto {moto.__version__} | {r.nodes} | "
              f"{r.node_side} | {r.acquire.total + r.start.total} | {_provisioning(r.acquire)} / "
              f"{r.acquire.per_node()} / {heartbeat} | {r.start.total} | "
              f"{r.to_running_s:.2f} / {r.acquire_s:.2f}{lag} "
              f"| {r.poll.total} / {r.poll_s:.2f} | {r.release.total} | {r.release_s:.2f} ({terminate:.2f}) |")

    if len(rows) > 1:
        small, big = rows[0], rows[-1]

        def cell(values: list[float], fmt: str) -> str:
            ratio = f"{values[-1] / values[0]:.2f}" if values[0] else "-"
            return " | ".join(format(v, fmt) for v in values) + f" | {ratio}"

        measures: list[tuple[str, list[float], str]] = [
            ("launch calls, all (acquire + start)",
             [r.acquire.total + r.start.total for r in rows if r.acquire and r.start], "d"),
            ("acquire calls, EC2 + SSM (provisioning)",
             [_provisioning(r.acquire) for r in rows if r.acquire], "d"),
            ("acquire calls, S3 reads of alive documents", [r.acquire.per_node() for r in rows if r.acquire], "d"),
            ("acquire calls, S3 heartbeat (time, not nodes)",
             [r.acquire.total - r.acquire.without_heartbeat() for r in rows if r.acquire], "d"),
            ("start calls (one launch document per node)", [r.start.total for r in rows if r.start], "d"),
            ("one poll pass, calls", [r.poll.total for r in rows if r.poll], "d"),
            ("release calls", [r.release.total for r in rows if r.release], "d"),
            ("acquire s to running", [r.to_running_s for r in rows], ".2f"),
            ("acquire s to all agents up", [r.acquire_s for r in rows], ".2f"),
            ("start s", [r.start_s for r in rows], ".2f"),
            ("one poll pass, s", [r.poll_s for r in rows], ".2f"),
            ("release s", [r.release_s for r in rows], ".2f"),
        ]
        print(f"\nGrowth with the node count (stub node side), ratio = {big.nodes} vs {small.nodes} nodes "
              f"(x{big.nodes / small.nodes:g} nodes):\n")
        print("| measure | " + " | ".join(f"{r.nodes} nodes" for r in rows) + f" | ratio {big.nodes}/{small.nodes} |")
        print("| --- |" + " --- |" * (len(rows) + 1))
        for name, values, fmt in measures:
            print(f"| {name} | {cell(values, fmt)} |")
    print(f"\nload average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min); "
          f"{args.gpu_type} nodes (one GPU each), waiter_delay_s {args.waiter_delay:g}, AWS = moto "
          f"{moto.__version__} behind the tests' fault proxy "
          f"({'HTTP/1.0, as in the tests' if args.proxy_http10 else 'on HTTP/1.1: see the module docstring'}), "
          "all on this machine.")
    print("real: the driver (EC2InstanceCompute plan/acquire/start/poll/release, its boto3 clients, the S3 store), "
          "moto, RunInstances of every node, DescribeInstanceAttribute user-data, a fake IMDSv2 per instance. "
          "'real bootstrap' rows: every node is its user-data run as a process (bash, python -m "
          "prefect_sgpu.launch.bootstrap; its node agent only sleeps). 'stub' rows: a thread per instance in one "
          "helper process runs the bootstrap's own code up to agent up (user-data arguments, IMDSv2 identity, "
          "NodeBootstrap.read_key from SSM, publish_alive), then idles until powered off; no process, bash, "
          "backstop, launch-document read or node agent per node.")


def main() -> None:
    if "--node-host" in sys.argv[1:]:
        sys.exit(node_host())
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 and 32 nodes, stub node side only")
    parser.add_argument("--sizes", default="8,32,128", help="node counts, comma-separated")
    parser.add_argument("--real-up-to", type=int, default=8,
                        help="sizes up to this also run with real bootstrap processes (0: none)")
    parser.add_argument("--waiter-delay", type=float, default=0.5,
                        help="waiter_delay_s of the EC2 settings (the tests' 0.5; the settings' default is 5)")
    parser.add_argument("--proxy-http10", action="store_true",
                        help="leave the fault proxy on HTTP/1.0, as the tests use it (every S3 PutObject then "
                             "waits 1 s for a 100-continue that never comes)")
    parser.add_argument("--gpu-type", default="A10", help="catalog GPU type; nodes = gpus (one per node)")
    args = parser.parse_args()
    sizes = [8, 32] if args.quick else [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.quick:
        args.real_up_to = 0

    os.environ.setdefault("PREFECT_SGPU_DEVICE", "cpu")
    from moto.server import ThreadedMotoServer

    from support.aws_fault_proxy import AWSFaultProxy
    from support.aws_fixtures import MotoAWS, aws_environment, free_port

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    proxy = AWSFaultProxy(f"http://127.0.0.1:{port}")  # also what moto lacks (placement groups)
    if not args.proxy_http10:
        # The proxy's handler speaks HTTP/1.0, so it never answers botocore's "Expect: 100-continue"
        # (sent with every S3 PutObject body) and botocore waits 1 s before sending the body anyway:
        # 1 s per PutObject that AWS does not charge. HTTP/1.1 makes http.server answer "100 Continue".
        proxy._server.RequestHandlerClass.protocol_version = "HTTP/1.1"
    proxy.start()
    results: list[Result] = []
    started = time.monotonic()
    try:
        env_vars = aws_environment(proxy.url)
        os.environ.update(env_vars)
        os.environ["AWS_CONFIG_FILE"] = os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
        aws = MotoAWS(endpoint_url=proxy.url, env=env_vars)
        aws.image_id()  # moto's image list, once (not part of any launch)
        run_size(aws, proxy, 1, True, args.waiter_delay, args.gpu_type)  # warm-up: imports, first clients
        for nodes in sizes:
            modes = ([False] if nodes <= args.real_up_to else []) + [True]
            for stub in modes:
                t = time.monotonic()
                result = run_size(aws, proxy, nodes, stub, args.waiter_delay, args.gpu_type)
                results.append(result)
                print(f"{nodes} nodes ({result.node_side}): acquire {result.acquire_s:.1f} s, "
                      f"{result.acquire.total if result.acquire else 0} calls; release {result.release_s:.1f} s; "
                      f"{time.monotonic() - t:.0f} s in all", flush=True)
    finally:
        proxy.stop()
        server.stop()
    report(results, args)
    print(f"\nbench wall time {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
