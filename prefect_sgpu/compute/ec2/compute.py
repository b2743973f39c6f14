"""GPU VMs on EC2: one set of instances per job (or a warm lease for several), always terminated.

EC2 is one provider of the remote-node wing (:mod:`prefect_sgpu.compute.remote.nodes`), which
runs the store protocol between the driver and the nodes; this module plans EC2 requests
(instance types, failover tries, user-data, prices), launches them through
:class:`~prefect_sgpu.compute.ec2.instances.EC2Provisioner`, and adds what is EC2's own: the
S3 store, per-run IAM roles, and the sweeper's EC2 clients.

**The job key and who may run code on a node.** Anyone who can write the store may
delay a job, never run code in it: every document a node acts on is sealed with the
job key (HMAC) and bound to the job, its kind, the node index and the instance id.
The key itself never reaches S3, the user-data or a tag. ``acquire`` writes it to the
SSM SecureString ``jobfolder.ssm_key_parameter(run_id, store.scope)`` *before* launching (so a node
can verify every document from its first second) and ``release`` deletes it. Nodes
derive that name from their own ``--run-id`` and read it through their instance
profile. Node addresses (node 0's rendezvous host) come from DescribeInstances, never
from what a node writes.

**Warm leases.** With ``keep_warm`` seconds the instances are launched for a lease instead
(:mod:`prefect_sgpu.compute.remote.lease`) and kept between jobs of the same shape: the next job
is assigned to them and pays no boot. Each job still has its own folder and key.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from prefect_sgpu import aws, catalog
from prefect_sgpu.compute.base import Request
from prefect_sgpu.compute.ec2 import request as rq
from prefect_sgpu.compute.ec2 import capacity, efa, prices, roles
from prefect_sgpu.compute.ec2.instances import EC2Provisioner, Instance
from prefect_sgpu.compute.remote.lease import WarmLease, lease_id
from prefect_sgpu.environment import ship as environment_ship
from prefect_sgpu.environment.ship import environment_key
from prefect_sgpu.compute.remote.elastic import ElasticNodes
from prefect_sgpu.compute.remote.nodes import RemoteAllocation, RemoteNodeCompute, RemoteRequest
from prefect_sgpu.compute.ec2.request import LaunchAttempt
from prefect_sgpu.compute.ec2.settings import EC2Settings
from prefect_sgpu.errors import LaunchTimeout, ProvisioningError, SGPUConfigError
from prefect_sgpu.checkpoints import ENDPOINT_ENV as STORE_ENDPOINT_ENV
from prefect_sgpu.checkpoints import REGION_ENV as STORE_REGION_ENV
from prefect_sgpu.protocol import node_requests
from prefect_sgpu.protocol.jobfolder import ssm_key_parameter
from prefect_sgpu.spec import JobSpec, plan_remote
from prefect_sgpu.store.s3 import S3Store

if TYPE_CHECKING:
    from prefect_sgpu.compute.base import Allocation, Released
    from prefect_sgpu.store import Store
    from prefect_sgpu.compute.remote.sweep import Sweeper

logger = logging.getLogger("prefect_sgpu.compute.ec2.compute")
#: how many jobs' pinned AMIs a compute remembers (a job's recoveries come long before 256 newer jobs)
PINNED_IMAGES_KEPT = 256


@dataclass(frozen=True)
class EC2Request(RemoteRequest):
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
    #: the IAM role (and instance profile) acquire creates for this job, when the block asks for job roles
    job_role: str = ""
    job_role_path: str = ""

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "region": self.region,
            "run_instances": self.run_instances[0].params if self.run_instances else {},
            "failover": [{"market": a.market, "subnet_id": a.subnet_id} for a in self.run_instances],
            **({"image": _image_text(self.run_instances[0].params.get("ImageId", ""))} if self.run_instances else {}),
            "user_data": self.user_data,
            "store": self.store_uri,
            "payload_key": f"SSM SecureString {self.key_parameter} (deleted on release)",
            **({"job_role": f"IAM role and instance profile {self.job_role_path}{self.job_role} (policies/node-policy.json "
                            + ("for the lease, plus each job it serves while it runs; deleted when the lease ends)"
                               if self.lease_id else "for this run; deleted on release)")} if self.job_role else {}),
            "estimated_usd_per_hour": self.usd_per_hour,
            **({"keep_warm": f"a warm lease's instances when one of this shape is idle; else new ones for lease "
                             f"{self.lease_id}, kept {self.keep_warm:g}s between jobs"} if self.lease_id else {}),
            **self._reservation_shown(),
        }


    def _reservation_shown(self) -> dict[str, str]:
        """What a reserved try depends on that only launching can read (DescribeCapacityReservations)."""
        target = next((a.params["CapacityReservationSpecification"]["CapacityReservationTarget"]
                       for a in self.run_instances if a.market == "reserved"), None)
        if target is None:
            return {}
        return {"capacity_reservation": (
            f"{target['CapacityReservationId']}: launched into its zone and, when it has one, its placement "
            "group; a Capacity Block as MarketType=capacity-block; one that ends before the job's deadline "
            "is warned of when the job launches")}
def _image_text(image_id: str) -> str:
    """How the job's AMI is chosen, for the plan: one id for every launch of the job."""
    if image_id.startswith("resolve:ssm:"):
        return (f"the AMI SSM parameter {image_id[len('resolve:ssm:'):]} names at the job's first launch, "
                "pinned for its every gang and replacement")
    return f"{image_id}, for every launch of the job"


@dataclass
class EC2Allocation(RemoteAllocation):
    """One job's instances and what the driver tracks about them until release."""

    #: the run's own IAM role, once acquire started creating it
    job_role: str | None = None
    #: the run_instances requests actually sent (failover tries included), in order
    sent: list[dict[str, Any]] = field(default_factory=list)


class EC2InstanceCompute(ElasticNodes, RemoteNodeCompute):
    """Whole EC2 GPU instances per job; the S3 store is the only channel to them. An elastic job
    (``nodes=(min, max)``) launches with ``MinCount=min``, ``MaxCount=max`` and seeks the instances it did
    not get in the background (:mod:`~prefect_sgpu.compute.remote.elastic`)."""

    name = "ec2"
    allocation_type = EC2Allocation
    #: the user-data builds an environment of mode "driver" on the node (its files shipped at acquire)
    ships_environment = True
    provisioner: EC2Provisioner
    store: S3Store

    def __init__(self, settings: EC2Settings, *, session: Any | None = None) -> None:
        """Instances as ``settings`` say (validated where they were made; the store URI is checked here,
        before anything is spent). ``keep_warm``: seconds a job's instances wait for the next job of the
        same shape (a warm lease, :mod:`~prefect_sgpu.compute.remote.lease`); 0 terminates them after every job."""
        store = S3Store(settings.require_store(), session=session, region=settings.region,
                        endpoint_url=settings.endpoint_url, kms_key_id=settings.kms_key_id,
                        bucket_owner=settings.bucket_owner)
        provisioner = EC2Provisioner(settings, session=session,
                                     run_tags=rq.run_tags(store.root_uri, settings.heartbeat_ttl))
        super().__init__(provisioner, store, agent_timeout_s=settings.agent_timeout_s,
                         rendezvous_port=settings.rendezvous_port, poll_interval_s=settings.poll_interval_s,
                         node_silence_s=settings.node_silence_s, keep_warm=settings.keep_warm,
                         kms_key_id=settings.kms_key_id)
        self.region, self.session, self.endpoint_url = settings.region, session, settings.endpoint_url  # where AWS is
        self.heartbeat_ttl_s = settings.heartbeat_ttl
        self.replaces_nodes = settings.replace_lost == "nodes"
        self.python, self.setup_commands = settings.python, settings.setup_commands  # what the nodes boot with
        self.packs_environments = settings.pack_environments
        self.elastic_seek_s = settings.elastic_seek_s
        self._account: str | None = None
        self._policy_kms_key: str | None = None  # resolved once (policy_kms_key)
        #: each job's AMI (id, root device), resolved at its first launch: its later gangs, lone nodes and
        #: warm leases boot the same image even when the SSM parameter moved on (the newest jobs kept)
        self._pinned_images: dict[str, tuple[str, str]] = {}
        #: the driver's own S3 requests and bytes, per run, for the job's cost
        self.s3_meter = prices.S3Meter(store.client, store.bucket, store.prefix)

    def __repr__(self) -> str:
        return f"EC2InstanceCompute(region={self.region!r}, store={self.store.root_uri!r})"

    @property
    def settings(self) -> EC2Settings:
        return self.provisioner.settings

    @classmethod
    def from_settings(cls, settings: dict[str, Any], session: Any | None = None) -> "EC2InstanceCompute":
        """Built from settings given as keywords: the block's fields and :class:`EC2Settings`' own
        (``heartbeat_ttl_s`` instead of ``ttl_minutes``, for tests that kill a driver and wait for its
        nodes); a misspelt one is an ``SGPUConfigError``, as every bad value."""
        return cls(EC2Settings(**settings), session=session)

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
        ``json.dumps(launch.secrets)``, the environment's index credentials included), and SSM's
        standard tier refuses a value over 4096 bytes:
        refused here, before any instance is paid for. Names and sizes only in the message."""
        import json

        limit = 4096
        size = len(json.dumps(secrets).encode())
        if size > limit:
            sizes = ", ".join(f"{name}: {len(json.dumps(value).encode())}"
                              for name, value in sorted(secrets.items()))
            from prefect_sgpu.environment.ship import INDEX_SECRET

            if INDEX_SECRET in secrets:
                sizes += f"; {INDEX_SECRET} is the environment's index URLs with their credentials"
            raise SGPUConfigError("secrets", f"{size} bytes as the JSON EC2 nodes read ({sizes})",
                                  f"at most {limit} bytes in all (one SSM standard-tier parameter per job)",
                                  "Keep large values (files, certificates) in S3 or a mounted secret "
                                  "and pass where they are")

    def user_data(self, run_id: str, lease: bool = False, environment: Any = None, gang: int = 0,
                  node_index: int | None = None, timeout_s: float | None = None) -> str:
        """``environment``: the job's captured environment; mode "driver" builds it on the node.
        ``gang``: the gang of a cold job the instances serve (its stop is bound to it); ``node_index``:
        the node an instance launched alone replaces. ``timeout_s``: a cold job's timeout; its instances
        power off ``rq.LIFETIME_MARGIN_S`` after it whatever happens to them (a lease's instances serve
        job after job: they end by the lease's own rules)."""
        packs: list[str] = []
        if self.packs_environments:
            from prefect_sgpu.environment import ship as environment_ship

            try:
                packs = environment_ship.recorded_packs(self.store, environment)
            except Exception as exc:  # noqa: BLE001 - without a pack the nodes build, as they did
                logger.warning("the packs of environment %s could not be read (%s: %s): nodes build it",
                               getattr(environment, "digest", "?")[:16], type(exc).__name__, exc)
        return rq.render_user_data(self.store.root_uri, run_id, self.region, self.heartbeat_ttl_s,
                                   endpoint_url=self.endpoint_url, python=self.python,
                                   setup=self.setup_commands,
                                   backstop_s=max(self.heartbeat_ttl_s, self.agent_timeout_s),
                                   kms_key_id=self.store.kms_key_id, bucket_owner=self.store.bucket_owner,
                                   lease=lease, environment=environment, gang=gang, node_index=node_index,
                                   packs=packs,  # a lone replacement's offer would go unrecorded
                                   offer_pack=self.packs_environments and node_index is None,
                                   lifetime_s=None if lease or timeout_s is None
                                   else float(timeout_s) + rq.LIFETIME_MARGIN_S)

    def plan(self, spec: JobSpec, run_id: str) -> EC2Request:
        plan = plan_remote(spec, instance_type=rq.override_for(self.settings, spec.gpu_type))
        # a job that asked for fresh machines takes no warm lease and leaves none: jobs on one lease are one principal
        warm = self.keep_warm > 0 and not spec.fresh_machines
        if plan.elastic and warm:
            raise SGPUConfigError("nodes", spec.nodes, f"a whole number of nodes with keep_warm={self.keep_warm:g} "
                                  "(a warm lease keeps a fixed set of instances); an elastic job needs keep_warm=0 "
                                  "or fresh_machines=True")
        lease = lease_id(run_id) if warm else ""
        user_data = self.user_data(lease or run_id, lease=bool(lease), environment=spec.environment,
                                   timeout_s=spec.timeout)
        attempts = self.provisioner.attempts(lease or run_id, plan, user_data)
        if plan.elastic:  # EC2 launches as many as it can up to MaxCount, none below MinCount (RunInstances)
            attempts = tuple(replace(a, params={**a.params, "MinCount": plan.min_nodes}) for a in attempts)
        instance_type = attempts[0].params["InstanceType"] if attempts else rq.instance_type_for(self.settings, plan)
        known = catalog.instance_type_by_name(instance_type)
        price = round(plan.nodes * known.price_per_hour, 3) if known and known.price_per_hour else None
        return EC2Request(run_id=run_id, compute=self.name, plan=plan, spec=spec,
                          heartbeat_ttl_s=self.heartbeat_ttl_s, region=self.region, instance_type=instance_type,
                          run_instances=attempts, user_data=user_data, store_uri=self.store.uri(run_id),
                          key_parameter=ssm_key_parameter(run_id, self.store.scope), usd_per_hour=price,
                          agent_timeout_s=self.boot_timeout_s(instance_type),
                          job_role=roles.role_name(lease or run_id) if self.settings.job_roles else "",
                          job_role_path=roles.role_path(self.store.scope),
                          keep_warm=self.keep_warm if warm else 0.0, lease_id=lease)

    def price_per_hour(self, request: Request) -> float | None:
        """The plan's: the catalog's on-demand list price of its instance type, times its nodes (None
        where the catalog has none)."""
        return request.usd_per_hour if isinstance(request, EC2Request) else None

    def boot_timeout_s(self, instance_type: str) -> float:
        """The wait for the agents of ``instance_type`` from ``running``: the block's ``agent_timeout_s``
        when it was changed from its default, else the family's
        (:func:`~prefect_sgpu.compute.ec2.capacity.boot_timeout_s`: a p5 boots for many minutes)."""
        default = type(self.settings).model_fields["agent_timeout_s"].default
        configured = None if self.settings.agent_timeout_s == default else self.settings.agent_timeout_s
        return capacity.boot_timeout_s(instance_type, configured)

    def _agent_timeout(self, allocation: RemoteAllocation) -> float:
        """The request's (:meth:`boot_timeout_s` of its instance type)."""
        request = allocation.request
        return request.agent_timeout_s if isinstance(request, EC2Request) else self.agent_timeout_s

    def replan(self, request: Request, gang: int) -> EC2Request:
        """The same launch tries in the same order (the first market first, then the fallback
        chain), each with a ClientToken of its own for this gang: new instances, not the lost ones,
        whose user-data names the gang (the job's stop is bound to it). A warm job's new instances
        are a new lease's (its own id, tags and tokens; the lease's assignment names the gang)."""
        assert isinstance(request, EC2Request)
        if request.lease_id:
            lease = lease_id(request.run_id, gang)
            user_data = self.user_data(lease, lease=True, environment=request.spec.environment)
            return replace(request, lease_id=lease, user_data=user_data,
                           run_instances=self.provisioner.attempts(lease, request.plan, user_data))
        user_data = self.user_data(request.run_id, environment=request.spec.environment, gang=gang,
                                   timeout_s=request.spec.timeout)
        attempts = tuple(replace(a, params={**a.params, "UserData": user_data,
                                            "ClientToken": rq.client_token(request.run_id, i, gang)})
                         for i, a in enumerate(request.run_instances))
        return replace(request, user_data=user_data, run_instances=attempts)

    # -- what the remote-node wing asks of EC2 ---------------------------------------------

    def _requested_text(self, request: RemoteRequest) -> str:
        assert isinstance(request, EC2Request)
        return f"{request.plan.nodes} x {request.instance_type} in {self.region}"

    def _describe(self, machine: Any) -> str:
        return f"{machine.id} ({machine.private_ip}, {machine.availability_zone}, {machine.market})"

    def release(self, allocation: "Allocation") -> "Released":
        """As every remote-node compute releases; the cost adds the driver's S3 requests and transfer of
        the run since its last gang's release and the nodes' own requests (:func:`~prefect_sgpu.compute.ec2.prices.with_requests`)."""
        nodes = self._nodes_requests(allocation) if isinstance(allocation, RemoteAllocation) else None
        released = super().release(allocation)
        if released.cost is not None and "storage" not in released.cost:
            released.cost = prices.with_requests(released.cost, self.s3_meter.take(allocation.run_id), nodes)
        return released

    def _nodes_requests(self, allocation: RemoteAllocation) -> prices.NodeCounts:
        """Each node's own S3 requests of this gang, as it reported them (one read a node, before the release)."""
        folder, reported = allocation.folder, {}
        for node in allocation.nodes:
            try:
                counts = node_requests.read(folder.store, allocation.run_id, folder.key, node.index,
                                            instance_id=node.instance_id, gang=folder.gang)
            except Exception as exc:  # noqa: BLE001 - a cost figure missing, the release goes on
                logger.warning("node %s's S3 request counts could not be read: %s", node.index, aws.error_of(exc))
                counts = None
            if counts is not None:
                reported[node.index] = counts
        return reported, len(allocation.nodes)

    def _cleanup(self, allocation: RemoteAllocation) -> list[str]:
        if not getattr(allocation, "job_role", None):
            return []
        return self._delete_role(allocation.run_id)

    def _delete_role(self, run_id: str) -> list[str]:
        try:
            return roles.delete(self._client("iam"), run_id)
        except Exception as exc:  # noqa: BLE001 - the sweeper takes it later
            logger.warning("could not delete the IAM role of %s: %s", run_id, exc)
            return []

    def _prepare_lease(self, allocation: RemoteAllocation, lease: WarmLease) -> None:
        """With job roles: the lease's own role (its folder, key, instances and environment), deleted
        when the lease ends; each job it serves is added while it runs (:meth:`_grant`)."""
        if not self.settings.job_roles:
            return
        lease.on_close.append(lambda: self._delete_role(lease.lease_id))
        self._create_role(allocation, lease.lease_id, [self.store.uri(lease.lease_id)])

    def _grant(self, allocation: RemoteAllocation, lease: WarmLease) -> None:
        """With job roles: the lease's role reaches this job's files, checkpoint location and key, until
        :meth:`_revoke` (IAM takes seconds to apply it; a node retries its first reads meanwhile)."""
        if not self.settings.job_roles:
            return
        request = allocation.request
        assert isinstance(request, EC2Request)
        policy = roles.job_access_policy(request.run_id, self.region, self.account(), self.job_locations(request),
                                         self.store.scope, self.settings.kms_key_id)
        roles.grant_job(self._client("iam"), lease.lease_id, policy)

    def _revoke(self, allocation: RemoteAllocation, lease: WarmLease) -> None:
        if self.settings.job_roles:
            roles.revoke_job(self._client("iam"), lease.lease_id)

    def _console_output(self, machine_id: str) -> str:
        """EC2's copy of the instance's serial console (GetConsoleOutput, base64 by the API's word; some
        endpoints send the text itself). Minutes behind the instance on real EC2."""
        import base64
        import binascii

        found = self._client("ec2").get_console_output(InstanceId=machine_id, Latest=True).get("Output") or ""
        try:
            return base64.b64decode(found, validate=True).decode("utf-8", "replace")
        except (binascii.Error, ValueError):
            return found

    def _launch_env(self, allocation: RemoteAllocation) -> dict[str, str]:
        env = {STORE_REGION_ENV: self.region}  # ranks reach the checkpoint location on S3 themselves
        env.update(self.store.env())  # and write it as the driver does (SSE-KMS key, bucket owner)
        if self.endpoint_url:
            env[STORE_ENDPOINT_ENV] = self.endpoint_url
        # an EFA type: the ranks set NCCL's EFA environment and the gang check its floor (the job's env wins)
        own = allocation.request.spec.env
        env.update({k: v for k, v in efa.rank_hints(allocation.request.instance_type).items() if k not in own})
        return env

    def _lease_key(self, request: EC2Request) -> tuple[Any, ...]:
        """Jobs of the same shape on the same settings may share a lease."""
        plan = request.plan
        return ("ec2", self.region, self.store.root_uri, request.instance_type, plan.nodes, plan.procs_per_node,
                self.python, self.setup_commands, self.heartbeat_ttl_s,
                self.settings.model_dump_json(exclude={"keep_warm"}),  # a lease serves computes of any keep_warm
                environment_key(request.spec.environment))

    def _provision(self, allocation: RemoteAllocation, launch_id: str, deadline: float,  # type: ignore[override]
                   cancel: threading.Event) -> list[Instance]:
        """The request's instances, launched and tagged for ``launch_id`` (the job's run id, or its
        lease's); a deadline reached while they start is the job's ``LaunchTimeout``."""
        request = allocation.request
        assert isinstance(request, EC2Request) and isinstance(allocation, EC2Allocation)
        return self._launch(allocation, launch_id, request.plan, request.user_data, request.run_instances,
                            deadline, cancel, "")

    def _provision_node(self, allocation: RemoteAllocation, node: int, deadline: float,  # type: ignore[override]
                        cancel: threading.Event) -> Instance:
        """One instance in the run's groups (a warm lease's: the lease's), launched alone for node ``node``
        of the job's current gang: the request's tries in order, each with a ClientToken of its own for
        that gang and node, and user-data that names the node (its launch index is 0) and a cold job's gang.
        Only subnets in the kept machines' zone are tried (the run's cluster placement group is bound to
        it), a failure ends only what this launch started, and a reservation's slot is waited for."""
        request = allocation.request
        assert isinstance(request, EC2Request)
        gang = allocation.folder.gang
        lease = allocation.lease.lease_id if allocation.lease is not None else None
        launch_id = lease or request.run_id
        user_data = self.user_data(launch_id, lease=bool(lease), environment=request.spec.environment,
                                   gang=0 if lease else gang, node_index=node,  # a lease's assignment names the gang
                                   timeout_s=request.spec.timeout)
        one = replace(request.plan, nodes=1)
        # a running elastic job's replacement of a lost node: a token of its own (EC2 answers a token it saw
        # with that launch's instances, the lost one; "Ensure idempotency in Amazon EC2 API requests")
        seed = f"{launch_id}:{allocation.instances[node].id}" if node in allocation.replacing else launch_id
        # the lone node joins its gang's placement group when the gang has one (rendered for one node, it would not)
        group = request.run_instances[0].params.get("Placement") if request.run_instances else None
        attempts = tuple(replace(a, params={**{k: v for k, v in a.params.items() if k != "Placement"},
                                            **({"Placement": group} if group else {}), "UserData": user_data,
                                            "ClientToken": rq.client_token(seed, i, gang, node)})
                         for i, a in enumerate(self.provisioner.attempts(launch_id, one, user_data)))
        # the run's cluster placement group is bound to its machines' zone: only subnets there are tried
        zones = {m.availability_zone for i, m in enumerate(allocation.instances)
                 if i != node and isinstance(m, Instance)}
        zone = next(iter(zones)) if len(zones) == 1 else None
        (instance,) = self._launch(allocation, launch_id, one, user_data, attempts, deadline, cancel,
                                   f"node {node}: ", zone=zone, alone=True)
        return instance

    def _capacity_short(self, exc: BaseException) -> bool:
        """A launch whose every subnet and market answered with a capacity error or a quota (the
        provisioner's error lists them as ``attempts``): EC2 may have room later."""
        return isinstance(exc, ProvisioningError) and bool(getattr(exc, "attempts", None))

    def _launch(self, allocation: RemoteAllocation, launch_id: str, plan: Any, user_data: str,
                attempts: tuple[LaunchAttempt, ...], deadline: float, cancel: threading.Event,
                label: str, zone: str | None = None, alone: bool = False) -> list[Instance]:
        """``provisioner.provision`` with its timeouts as the job's: the job's deadline reached is its
        ``LaunchTimeout`` of the whole job, the provisioner's own wait one of ``agent_timeout_s``."""
        request = allocation.request
        assert isinstance(allocation, EC2Allocation)
        try:
            image = self._pinned_images.get(request.run_id)
            if image is None:  # once per job: every later gang, node and warm lease of it boots this AMI
                self.settings.require_launchable()
                image = self._pinned_images[request.run_id] = self.provisioner.image()
                while len(self._pinned_images) > PINNED_IMAGES_KEPT:
                    self._pinned_images.pop(next(iter(self._pinned_images)))
                if allocation.progress is not None:
                    allocation.progress("provisioning", f"AMI {image[0]}, pinned for every launch of the job")
            return self.provisioner.provision(
                launch_id, plan, user_data,
                progress=lambda text: allocation.progress("provisioning", label + text), should_stop=cancel.is_set,
                attempts=attempts, deadline=deadline, sent=allocation.sent, zone=zone, alone=alone, image=image,
                needs_index=environment_ship.builds_on_node(request.spec.environment),
            )
        except LaunchTimeout:
            if time.monotonic() >= deadline:
                raise LaunchTimeout(request.run_id, request.spec.timeout, phase="provisioning") from None
            raise
        except TimeoutError as exc:
            raise LaunchTimeout(request.run_id, self.agent_timeout_s, phase="provisioning") from exc

    def account(self) -> str:
        """The AWS account the driver's credentials belong to (asked once)."""
        with self._lock:
            if self._account is None:
                self._account = str(self._client("sts").get_caller_identity()["Account"])
            return self._account

    def policy_kms_key(self) -> str | None:
        """The store's KMS key as policies name it: an alias given as ``kms_key_id`` resolved to its key
        ARN with one ``kms.describe_key`` (asked once; IAM never matches an alias for KMS's
        cryptographic calls, :func:`~prefect_sgpu.compute.ec2.roles.kms_key_arn`); a key id or ARN as given."""
        with self._lock:
            if self._policy_kms_key is None:
                key = self.kms_key_id
                self._policy_kms_key = (roles.resolve_kms_key(self._client("kms"), key, self.region)
                                        if roles.is_kms_alias(key) else key) or ""
            return self._policy_kms_key or None

    def job_locations(self, request: EC2Request) -> list[str]:
        """The ``s3://`` folders a job's nodes use: its run folder, and its checkpoint location."""
        from prefect_sgpu.checkpoints import DIR_ENV, URI_ENV

        found = [self.store.uri(request.run_id)]
        for name in (URI_ENV, DIR_ENV):
            value = str(request.spec.env.get(name) or "")
            if value.startswith("s3://"):
                found.append(value)
        return found

    def _prepare(self, allocation: RemoteAllocation) -> None:
        request = allocation.request
        assert isinstance(request, EC2Request) and isinstance(allocation, EC2Allocation)
        if request.job_role:
            allocation.job_role = request.job_role  # recorded first, so a failed create is cleaned up
            self._create_role(allocation, request.run_id, self.job_locations(request))

    def _create_role(self, allocation: RemoteAllocation, owner: str, locations: list[str]) -> None:
        """The role and instance profile of ``owner`` (a run, or a lease): ``locations``, its SSM path, its
        instances, its environment."""
        request = allocation.request
        assert isinstance(request, EC2Request)
        environment = request.spec.environment
        builds = environment_ship.builds_on_node(environment)
        own = self.store.uri(environment_ship.STORE_FOLDER, environment.digest) if builds else None
        packs = (self.store.uri(environment_ship.STORE_FOLDER, environment_ship.packages_folder(environment))
                 if builds and self.packs_environments else None)
        policy = roles.node_policy(owner, self.region, self.account(), locations,
                                   self.store.scope, self.policy_kms_key(), environment_uri=own,
                                   packages_uri=packs)
        tags = {rq.RUN_ID_TAG: owner, **self.provisioner.run_tags}
        roles.create(self._client("iam"), owner, policy, tags, self.store.scope,
                     self.settings.node_permissions_boundary)

    def sweeper(self, tracking_uri: str | None = None, **options: Any) -> "Sweeper":
        """The sweeper of this compute (:mod:`prefect_sgpu.compute.remote.sweep`): its store, its provider
        (instances, groups, SSM parameters and, with ``job_roles``, job roles) and its heartbeat TTL."""
        from prefect_sgpu.compute.remote.sweep import Sweeper

        options.setdefault("ttl_s", self.heartbeat_ttl_s)
        return Sweeper(self.store, cloud=self.provisioner, tracking_uri=tracking_uri, **options)

    def _sweep(self, request: RemoteRequest) -> None:
        """What dead drivers of this store left (:mod:`prefect_sgpu.compute.remote.sweep`): removed before launching,
        without waiting for anything, never failing the job."""
        from prefect_sgpu.compute.remote.sweep import start_of_job_pass
        from prefect_sgpu.observe.tracking import default_tracking_uri, mlflow_available

        tracking_uri = default_tracking_uri() if request.spec.mlflow and mlflow_available() else None
        start_of_job_pass(self, request.run_id, tracking_uri)
