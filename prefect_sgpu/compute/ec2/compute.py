"""GPU VMs on EC2: one set of instances per job, always terminated.

The driver never needs an inbound port: everything between it and the nodes goes
through the S3 store. The instances boot a user-data script that starts
:mod:`prefect_sgpu.launch.bootstrap`; each node announces itself in the store, the
driver writes every node's launch document once all are up, and the nodes run the
ordinary node agent against a local copy of the job folder.

The payload signing key never reaches S3 or the user-data: the driver puts it in an
SSM SecureString parameter (``/prefect-sgpu/<run_id>/payload-key``) that the nodes read
through their instance profile, and deletes it on release.

Provisioning itself (subnets, markets, failover, tags, termination, prices) is
:class:`~prefect_sgpu.compute.ec2.instances.EC2Provisioner`'s job; this class turns a
job into provisioning calls and store messages.
"""

from __future__ import annotations

import json
import logging
import shlex
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from prefect_sgpu import catalog
from prefect_sgpu.compute import Allocation, Compute, Node, NodeLaunch
from prefect_sgpu.errors import JobCancelled, LaunchTimeout, ProvisioningError, SGPUConfigError
from prefect_sgpu.launch.bootstrap import STOP_KEY, alive_key, launch_key, render_user_data, status_key
from prefect_sgpu.spec import Plan, Resources, plan_remote

logger = logging.getLogger("prefect_sgpu.compute.ec2.compute")

DEFAULT_RENDEZVOUS_PORT = 29400
MASKED_ENV = ("SGPU_PAYLOAD_KEY",)
DEAD_STATES = ("shutting-down", "terminated", "stopping", "stopped")
#: settings this class reads itself; everything else configures the provisioner
OWN_SETTINGS = ("store_uri", "ttl_minutes", "heartbeat_ttl_s", "agent_timeout_s", "rendezvous_port",
                "poll_interval_s", "node_silence_s", "python", "setup_commands", "kms_key_id")


def payload_key_parameter(run_id: str) -> str:
    return f"/prefect-sgpu/{run_id}/payload-key"


class _Progress:
    """requested -> running -> agent up -> rendezvous, on the caller's terminal (rich)."""

    def __init__(self, run_id: str) -> None:
        from rich.console import Console

        self.console = Console(stderr=True, highlight=False)
        self.run_id = run_id

    def __call__(self, phase: str, detail: str = "") -> None:
        text = f"[ec2 {self.run_id}] {phase}" + (f": {detail}" if detail else "")
        logger.info(text)
        self.console.print(f"[bold cyan]\\[ec2][/] [dim]{self.run_id}[/] [bold]{phase}[/] {detail}")


class EC2InstanceCompute(Compute):
    """Whole EC2 GPU instances per job; the S3 store is the only channel to them."""

    def __init__(
        self,
        provisioner: Any,
        store: Any,
        region: str,
        *,
        session: Any | None = None,
        endpoint_url: str | None = None,
        heartbeat_ttl_s: float = 900.0,
        agent_timeout_s: float = 900.0,
        rendezvous_port: int = DEFAULT_RENDEZVOUS_PORT,
        poll_interval_s: float = 1.0,
        node_silence_s: float = 120.0,
        instance_types: dict[str, str] | None = None,
        python: str = "python3",
        setup_commands: str = "",
        kms_key_id: str | None = None,
    ) -> None:
        self.provisioner = provisioner
        self.store = store
        self.region = region
        self.session = session
        self.endpoint_url = endpoint_url
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.agent_timeout_s = agent_timeout_s
        self.rendezvous_port = rendezvous_port
        self.poll_interval_s = poll_interval_s
        self.node_silence_s = node_silence_s
        self.instance_types = {catalog.lookup(k).name: v for k, v in (instance_types or {}).items()}
        self.python = python
        self.setup_commands = setup_commands
        self.kms_key_id = kms_key_id
        self._clients: dict[str, Any] = {}
        self._lock = threading.RLock()

    @classmethod
    def from_settings(cls, settings: dict[str, Any], session: Any | None = None) -> "EC2InstanceCompute":
        """Build from an ``EC2Compute`` block's fields (validated here, before anything is spent)."""
        from prefect_sgpu.compute.ec2.instances import EC2Provisioner, EC2Settings
        from prefect_sgpu.store_s3 import S3Store

        store_uri = settings.get("store_uri") or ""
        if not str(store_uri).startswith("s3://"):
            raise SGPUConfigError("store_uri", store_uri, "an s3://bucket/prefix both the driver and the "
                                  "instances (through their instance profile) can read and write")
        region = settings.get("region") or "us-east-1"
        endpoint_url = settings.get("endpoint_url") or None
        ttl = settings.get("heartbeat_ttl_s") or 60.0 * float(settings.get("ttl_minutes") or 15)
        port = int(settings.get("rendezvous_port") or DEFAULT_RENDEZVOUS_PORT)
        if not 1024 <= port <= 65535:
            raise SGPUConfigError("rendezvous_port", port, "a port between 1024 and 65535")
        provisioner_settings = EC2Settings(**_provisioner_settings(EC2Settings, settings))
        provisioner = EC2Provisioner(provisioner_settings, session=session)
        return cls(
            provisioner,
            S3Store(str(store_uri), session=session, region=region, endpoint_url=endpoint_url),
            region,
            session=session,
            endpoint_url=endpoint_url,
            heartbeat_ttl_s=float(ttl),
            agent_timeout_s=float(settings.get("agent_timeout_s") or 900.0),
            rendezvous_port=port,
            poll_interval_s=float(settings.get("poll_interval_s") or 1.0),
            node_silence_s=float(settings.get("node_silence_s") or 120.0),
            instance_types=settings.get("instance_types") or {},
            python=settings.get("python") or "python3",
            setup_commands=settings.get("setup_commands") or "",
            kms_key_id=settings.get("kms_key_id") or None,
        )

    # -- clients ----------------------------------------------------------------

    def _client(self, service: str) -> Any:
        with self._lock:
            if service not in self._clients:
                from prefect_sgpu.store_s3 import s3_client

                self._clients[service] = s3_client(self.session, self.region, self.endpoint_url,
                                                   service=service)
            return self._clients[service]

    # -- the protocol -----------------------------------------------------------

    def default_store(self) -> Any:
        return self.store

    def plan(self, resources: Resources) -> Plan:
        plan = plan_remote(resources)
        override = self.instance_types.get(resources.gpu_type or "")
        if not override:
            return plan
        itype = catalog.instance_type_by_name(override)
        if itype is None:  # not in the catalog: same GPUs per node assumed, the provisioner names it
            return plan
        if resources.gpus % itype.gpus:
            raise SGPUConfigError("gpus", resources.gpus,
                                  f"a multiple of {itype.gpus} (GPUs of one {itype.name})")
        return Plan(nodes=resources.gpus // itype.gpus, procs_per_node=itype.gpus, device="cuda",
                    instance_type=itype)

    def user_data(self, run_id: str) -> str:
        return render_user_data(self.store.root_uri, run_id, self.region, self.heartbeat_ttl_s,
                                endpoint_url=self.endpoint_url, python=self.python,
                                setup=self.setup_commands)

    def dry_run(self, run_id: str, plan: Plan, launches: list[NodeLaunch]) -> dict[str, Any]:
        user_data = self.user_data(run_id)
        itype = plan.instance_type
        return {
            "compute": "ec2",
            "run_id": run_id,
            "region": self.region,
            "run_instances": self.provisioner.run_instances_request(run_id, plan, user_data),
            "user_data": user_data,
            "store": self.store.uri(run_id),
            "payload_key": f"SSM SecureString {payload_key_parameter(run_id)} (deleted on release)",
            "estimated_usd_per_hour": round(plan.nodes * itype.price_per_hour, 3) if itype else None,
            "nodes": [
                {
                    "index": launch.node.index,
                    "command": shlex.join(launch.argv),
                    "env": {k: ("***" if k in MASKED_ENV else v) for k, v in launch.env.items()},
                }
                for launch in launches
            ],
        }

    def acquire(self, run_id: str, plan: Plan, cancel: threading.Event | None = None) -> Allocation:
        progress = _Progress(run_id)
        should_stop = cancel.is_set if cancel is not None else (lambda: False)
        itype = plan.instance_type.name if plan.instance_type else "?"
        started = time.time()
        progress("requested", f"{plan.nodes} x {itype} in {self.region}")
        try:
            with self._driver_heartbeat(run_id):  # nodes must not think the driver died while we wait
                try:
                    instances = self.provisioner.provision(
                        run_id, plan, self.user_data(run_id),
                        progress=lambda text: progress("provisioning", text), should_stop=should_stop,
                    )
                except LaunchTimeout:
                    raise
                except TimeoutError as exc:
                    raise LaunchTimeout(run_id, self.agent_timeout_s, phase="provisioning") from exc
                instances = sorted(instances, key=lambda i: i.launch_index)
                progress("running", ", ".join(f"{i.id} ({i.private_ip}, {i.availability_zone}, {i.market})"
                                              for i in instances))
                nodes = self._wait_for_agents(run_id, plan, instances, progress, should_stop)
        except BaseException:
            self._terminate(run_id)
            raise
        return Allocation(run_id=run_id, plan=plan, nodes=nodes,
                          info={"instances": instances, "started": started, "progress": progress})

    def _wait_for_agents(self, run_id: str, plan: Plan, instances: list[Any], progress: _Progress,
                         should_stop: Any = lambda: False) -> list[Node]:
        """Every node's bootstrap has announced itself, or LaunchTimeout (phase "agent start")."""
        if len(instances) != plan.nodes:
            raise ProvisioningError(f"job {run_id}: asked for {plan.nodes} instance(s), got {len(instances)}")
        deadline = time.monotonic() + self.agent_timeout_s
        up: dict[int, dict[str, Any]] = {}
        last_state_check = 0.0
        while len(up) < len(instances):
            for index, inst in enumerate(instances):
                if index in up:
                    continue
                raw = self.store.get(run_id, alive_key(index))
                doc = json.loads(raw) if raw else None
                if doc and doc.get("instance_id") == inst.id:
                    up[index] = doc
                    progress("agent up", f"node {index} on {inst.id} ({len(up)}/{len(instances)})")
            if len(up) == len(instances):
                break
            if should_stop():
                raise JobCancelled(f"job {run_id} was cancelled while its nodes booted; they are terminated")
            now = time.monotonic()
            if now > deadline:
                missing = [instances[i].id for i in range(len(instances)) if i not in up]
                logger.error("job %s: no node agent on %s after %gs", run_id, missing, self.agent_timeout_s)
                raise LaunchTimeout(run_id, self.agent_timeout_s, phase="agent start")
            if now - last_state_check > 5.0:
                last_state_check = now
                dead = {k: v for k, v in self._instance_states([i.id for i in instances]).items()
                        if v in DEAD_STATES}
                if dead:
                    raise ProvisioningError(f"job {run_id}: instance(s) {dead} went away while booting")
            time.sleep(0.5)
        return [
            Node(index=i, address=up[i].get("private_ip") or inst.private_ip, handle=inst,
                 info={"instance_id": inst.id, "instance_type": inst.instance_type, "market": inst.market,
                       "availability_zone": inst.availability_zone, "private_ip": inst.private_ip})
            for i, inst in enumerate(instances)
        ]

    def rendezvous_endpoint(self, allocation: Allocation) -> str:
        endpoint = f"{allocation.nodes[0].address}:{self.rendezvous_port}"
        progress = allocation.info.get("progress")
        if progress:
            progress("rendezvous", f"c10d on node 0 at {endpoint}")
        return endpoint

    def start(self, allocation: Allocation, launch: NodeLaunch) -> None:
        run_id = allocation.run_id
        env = dict(launch.env)
        job_dir = env.get("SGPU_JOB_DIR", "")
        if job_dir and job_dir != self.store.uri(run_id):
            raise SGPUConfigError("store", job_dir, f"the EC2 compute's own store {self.store.uri(run_id)} "
                                  "(its nodes only know that one): leave store unset or pass the same URI")
        key = env.pop("SGPU_PAYLOAD_KEY", None)
        parameter = None
        if key:
            parameter = payload_key_parameter(run_id)
            with self._lock:
                if not allocation.info.get("key_parameter"):
                    self._put_key(parameter, key)
                    allocation.info["key_parameter"] = parameter
        doc = {"argv": list(launch.argv), "env": env, "payload_key_parameter": parameter,
               "instance_id": launch.node.info.get("instance_id"), "node": launch.node.index}
        self.store.put(run_id, launch_key(launch.node.index), json.dumps(doc).encode())

    def _put_key(self, name: str, key: str) -> None:
        extra = {"KeyId": self.kms_key_id} if self.kms_key_id else {}
        self._client("ssm").put_parameter(
            Name=name, Value=key, Type="SecureString", Overwrite=True,
            Description="prefect-sgpu payload signing key of one job (deleted when the job ends)", **extra,
        )

    def poll(self, allocation: Allocation, node: Node) -> int | None:
        """The node's reported exit code; a node whose instance died counts as failed."""
        now = time.monotonic()
        if now - node.info.get("polled", 0.0) < self.poll_interval_s:
            return None
        node.info["polled"] = now
        raw = self.store.get(allocation.run_id, status_key(node.index))
        if raw:
            return int(json.loads(raw).get("exit_code", 1))
        checked = allocation.info.get("states_checked", 0.0)
        if now - checked > max(5.0, self.poll_interval_s):
            allocation.info["states_checked"] = now
            ids = [n.info["instance_id"] for n in allocation.nodes]
            allocation.info["states"] = self._instance_states(ids)
        state = allocation.info.get("states", {}).get(node.info.get("instance_id"))
        if state in DEAD_STATES:
            return self._node_lost(allocation, node, f"instance {node.info['instance_id']} is {state} "
                                   "(lost or reclaimed) before its ranks finished")
        alive_every = max(self.poll_interval_s, min(5.0, self.node_silence_s / 4))
        # is the node's bootstrap still reporting?
        if now - node.info.get("alive_checked", 0.0) > alive_every:
            node.info["alive_checked"] = now
            raw_alive = self.store.get(allocation.run_id, alive_key(node.index))
            seq = json.loads(raw_alive).get("seq") if raw_alive else None
            if seq != node.info.get("alive_seq"):
                node.info["alive_seq"], node.info["alive_changed"] = seq, now
            elif now - node.info.get("alive_changed", now) > self.node_silence_s:
                return self._node_lost(allocation, node, f"node {node.index} ({node.info['instance_id']}) "
                                       f"has not reported for {self.node_silence_s:g}s")
        return None

    def _node_lost(self, allocation: Allocation, node: Node, why: str) -> int:
        """Record the loss where the driver looks for a node's outcome; the job fails with it."""
        status = {"node": node.index, "host": node.address, "exit_code": 137, "failures": {}, "error": why}
        self.store.put(allocation.run_id, status_key(node.index), json.dumps(status).encode())
        return 137

    def _instance_states(self, ids: list[str]) -> dict[str, str]:
        states: dict[str, str] = {}
        if not ids:
            return states
        try:
            pages = self._client("ec2").get_paginator("describe_instances").paginate(InstanceIds=ids)
            for page in pages:
                for reservation in page.get("Reservations", []):
                    for inst in reservation.get("Instances", []):
                        states[inst["InstanceId"]] = inst["State"]["Name"]
        except Exception as exc:  # noqa: BLE001 - an unknown id means the instance is long gone
            if "InvalidInstanceID" not in str(exc):
                logger.warning("describe_instances failed: %s", exc)
            else:
                states = {i: "terminated" for i in ids}
        return states

    def stop(self, allocation: Allocation, grace: float = 10.0) -> None:
        """Write the stop marker; wait (grace + sync time) for every live node to report."""
        run_id = allocation.run_id
        pending = [n for n in allocation.nodes if self.store.get(run_id, status_key(n.index)) is None]
        if not pending:
            return
        self.store.put(run_id, STOP_KEY, json.dumps({"time": time.time(), "grace": grace}).encode())
        deadline = time.monotonic() + grace + 10.0
        while pending and time.monotonic() < deadline:
            time.sleep(0.5)
            states = self._instance_states([n.info["instance_id"] for n in pending])
            pending = [n for n in pending if self.store.get(run_id, status_key(n.index)) is None
                       and states.get(n.info["instance_id"]) not in DEAD_STATES]

    def release(self, allocation: Allocation) -> None:
        progress = allocation.info.get("progress")
        try:
            self._terminate(allocation.run_id)
        finally:
            ended = time.time()
            self._delete_key(allocation)
            instances = allocation.info.get("instances") or []
            try:
                allocation.info["cost"] = self.provisioner.cost(instances, allocation.info["started"], ended)
            except Exception:  # noqa: BLE001 - a missing price must not hide the job's outcome
                logger.warning("could not estimate the cost of job %s", allocation.run_id, exc_info=True)
            if progress:
                progress("terminated", _cost_text(allocation.info.get("cost")))

    def _terminate(self, run_id: str) -> None:
        self.provisioner.terminate(run_id)

    def _delete_key(self, allocation: Allocation) -> None:
        name = allocation.info.get("key_parameter")
        if not name:
            return
        try:
            self._client("ssm").delete_parameter(Name=name)
        except Exception as exc:  # noqa: BLE001
            if "ParameterNotFound" not in str(exc):
                logger.warning("could not delete SSM parameter %s: %s", name, exc)

    @contextmanager
    def _driver_heartbeat(self, run_id: str, interval: float = 2.0) -> Iterator[None]:
        """Keep the driver's heartbeat fresh while acquire blocks (the driver beats afterwards)."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(interval):
                try:
                    self.store.put(run_id, "heartbeat", f"{time.time():.3f}".encode())
                except Exception:  # noqa: BLE001 - the next beat may succeed
                    logger.debug("heartbeat failed", exc_info=True)

        thread = threading.Thread(target=beat, name=f"sgpu-ec2-beat-{run_id}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(timeout=5)


def _provisioner_settings(settings_cls: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """Every setting but this class's own: a misspelt one still fails the provisioner's validation."""
    fields = getattr(settings_cls, "model_fields", {})
    return {k: v for k, v in settings.items() if k not in OWN_SETTINGS or k in fields}


def _cost_text(cost: dict[str, Any] | None) -> str:
    if not cost:
        return ""
    hours = cost.get("instance_hours")
    usd = cost.get("usd", cost.get("estimated_usd"))
    if hours is None or usd is None:
        return str(cost)
    return f"{hours:.4f} instance-hours, about ${usd:.4f}"
