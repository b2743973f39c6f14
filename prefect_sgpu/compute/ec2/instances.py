"""EC2 provisioning: one gang of GPU instances per run, placed together, always cleaned up.

:class:`EC2Provisioner` is the remote-node wing's provider on EC2
(:class:`prefect_sgpu.compute.remote.provider.Provider`). It is put together by responsibility:

- :mod:`~prefect_sgpu.compute.ec2.gang_launch`: launching a run's gang (failover over subnets and
  markets, the security and placement groups, the wait for "running");
- :mod:`~prefect_sgpu.compute.ec2.describe`: reading instances (states, a run's live ones by tag);
- :mod:`~prefect_sgpu.compute.ec2.cleanup`: terminating a run's instances and deleting its groups;
- :mod:`~prefect_sgpu.compute.ec2.leftovers`: what a dead driver's runs left, for the sweeper;
- :mod:`~prefect_sgpu.compute.ec2.prices`: what the instances cost, from AWS's price sources;
- this module: the clients, the job secrets (SSM), the request builders and the cost.

**No secrets reach the instances**: nodes use the instance profile and IMDSv2; the rendered
request is checked for the caller's AWS keys and the Prefect API key.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from prefect_sgpu import aws
from prefect_sgpu.compute.ec2 import leftovers, prices
from prefect_sgpu.compute.ec2 import request as rq
from prefect_sgpu.compute.ec2.cleanup import SG_DELETE_TIMEOUT_S, RunCleanup
from prefect_sgpu.compute.ec2.describe import DEAD_STATES, Instance, instance_states
from prefect_sgpu.compute.ec2.gang_launch import (CAPACITY_ERRORS, PROFILE_PROPAGATION_S, VCPU_QUOTAS, Attempt,
                                                  GangLaunch, vcpu_quota, vcpu_quota_of)
from prefect_sgpu.compute.ec2.request import LaunchAttempt
from prefect_sgpu.compute.ec2.settings import EC2Settings

if TYPE_CHECKING:
    from prefect_sgpu.compute.remote.provider import CloudLeftover, LeftoverScan
    from prefect_sgpu.store import Store

logger = logging.getLogger("prefect_sgpu.compute.ec2.instances")


class EC2Provisioner(GangLaunch, RunCleanup):
    """Launches, waits for and terminates one run's instances (see the module docstring); the
    remote-node wing's provider (:class:`prefect_sgpu.compute.remote.provider.Provider`) on EC2."""

    #: instance states of a machine that will not run a job again
    dead_states = DEAD_STATES

    def __init__(self, settings: EC2Settings, session: Any | None = None,
                 run_tags: dict[str, str] | None = None) -> None:
        self.settings = settings
        #: tags every resource of every run gets besides the settings' own (store, heartbeat TTL)
        self.run_tags = dict(run_tags or {})
        self._session = session
        self._clients: dict[str, Any] = {}
        self._clients_lock = threading.Lock()  # boto3 sessions do not create clients thread-safely
        self._launched: dict[str, set[str]] = {}
        self._expiry: dict[str, str] = {}
        self._prices: prices.PriceBook | None = None

    # -- boto3 ---------------------------------------------------------------------

    @property
    def session(self) -> Any:
        if self._session is None:
            self._session = aws.new_session(self.settings.region)
        return self._session

    def client(self, service: str) -> Any:
        """A client whose every call is retried by botocore on throttling and 5xx (:mod:`prefect_sgpu.aws`);
        one per service, shared by the compute, its leases and its sweeper."""
        with self._clients_lock:
            if service not in self._clients:
                self._clients[service] = aws.client(
                    service, self.session, self.settings.region, self.settings.endpoint_url,
                    retry_mode=self.settings.retry_mode, max_attempts=self.settings.max_attempts,
                )
            return self._clients[service]

    # -- what the compute, its leases and its sweeper read and delete -----------------

    def instance_states(self, ids: list[str], reasons: bool = False) -> dict[str, str]:
        """The state name of each instance id (:func:`~prefect_sgpu.compute.ec2.describe.instance_states`:
        an id EC2 no longer knows reads ``terminated``; another failure reads as no states)."""
        return instance_states(self.client("ec2"), ids, reasons)

    def put_secret(self, name: str, value: str, description: str, kms_key_id: str | None = None) -> None:
        """An SSM SecureString (under ``kms_key_id`` when set), overwritten if it exists, tagged with the
        run's store (:attr:`run_tags`) from the moment it exists: a sweeper lists only its own store's
        parameters by that tag. SSM takes tags with a new parameter only, so one that exists already
        (a retried write) is overwritten, then tagged."""
        ssm = self.client("ssm")
        extra = {"KeyId": kms_key_id} if kms_key_id else {}
        tags = [{"Key": k, "Value": v} for k, v in self.run_tags.items()]
        if not tags:
            ssm.put_parameter(Name=name, Value=value, Type="SecureString", Overwrite=True,
                              Description=description, **extra)
            return
        try:
            ssm.put_parameter(Name=name, Value=value, Type="SecureString", Description=description, Tags=tags,
                              **extra)
        except Exception as exc:  # noqa: BLE001 - only "already there" is answered here
            if aws.error_code(exc) != "ParameterAlreadyExists":
                raise
            ssm.put_parameter(Name=name, Value=value, Type="SecureString", Overwrite=True,
                              Description=description, **extra)
            ssm.add_tags_to_resource(ResourceType="Parameter", ResourceId=name, Tags=tags)

    def delete_secret(self, name: str) -> bool:
        """Delete the SSM parameter ``name`` (a job's or a lease's key); False when it was not
        there. Another failure is logged, not raised: the sweeper deletes it later."""
        try:
            self.client("ssm").delete_parameter(Name=name)
            return True
        except Exception as exc:  # noqa: BLE001
            if aws.error_code(exc) != "ParameterNotFound":
                logger.warning("could not delete SSM parameter %s: %s", name, exc)
            return False

    # -- the request (built by prefect_sgpu.compute.ec2.request) -------------------

    def instance_type_for(self, plan: Any) -> str:
        return rq.instance_type_for(self.settings, plan)

    def expiry(self, run_id: str) -> str:
        """One expiry per run: every retry and every resource carries identical tags."""
        if run_id not in self._expiry:
            self._expiry[run_id] = rq.expiry(self.settings.ttl_minutes)
        return self._expiry[run_id]

    def tags(self, run_id: str, market: str | None = None) -> list[dict[str, str]]:
        return rq.tags(self.settings, run_id, self.expiry(run_id), market, self.run_tags)

    def client_token(self, run_id: str, attempt: int) -> str:
        return rq.client_token(run_id, attempt)

    def placement_group_name(self, run_id: str) -> str:
        return rq.placement_group_name(run_id)

    def run_instances_request(self, run_id: str, plan: Any, user_data: str, subnet_id: str | None = None,
                              market: str | None = None, **options: Any) -> dict[str, Any]:
        """One ``run_instances`` request (see :func:`request.run_instances_request`), checked for secrets."""
        request = rq.run_instances_request(self.settings, run_id, plan, user_data, self.expiry(run_id),
                                           subnet_id, market, extra_tags=self.run_tags, **options)
        rq.refuse_secrets(request, rq.known_secrets(self.session))
        return request

    def attempts(self, run_id: str, plan: Any, user_data: str) -> tuple[LaunchAttempt, ...]:
        """Every try a launch makes, in failover order, rendered before any call."""
        return rq.launch_attempts(self.settings, run_id, plan, user_data, self.expiry(run_id),
                                  rq.known_secrets(self.session), self.run_tags)

    # -- the sweeper's (prefect_sgpu.compute.ec2.leftovers) --------------------------

    def find_leftovers(self, store: "Store") -> "LeftoverScan":
        """Instances, groups, SSM parameters and (with ``job_roles``) job roles tagged with ``store``
        (:func:`~prefect_sgpu.compute.ec2.leftovers.find_leftovers`); never the block's own group."""
        return leftovers.find_leftovers(store, self.client("ec2"), self.client("ssm"), self._iam(),
                                        own_group=self.settings.security_group_id)

    def remove_leftovers(self, run_id: str, found: "list[CloudLeftover]",
                         wait: bool = True) -> "list[CloudLeftover]":
        """Instances and groups (:meth:`terminate`, by the run's tag), SSM parameters, the job role
        (:func:`~prefect_sgpu.compute.ec2.leftovers.remove_leftovers`)."""
        return leftovers.remove_leftovers(run_id, found, wait, terminate=self.terminate, ssm=self.client("ssm"),
                                          iam=self._iam())

    def _iam(self) -> Any | None:
        """IAM, where this provider's runs have roles of their own (``job_roles``)."""
        return self.client("iam") if self.settings.job_roles else None

    # -- money ---------------------------------------------------------------------

    def cost(self, instances: list[Instance], started: float, ended: float) -> dict[str, Any]:
        """Instance-hours and their price in USD, split by market and region, each figure with its
        source (:mod:`~prefect_sgpu.compute.ec2.prices`): the Price List API's on-demand price, the
        zone's spot price history over the instances' lifetime, the capacity reservation's rate (a
        Capacity Block's upfront fee, counted once), or, offline, the catalog's table. One price is read per (market, instance type, zone)."""
        hours = max(0.0, ended - started) / 3600.0
        region = self.settings.region
        read: dict[tuple[str, str, str], prices.Price] = {}
        per_instance, unknown = [], []
        split: dict[str, dict[str, Any]] = {}
        usd = 0.0
        for inst in instances:
            key = (inst.market, inst.instance_type, inst.availability_zone)
            fresh = key not in read
            if fresh:
                read[key] = self._price_of(inst, region, started, ended)
            price = read[key]
            part = split.setdefault(f"{inst.market} {region}", {"market": inst.market, "region": region,
                                                                "instance_hours": 0.0, "usd": 0.0, "sources": []})
            if fresh and price.usd_upfront is not None:  # a Capacity Block's fee: once for the block, not per hour
                usd += price.usd_upfront
                part["usd"] = round(part["usd"] + price.usd_upfront, 6)
                part["upfront_usd"] = round(part.get("upfront_usd", 0.0) + price.usd_upfront, 6)
            part["instance_hours"] = round(part["instance_hours"] + hours, 6)
            if price.source not in part["sources"]:
                part["sources"].append(price.source)
            if price.usd_per_hour is None:
                unknown.append(inst.instance_type)
                part["unpriced"] = True
            else:
                usd += price.usd_per_hour * hours
                part["usd"] = round(part["usd"] + price.usd_per_hour * hours, 6)
            per_instance.append({"id": inst.id, "instance_type": inst.instance_type, "market": inst.market,
                                 "availability_zone": inst.availability_zone, **price.shown()})
        for part in split.values():
            part["source"] = ", ".join(part.pop("sources"))
        return {
            "instance_hours": round(hours * len(instances), 6),
            "usd": round(usd, 6),
            "usd_per_hour": round(sum(p["usd_per_hour"] or 0.0 for p in per_instance), 4),
            "price_source": ", ".join(sorted({p["source"] for p in per_instance})),
            "unpriced_instance_types": sorted(set(unknown)),
            "instances": per_instance,
            "compute": split,
        }

    @property
    def prices(self) -> prices.PriceBook:
        """This account's EC2 prices (one book per provider: its cache and its memory of a refusal)."""
        with self._clients_lock:
            if self._prices is None:
                self._prices = prices.PriceBook(self._price_client)
            return self._prices

    def _price_client(self, service: str, region: str) -> Any:
        """A client in ``region`` (the Price List API's is us-east-1's). Prices are optional: the Price List
        API's client tries once, so a release never waits out a retry for a price."""
        if service != "pricing" and region == self.settings.region:
            return self.client(service)
        with self._clients_lock:
            key = f"{service}@{region}"
            if key not in self._clients:  # botocore's max_attempts counts retries: 0 is one try
                self._clients[key] = aws.client(service, self.session, region, self.settings.endpoint_url,
                                                retry_mode=self.settings.retry_mode,
                                                max_attempts=0 if service == "pricing" else self.settings.max_attempts)
            return self._clients[key]

    def _price_of(self, inst: Instance, region: str, started: float, ended: float) -> prices.Price:
        if inst.market == "spot":
            return self.prices.spot(inst.instance_type, inst.availability_zone, region, started, ended)
        if inst.market == "reserved" and self.settings.capacity_reservation_id:
            return self.prices.reservation(self.settings.capacity_reservation_id, inst.instance_type, region)
        return self.prices.on_demand(inst.instance_type, region)


__all__ = ["CAPACITY_ERRORS", "DEAD_STATES", "PROFILE_PROPAGATION_S", "SG_DELETE_TIMEOUT_S", "VCPU_QUOTAS",
           "Attempt", "EC2Provisioner", "EC2Settings", "Instance", "vcpu_quota", "vcpu_quota_of"]
