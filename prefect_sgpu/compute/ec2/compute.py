"""GPU VMs on EC2: one set of instances per job (or a warm lease for several), always terminated.

The driver never needs an inbound port: everything between it and the nodes goes
through the S3 store, as sealed documents of the job folder
(:mod:`prefect_sgpu.jobfolder`). The instances boot a user-data script that starts
:mod:`prefect_sgpu.launch.bootstrap`; each node announces itself (a sealed ``alive``
document), the driver writes every node's sealed launch document (one object) once all are up,
and the nodes run the ordinary node agent against a local mirror of the job folder.

**The job key and who may run code on a node.** Anyone who can write the store may
delay a job, never run code in it: every document a node acts on is sealed with the
job key (HMAC) and bound to the job, its kind, the node index and the instance id.
The key itself never reaches S3, the user-data or a tag. ``acquire`` writes it to the
SSM SecureString ``jobfolder.ssm_key_parameter(run_id)`` *before* launching (so a node
can verify every document from its first second) and ``release`` deletes it. Nodes
derive that name from their own ``--run-id`` and read it through their instance
profile. Node addresses (node 0's rendezvous host) come from DescribeInstances, never
from what a node writes.

**Warm leases.** With ``keep_warm`` seconds the instances are launched for a lease instead
(:mod:`prefect_sgpu.compute.remote.lease`) and kept between jobs of the same shape: the next job
is assigned to them and pays no boot. Each job still has its own folder and key.

Provisioning itself (subnets, markets, failover, tags, termination, prices) is
:class:`~prefect_sgpu.compute.ec2.instances.EC2Provisioner`'s job and the requests are
built by :mod:`prefect_sgpu.compute.ec2.request`; this class turns a job into those
calls and job-folder documents.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterator

from prefect_sgpu import catalog
from prefect_sgpu.compute.base import (
    MASKED_ENV,
    AllocatedNode,
    Allocation,
    Compute,
    Event,
    JobLaunch,
    NodeExited,
    NodeLost,
    NodeNotice,
    NodeUp,
    Released,
    Request,
)
from prefect_sgpu.compute.ec2 import request as rq
from prefect_sgpu.compute.ec2 import roles
from prefect_sgpu.compute.ec2.roles import ROLE_PATH
from prefect_sgpu.compute.ec2.instances import DEAD_STATES, EC2Provisioner, Instance
from prefect_sgpu.compute.remote.lease import WarmLease, lease_id
from prefect_sgpu.compute.ec2.request import LaunchAttempt
from prefect_sgpu.compute.ec2.settings import EC2Settings
from prefect_sgpu.launch.warm_pool import POOL, check_keep_warm
from prefect_sgpu.errors import JobCancelled, LaunchTimeout, ProvisioningError, SGPUConfigError
from prefect_sgpu.checkpoints import ENDPOINT_ENV as STORE_ENDPOINT_ENV
from prefect_sgpu.checkpoints import REGION_ENV as STORE_REGION_ENV
from prefect_sgpu.jobfolder import (JobFolder, LaunchDocument, alive_key, new_key, notice_key, ssm_key_parameter,
                                    ssm_secrets_parameter, status_key)
from prefect_sgpu.spec import JobSpec, plan_remote
from prefect_sgpu.store_s3 import S3Store

if TYPE_CHECKING:
    from prefect_sgpu.store import Store
    from prefect_sgpu.compute.remote.sweep import Sweeper

logger = logging.getLogger("prefect_sgpu.compute.ec2.compute")

DEFAULT_RENDEZVOUS_PORT = 29400
HEARTBEAT_INTERVAL_S = 2.0
#: seconds the nodes of a warm lease get to take up a job before the lease is given up for new instances
WARM_TAKEUP_S = 120.0
#: settings this class reads itself; everything else configures the provisioner
OWN_SETTINGS = ("store_uri", "heartbeat_ttl_s", "agent_timeout_s", "rendezvous_port",
                "poll_interval_s", "node_silence_s", "python", "setup_commands", "kms_key_id", "bucket_owner",
                "keep_warm")


class _Progress:
    """requested -> running -> agent up -> rendezvous, as log lines of the library: on the terminal,
    in the Prefect run's logs and on the job's live status line (:mod:`prefect_sgpu.live`)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    def __call__(self, phase: str, detail: str = "") -> None:
        logger.info(f"[ec2 {self.run_id}] {phase}" + (f": {detail}" if detail else ""))


@dataclass(frozen=True)
class EC2Request(Request):
    """What an EC2 job will launch, rendered by ``plan`` and sent as is by ``acquire``."""

    region: str = ""
    instance_type: str = ""
    #: every run_instances try in failover order (subnet x market); the first is what normally launches
    run_instances: tuple[LaunchAttempt, ...] = ()
    user_data: str = ""
    store_uri: str = ""
    #: the SSM SecureString that holds the job key while the job runs (its name, never its value)
    key_parameter: str = ""
    usd_per_hour: float | None = None
    agent_timeout_s: float = 900.0
    #: the IAM role (and instance profile) acquire creates for this job, when the block asks for job roles
    job_role: str = ""
    #: seconds the instances wait for the next job of this shape (0: this job's own, terminated after it)
    keep_warm: float = 0.0
    #: the lease the instances are launched for when no warm one fits (``run_instances`` and
    #: ``user_data`` are rendered for it); empty for a cold job
    lease_id: str = ""

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "region": self.region,
            "run_instances": self.run_instances[0].params if self.run_instances else {},
            "failover": [{"market": a.market, "subnet_id": a.subnet_id} for a in self.run_instances],
            "user_data": self.user_data,
            "store": self.store_uri,
            "payload_key": f"SSM SecureString {self.key_parameter} (deleted on release)",
            **({"job_role": f"IAM role and instance profile {ROLE_PATH}{self.job_role} (policies/node-policy.json "
                            "for this run; deleted on release)"} if self.job_role else {}),
            "estimated_usd_per_hour": self.usd_per_hour,
            **({"keep_warm": f"a warm lease's instances when one of this shape is idle; else new ones for lease "
                             f"{self.lease_id}, kept {self.keep_warm:g}s between jobs"} if self.lease_id else {}),
        }


@dataclass
class EC2Allocation(Allocation):
    """One job's instances and what the driver tracks about them until release."""

    instances: list[Instance] = field(default_factory=list)
    started: float = 0.0
    key_parameter: str | None = None
    #: the SecureString of the job's ``secrets=``, once written
    secrets_parameter: str | None = None
    #: the run's own IAM role, once acquire started creating it
    job_role: str | None = None
    #: the run_instances requests actually sent (failover tries included), in order
    sent: list[dict[str, Any]] = field(default_factory=list)
    progress: Any = None
    announced: set[int] = field(default_factory=set)
    reported: set[int] = field(default_factory=set)
    launched: bool = False
    polled: float = 0.0
    states_checked: float = 0.0
    states: dict[str, str] = field(default_factory=dict)
    alive_version: dict[int, str | None] = field(default_factory=dict)
    alive_changed: dict[int, float] = field(default_factory=dict)
    noticed: set[int] = field(default_factory=set)
    outcome: Released | None = None
    #: the warm lease this job runs on (None: a cold job, its instances its own)
    lease: WarmLease | None = None
    #: a node was lost or received a reclaim notice: its lease serves no other job
    lost: bool = False
    #: release gave the lease back to the pool (its instances wait for the next job)
    kept: bool = False

    def instance_id(self, node: int) -> str:
        return self.instances[node].id


class EC2InstanceCompute(Compute):
    """Whole EC2 GPU instances per job; the S3 store is the only channel to them."""

    name = "ec2"
    remote = True
    runs_node_agents = True
    #: instance states are read every 5 s: a peer's failure waits that long for the loss behind it
    loss_grace_s = 8.0

    def __init__(
        self,
        provisioner: EC2Provisioner,
        store: S3Store,
        region: str,
        *,
        session: Any | None = None,
        endpoint_url: str | None = None,
        heartbeat_ttl_s: float = 900.0,
        agent_timeout_s: float = 900.0,
        rendezvous_port: int = DEFAULT_RENDEZVOUS_PORT,
        poll_interval_s: float = 1.0,
        node_silence_s: float = 120.0,
        python: str = "python3",
        setup_commands: str = "",
        kms_key_id: str | None = None,
        keep_warm: float = 0.0,
    ) -> None:
        """``keep_warm``: seconds a job's instances wait for the next job of the same shape (a
        warm lease, :mod:`~prefect_sgpu.compute.remote.lease`); 0 terminates them after every job."""
        self.keep_warm = check_keep_warm("keep_warm", keep_warm, "every job terminates its instances")
        if self.keep_warm > 0 and provisioner.settings.job_roles:
            raise SGPUConfigError("keep_warm", keep_warm, "0 while job_roles is on (a job role covers one job, and "
                                  "a warm lease's instances serve several): turn one of them off")
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
        self.python = python
        self.setup_commands = setup_commands
        self.kms_key_id = kms_key_id
        self._account: str | None = None
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"EC2InstanceCompute(region={self.region!r}, store={self.store.root_uri!r})"

    @property
    def settings(self) -> EC2Settings:
        return self.provisioner.settings

    @classmethod
    def from_settings(cls, settings: dict[str, Any], session: Any | None = None) -> "EC2InstanceCompute":
        """Build from an ``EC2Compute`` block's fields (validated here, before anything is spent).

        One TTL for everything that watches the driver: ``ttl_minutes * 60`` seconds is
        both the bootstrap's and the node agent's heartbeat TTL (``heartbeat_ttl_s``
        overrides it, for tests that kill a driver and wait for its nodes).
        """
        store_uri = settings.get("store_uri") or ""
        if not str(store_uri).startswith("s3://"):
            raise SGPUConfigError("store_uri", store_uri, "an s3://bucket/prefix both the driver and the "
                                  "instances (through their instance profile) can read and write")
        provisioner_settings = EC2Settings(**_provisioner_settings(EC2Settings, settings))
        region = provisioner_settings.region
        endpoint_url = provisioner_settings.endpoint_url
        ttl = settings.get("heartbeat_ttl_s") or 60.0 * provisioner_settings.ttl_minutes
        port = int(settings.get("rendezvous_port") or DEFAULT_RENDEZVOUS_PORT)
        if not 1024 <= port <= 65535:
            raise SGPUConfigError("rendezvous_port", port, "a port between 1024 and 65535")
        store = S3Store(str(store_uri), session=session, region=region, endpoint_url=endpoint_url,
                        kms_key_id=settings.get("kms_key_id") or None, bucket_owner=_bucket_owner(settings))
        return cls(
            EC2Provisioner(provisioner_settings, session=session,
                           run_tags=rq.run_tags(store.root_uri, float(ttl))),
            store,
            region,
            session=session,
            endpoint_url=endpoint_url,
            heartbeat_ttl_s=float(ttl),
            agent_timeout_s=float(settings.get("agent_timeout_s") or 900.0),
            rendezvous_port=port,
            poll_interval_s=float(settings.get("poll_interval_s") or 1.0),
            node_silence_s=float(settings.get("node_silence_s") or 120.0),
            python=settings.get("python") or "python3",
            setup_commands=settings.get("setup_commands") or "",
            kms_key_id=settings.get("kms_key_id") or None,
            keep_warm=settings.get("keep_warm") or 0.0,
        )

    def _client(self, service: str) -> Any:
        return self.provisioner.client(service)

    # -- before anything is spent ---------------------------------------------------

    def default_store(self) -> "Store":
        return self.store

    def check_store(self, store: "Store") -> None:
        """Nodes only know this compute's own S3 store (bucket and prefix): refuse any other, now."""
        if not (isinstance(store, S3Store) and (store.bucket, store.prefix) == (self.store.bucket, self.store.prefix)):
            raise SGPUConfigError("store", repr(store), f"the EC2 compute's own store {self.store.root_uri} (its "
                                  "nodes only reach that one): leave store unset or pass the same URI")

    def check_secrets(self, secrets: dict[str, str]) -> None:
        """``secrets=`` reach the nodes as one SSM SecureString holding their JSON (``start`` writes
        ``json.dumps(launch.secrets)``), and SSM's standard tier refuses a value over 4096 bytes:
        refused here, before any instance is paid for. Names and sizes only in the message."""
        import json

        limit = 4096
        size = len(json.dumps(secrets).encode())
        if size > limit:
            sizes = ", ".join(f"{name}: {len(json.dumps(value).encode())}"
                              for name, value in sorted(secrets.items()))
            raise SGPUConfigError("secrets", f"{size} bytes as the JSON EC2 nodes read ({sizes})",
                                  f"at most {limit} bytes in all (one SSM standard-tier parameter per job)",
                                  "Keep large values (files, certificates) in S3 or a mounted secret "
                                  "and pass where they are")

    def user_data(self, run_id: str, lease: bool = False) -> str:
        return rq.render_user_data(self.store.root_uri, run_id, self.region, self.heartbeat_ttl_s,
                                   endpoint_url=self.endpoint_url, python=self.python,
                                   setup=self.setup_commands,
                                   backstop_s=max(self.heartbeat_ttl_s, self.agent_timeout_s),
                                   kms_key_id=self.store.kms_key_id, bucket_owner=self.store.bucket_owner,
                                   lease=lease)

    def plan(self, spec: JobSpec, run_id: str) -> EC2Request:
        plan = plan_remote(spec, instance_type=rq.override_for(self.settings, spec.gpu_type))
        lease = lease_id(run_id) if self.keep_warm > 0 else ""
        user_data = self.user_data(lease or run_id, lease=bool(lease))
        attempts = self.provisioner.attempts(lease or run_id, plan, user_data)
        instance_type = attempts[0].params["InstanceType"] if attempts else rq.instance_type_for(self.settings, plan)
        known = catalog.instance_type_by_name(instance_type)
        price = round(plan.nodes * known.price_per_hour, 3) if known and known.price_per_hour else None
        return EC2Request(run_id=run_id, compute=self.name, plan=plan, spec=spec,
                          heartbeat_ttl_s=self.heartbeat_ttl_s, region=self.region, instance_type=instance_type,
                          run_instances=attempts, user_data=user_data, store_uri=self.store.uri(run_id),
                          key_parameter=ssm_key_parameter(run_id), usd_per_hour=price,
                          agent_timeout_s=self.agent_timeout_s,
                          job_role=roles.role_name(run_id) if self.settings.job_roles else "",
                          keep_warm=self.keep_warm, lease_id=lease)

    def replan(self, request: Request, gang: int) -> EC2Request:
        """The same launch tries in the same order (the first market first, then the fallback
        chain), each with a ClientToken of its own for this gang: new instances, not the lost ones.
        A warm job's new instances are a new lease's (its own id, tags and tokens)."""
        assert isinstance(request, EC2Request)
        if request.lease_id:
            lease = lease_id(request.run_id, gang)
            user_data = self.user_data(lease, lease=True)
            return replace(request, lease_id=lease, user_data=user_data,
                           run_instances=self.provisioner.attempts(lease, request.plan, user_data))
        attempts = tuple(replace(a, params={**a.params, "ClientToken": rq.client_token(request.run_id, i, gang)})
                         for i, a in enumerate(request.run_instances))
        return replace(request, run_instances=attempts)

    # -- spending -------------------------------------------------------------------

    def acquire(self, request: Request, folder: "JobFolder", deadline: float,
                cancel: threading.Event) -> EC2Allocation:
        assert isinstance(request, EC2Request)
        run_id = request.run_id
        progress = _Progress(run_id)
        allocation = EC2Allocation(request=request, folder=folder, nodes=[], started=time.time(),
                                   progress=progress)
        progress("requested", f"{request.plan.nodes} x {request.instance_type} in {self.region}")
        if request.keep_warm > 0:
            return self._acquire_warm(allocation, deadline, cancel)
        try:
            with self._driver_heartbeat(folder):  # nodes must not think the driver died while we wait
                self._sweep(request)
                self._put_key(allocation)  # before any instance exists: nodes verify from their first read
                if request.job_role:
                    self._create_role(allocation)
                allocation.instances = self._provision(allocation, run_id, deadline, cancel)
                progress("running", ", ".join(f"{i.id} ({i.private_ip}, {i.availability_zone}, {i.market})"
                                              for i in allocation.instances))
                self._wait_for_agents(allocation, deadline, cancel)
        except BaseException:
            self._give_back(allocation)
            raise
        return allocation

    # -- warm leases ------------------------------------------------------------------

    def _lease_key(self, request: EC2Request) -> tuple[Any, ...]:
        """Jobs of the same shape on the same settings may share a lease."""
        plan = request.plan
        return ("ec2", self.region, self.store.root_uri, request.instance_type, plan.nodes, plan.procs_per_node,
                self.python, self.setup_commands, self.heartbeat_ttl_s, self.settings.model_dump_json())

    def _acquire_warm(self, allocation: EC2Allocation, deadline: float, cancel: threading.Event) -> EC2Allocation:
        """An idle warm lease of this job's shape, or a new one; either way the job is assigned to its
        nodes and acquire returns once every node announced itself in the job's folder."""
        request = allocation.request
        assert isinstance(request, EC2Request)
        progress = allocation.progress
        try:
            with self._driver_heartbeat(allocation.folder):
                self._put_key(allocation)  # before the assignment: the nodes read it once assigned
                lease = POOL.take(self._lease_key(request), owner=id(self))
                if lease is not None:
                    allocation.lease = lease
                    progress("warm", f"lease {lease.lease_id}: {len(lease.instances)} instance(s) kept from "
                                     f"an earlier job ({lease.jobs} so far)")
                    try:
                        self._assign(allocation, deadline, cancel, timeout=min(self.agent_timeout_s, WARM_TAKEUP_S))
                        return allocation
                    except (LaunchTimeout, ProvisioningError) as exc:
                        if cancel.is_set() or time.monotonic() >= deadline:
                            raise
                        logger.warning("job %s: warm lease %s did not take the job up (%s); launching new "
                                       "instances", allocation.run_id, lease.lease_id, exc)
                        allocation.lease = None
                        POOL.discard(lease)
                self._sweep(request)
                self._new_lease(allocation, deadline, cancel)
                self._assign(allocation, deadline, cancel)
        except BaseException:
            self._give_back(allocation)
            raise
        return allocation

    def _new_lease(self, allocation: EC2Allocation, deadline: float, cancel: threading.Event) -> WarmLease:
        """Instances for a new lease (its key written and its heartbeat beating before they exist)."""
        request = allocation.request
        assert isinstance(request, EC2Request)
        lease = WarmLease(key=self._lease_key(request), folder=JobFolder(self.store, request.lease_id, new_key()),
                          instances=[], provisioner=self.provisioner, node_silence_s=self.node_silence_s)
        allocation.lease = lease
        POOL.add(lease, owner=id(self))
        self._put_secure(lease, ssm_key_parameter(lease.lease_id), lease.folder.key,
                         "prefect-sgpu key of one warm lease (deleted when the lease ends)", "key_parameter")
        lease.start_beating()
        lease.instances = self._provision(allocation, lease.lease_id, deadline, cancel)
        allocation.progress("running", f"lease {lease.lease_id}: " + ", ".join(
            f"{i.id} ({i.private_ip}, {i.availability_zone}, {i.market})" for i in lease.instances))
        return lease

    def _provision(self, allocation: EC2Allocation, launch_id: str, deadline: float,
                   cancel: threading.Event) -> list[Instance]:
        """The request's instances, launched and tagged for ``launch_id`` (the job's run id, or its
        lease's); a deadline reached while they start is the job's ``LaunchTimeout``."""
        request = allocation.request
        assert isinstance(request, EC2Request)
        try:
            return self.provisioner.provision(
                launch_id, request.plan, request.user_data,
                progress=lambda text: allocation.progress("provisioning", text), should_stop=cancel.is_set,
                attempts=request.run_instances, deadline=deadline, sent=allocation.sent,
            )
        except LaunchTimeout:
            if time.monotonic() >= deadline:
                raise LaunchTimeout(request.run_id, request.spec.timeout, phase="provisioning") from None
            raise
        except TimeoutError as exc:
            raise LaunchTimeout(request.run_id, self.agent_timeout_s, phase="provisioning") from exc

    def _assign(self, allocation: EC2Allocation, deadline: float, cancel: threading.Event,
                timeout: float | None = None) -> None:
        """The lease's nodes serve this job next: one sealed assignment each, then their alive documents
        in the job's folder."""
        lease = allocation.lease
        assert lease is not None
        allocation.instances = list(lease.instances)
        seq = lease.assign(allocation.run_id)
        logger.debug("job %s: assignment %d of lease %s written", allocation.run_id, seq, lease.lease_id)
        self._wait_for_agents(allocation, deadline, cancel, timeout)

    def close(self) -> None:
        """End the idle warm leases this compute used last (a task runner does at flow end);
        ones in a job end when it gives them back."""
        POOL.close(owner=id(self))

    def account(self) -> str:
        """The AWS account the driver's credentials belong to (asked once)."""
        with self._lock:
            if self._account is None:
                self._account = str(self._client("sts").get_caller_identity()["Account"])
            return self._account

    def job_locations(self, request: EC2Request) -> list[str]:
        """The ``s3://`` folders a job's nodes use: its run folder, and its checkpoint location."""
        from prefect_sgpu.checkpoints import DIR_ENV, URI_ENV

        found = [self.store.uri(request.run_id)]
        for name in (URI_ENV, DIR_ENV):
            value = str(request.spec.env.get(name) or "")
            if value.startswith("s3://"):
                found.append(value)
        return found

    def _create_role(self, allocation: EC2Allocation) -> None:
        """The run's own role and instance profile (recorded first, so a failed create is cleaned up)."""
        request = allocation.request
        assert isinstance(request, EC2Request)
        allocation.job_role = request.job_role
        policy = roles.node_policy(request.run_id, self.region, self.account(), self.job_locations(request),
                                   self.kms_key_id)
        tags = {rq.RUN_ID_TAG: request.run_id, **self.provisioner.run_tags}
        roles.create(self._client("iam"), request.run_id, policy, tags, self.settings.node_permissions_boundary)

    def sweeper(self, tracking_uri: str | None = None, **options: Any) -> "Sweeper":
        """The sweeper of this compute (:mod:`prefect_sgpu.compute.remote.sweep`): its store, clients and TTL."""
        from prefect_sgpu.compute.remote.sweep import Sweeper

        iam = self._client("iam") if self.settings.job_roles else None
        return Sweeper(self.store, ttl_s=self.heartbeat_ttl_s, ec2=self.provisioner, ssm=self._client("ssm"),
                       tracking_uri=tracking_uri, iam=iam, **options)

    def _sweep(self, request: EC2Request) -> None:
        """What dead drivers of this store left (:mod:`prefect_sgpu.compute.remote.sweep`): removed before launching,
        without waiting for anything, never failing the job."""
        from prefect_sgpu.compute.remote.sweep import start_of_job_pass
        from prefect_sgpu.tracking import default_tracking_uri, mlflow_available

        tracking_uri = default_tracking_uri() if request.spec.mlflow and mlflow_available() else None
        start_of_job_pass(self, request.run_id, tracking_uri)

    def _wait_for_agents(self, allocation: EC2Allocation, deadline: float, cancel: threading.Event,
                         timeout: float | None = None) -> None:
        """Every node's bootstrap has announced itself (a sealed alive document of its instance).

        Ends at the job's deadline or after ``agent_timeout_s``, whichever is first
        (``LaunchTimeout``, phase "agent start"). An alive document that is not sealed
        by this job for this node and instance is refused (logged) and waited past.
        """
        run_id, instances = allocation.run_id, allocation.instances
        if len(instances) != allocation.plan.nodes:
            raise ProvisioningError(f"job {run_id}: asked for {allocation.plan.nodes} instance(s), "
                                    f"got {len(instances)}")
        own_timeout = self.agent_timeout_s if timeout is None else timeout
        own_limit = time.monotonic() + own_timeout
        limit = min(deadline, own_limit)
        up: set[int] = set()
        last_state_check = 0.0
        while True:
            listed = allocation.folder.node_documents()  # one listing a pass; a read only for what appeared
            for index, inst in enumerate(instances):
                if index not in up and alive_key(index) in listed and \
                        allocation.folder.alive(index, instance_id=inst.id) is not None:
                    up.add(index)
                    allocation.progress("agent up", f"node {index} on {inst.id} ({len(up)}/{len(instances)})")
            if len(up) == len(instances):
                break
            if cancel.is_set():
                raise JobCancelled(f"job {run_id} was cancelled while its nodes booted; they are terminated")
            now = time.monotonic()
            if now > limit:
                missing = [instances[i].id for i in range(len(instances)) if i not in up]
                waited = allocation.request.spec.timeout if deadline <= own_limit else own_timeout
                logger.error("job %s: no node agent on %s after %gs", run_id, missing, waited)
                raise LaunchTimeout(run_id, waited, phase="agent start")
            if now - last_state_check > 5.0:
                last_state_check = now
                dead = {k: v for k, v in self.provisioner.instance_states([i.id for i in instances]).items()
                        if v in DEAD_STATES}
                if dead:
                    raise ProvisioningError(f"job {run_id}: instance(s) {dead} went away while booting")
            cancel.wait(0.5)
        # addresses from DescribeInstances (the provisioner), never from what a node wrote
        allocation.nodes = [AllocatedNode(index=i, address=inst.private_ip, host=inst.id, instance_id=inst.id)
                            for i, inst in enumerate(instances)]

    def rendezvous_endpoint(self, allocation: Allocation) -> str:
        """Node 0's private address (from EC2) and the configured port: no port can be probed remotely."""
        endpoint = f"{allocation.nodes[0].address}:{self.rendezvous_port}"
        if isinstance(allocation, EC2Allocation) and allocation.progress:
            allocation.progress("rendezvous", f"c10d on node 0 at {endpoint}")
        return endpoint

    def start(self, allocation: Allocation, launch: JobLaunch) -> None:
        """One sealed launch document per node, bound to its index and its instance, all in one write."""
        assert isinstance(allocation, EC2Allocation)
        env = {k: v for k, v in launch.env.items() if k not in MASKED_ENV}  # the key travels through SSM only
        env[STORE_REGION_ENV] = self.region  # ranks reach the checkpoint location on S3 themselves
        env.update(self.store.env())  # and write it as the driver does (SSE-KMS key, bucket owner)
        if self.endpoint_url:
            env[STORE_ENDPOINT_ENV] = self.endpoint_url
        if launch.secrets:  # encrypted in SSM, beside the key; the documents only say they exist
            self._put_secure(allocation, ssm_secrets_parameter(allocation.run_id), json.dumps(launch.secrets),
                             "prefect-sgpu secrets= of one job (deleted when the job ends)", "secrets_parameter")
        allocation.folder.put_launches({
            command.node: (LaunchDocument(argv=list(command.argv), env=env, secrets=bool(launch.secrets)),
                           allocation.instance_id(command.node))
            for command in launch.commands})
        allocation.launched = True

    def _put_key(self, allocation: EC2Allocation) -> None:
        self._put_secure(allocation, ssm_key_parameter(allocation.run_id), allocation.folder.key,
                         "prefect-sgpu job key of one job (deleted when the job ends)", "key_parameter")

    def _put_secure(self, owner: Any, name: str, value: str, description: str, field: str) -> None:
        """A SecureString (under ``kms_key_id`` when set), recorded on its owner (the allocation, or a
        lease) *before* the put, so that even a failed put is cleaned up by release or close."""
        extra = {"KeyId": self.kms_key_id} if self.kms_key_id else {}
        setattr(owner, field, name)
        self._client("ssm").put_parameter(Name=name, Value=value, Type="SecureString", Overwrite=True,
                                          Description=description, **extra)

    def poll(self, allocation: Allocation) -> list[Event]:
        """Sealed node statuses; a node whose instance died or went silent is lost."""
        assert isinstance(allocation, EC2Allocation)
        now = time.monotonic()
        events: list[Event] = []
        for node in allocation.nodes:
            if node.index not in allocation.announced:
                allocation.announced.add(node.index)
                events.append(NodeUp(node.index, f"{node.instance_id} ({node.address})"))
        if now - allocation.polled < self.poll_interval_s:
            return events
        allocation.polled = now
        pending = [n for n in allocation.nodes if n.index not in allocation.reported]
        if now - allocation.states_checked > max(5.0, self.poll_interval_s):
            allocation.states_checked = now
            allocation.states = self.provisioner.instance_states([n.instance_id or "" for n in allocation.nodes])
        # one listing a pass for every node: statuses and notices are read only once they appear,
        # and a node is alive while its alive document's version keeps changing (no read at all)
        listed = allocation.folder.node_documents() if pending else {}
        for node in pending:
            iid = node.instance_id or ""
            status = allocation.folder.status(node.index, instance_id=iid) if status_key(node.index) in listed else None
            if status is not None:
                allocation.reported.add(node.index)
                events.append(NodeExited(node.index, status.exit_code, status))
                continue
            state = allocation.states.get(iid)
            if state in DEAD_STATES:
                allocation.reported.add(node.index)
                allocation.lost = True
                events.append(NodeLost(node.index, f"instance {iid} is {state} (lost or reclaimed) before "
                                                   "its ranks finished"))
                continue
            if node.index not in allocation.noticed and notice_key(node.index) in listed:
                notice = allocation.folder.notice(node.index, instance_id=iid)
                if notice is not None:
                    allocation.noticed.add(node.index)
                    allocation.lost = True
                    events.append(NodeNotice(node.index, f"{iid}: {notice.text}"))
            version = listed.get(alive_key(node.index))
            if version != allocation.alive_version.get(node.index) or node.index not in allocation.alive_changed:
                allocation.alive_version[node.index], allocation.alive_changed[node.index] = version, now
            elif now - allocation.alive_changed[node.index] > self.node_silence_s:
                allocation.reported.add(node.index)
                allocation.lost = True
                events.append(NodeLost(node.index, f"node {node.index} ({iid}) has not reported for "
                                                   f"{self.node_silence_s:g}s"))
        return events

    def stop(self, allocation: Allocation, grace: float = 10.0) -> None:
        """Write the sealed stop document; wait (grace + sync time) for every live node to report."""
        assert isinstance(allocation, EC2Allocation)
        folder = allocation.folder

        def pending(nodes: list[AllocatedNode]) -> list[AllocatedNode]:  # one listing, reads for what appeared
            listed = folder.node_documents()
            return [n for n in nodes if status_key(n.index) not in listed
                    or folder.status(n.index, instance_id=n.instance_id) is None]

        if not allocation.launched:
            return
        left = pending(allocation.nodes)
        if not left:
            allocation.reported |= {n.index for n in allocation.nodes}
            return
        folder.put_stop(grace, reason="stopped by the driver")
        deadline = time.monotonic() + grace + 10.0
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            states = self.provisioner.instance_states([n.instance_id or "" for n in left])
            dead = {n.index for n in left if states.get(n.instance_id or "") in DEAD_STATES}
            allocation.lost = allocation.lost or bool(dead)
            left = [n for n in pending(left) if n.index not in dead]
        # every node that reported (a warm lease needs all of them to serve another job)
        allocation.reported |= {n.index for n in allocation.nodes} - {n.index for n in left}

    def release(self, allocation: Allocation) -> Released:
        """Terminate instances, delete groups and the key parameter; the second call returns the first's result."""
        assert isinstance(allocation, EC2Allocation)
        with self._lock:
            if allocation.outcome is not None:
                return allocation.outcome
            allocation.released = True
        released = self._give_back(allocation)
        cost = None
        try:
            cost = self.provisioner.cost(allocation.instances, allocation.started, time.time())
        except Exception:  # noqa: BLE001 - a missing price must not hide the job's outcome
            logger.warning("could not estimate the cost of job %s", allocation.run_id, exc_info=True)
        released.cost = cost
        if allocation.progress:
            allocation.progress("kept warm" if allocation.kept else "terminated", _cost_text(cost))
        allocation.outcome = released
        return released

    def _give_back(self, allocation: EC2Allocation) -> Released:
        """Everything acquire took (instances, groups, the key parameter), on every path. A warm
        lease goes back to the pool only after a job every node of which reported its end."""
        gone: list[str] = []
        try:
            lease, allocation.lease = allocation.lease, None
            if lease is None:
                gone += self.provisioner.terminate(allocation.run_id)
            elif (allocation.launched and not allocation.lost and lease.healthy()
                  and allocation.reported >= {n.index for n in allocation.nodes}):
                POOL.give_back(lease, self.keep_warm)
                allocation.kept = True
            else:
                lease.mark_unfit("its last job did not end cleanly on every node")
                POOL.discard(lease)
                gone += [i.id for i in lease.instances]
        finally:
            for name in (allocation.key_parameter, allocation.secrets_parameter):
                if name and self.provisioner.delete_secret(name):
                    gone.append(f"SSM parameter {name}")
            if allocation.job_role:  # after the instances: their nodes use it until they end
                try:
                    gone += roles.delete(self._client("iam"), allocation.run_id)
                except Exception as exc:  # noqa: BLE001 - the sweeper takes it later
                    logger.warning("could not delete the IAM role of run %s: %s", allocation.run_id, exc)
        return Released(gone=gone)

    @contextmanager
    def _driver_heartbeat(self, folder: "JobFolder") -> Iterator[None]:
        """Keep the driver's sealed heartbeat fresh while acquire blocks (the driver beats afterwards)."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(HEARTBEAT_INTERVAL_S):
                try:
                    folder.beat()
                except Exception:  # noqa: BLE001 - the next beat may succeed
                    logger.debug("heartbeat failed", exc_info=True)

        thread = threading.Thread(target=beat, name=f"sgpu-ec2-beat-{folder.run_id}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(timeout=5)


def _bucket_owner(settings: dict[str, Any]) -> str | None:
    owner = str(settings.get("bucket_owner") or "").strip()
    if owner and not (len(owner) == 12 and owner.isdigit()):
        raise SGPUConfigError("bucket_owner", owner, "the 12-digit id of the AWS account that owns the store's "
                              "bucket, or empty")
    return owner or None


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
