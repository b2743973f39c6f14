"""What an EC2 job asks AWS for, built before anything is spent: no AWS call in this module.

``EC2InstanceCompute.plan`` renders every ``run_instances`` request a job may send
(one per subnet and market, in failover order), its tags and its user-data here;
``dry_run`` prints them and provisioning sends them, so what a user reviews is what
is sent. Only what provisioning itself creates or resolves (the security group, an
AMI named by an SSM parameter, the AMI's root device) is filled in at launch time,
by :meth:`LaunchAttempt.resolved`.

Nothing secret goes into a request: the user-data starts the node bootstrap with
the store, run id, region and heartbeat TTL only (nodes get AWS access from their
instance profile and the job key from SSM), and :func:`refuse_secrets` fails a
request that would carry the caller's AWS keys or Prefect API key.
"""

from __future__ import annotations

import copy
import datetime as _dt
import hashlib
import json
import logging
import math
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from prefect_sgpu import catalog
from prefect_sgpu.compute.ec2 import efa
from prefect_sgpu.compute.ec2.settings import EC2Settings
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.spec import Plan

if TYPE_CHECKING:
    from prefect_sgpu.environment import Environment

logger = logging.getLogger("prefect_sgpu.compute.ec2.request")

RUN_ID_TAG = "sgpu:run-id"
OWNER_TAG = "sgpu:owner"
TTL_TAG = "sgpu:ttl"
MARKET_TAG = "sgpu:market"
#: the job store a run belongs to: a sweeper judges only its own store's runs (by their heartbeat there)
STORE_TAG = "sgpu:store"
#: seconds without a driver heartbeat after which the run's nodes stop themselves
HEARTBEAT_TTL_TAG = "sgpu:heartbeat-ttl"
DEFAULT_ROOT_DEVICE = "/dev/sda1"  # Ubuntu Deep Learning AMIs
#: where cloud-init keeps the scripts it runs at every boot (its ``scripts_per_boot`` module), first boot included;
#: cloud-init docs, "Module reference: Scripts per boot". An image whose cloud-init reads them elsewhere sets
#: :data:`PER_BOOT_ENV` in the environment the user-data runs in.
PER_BOOT_DIR = "/var/lib/cloud/scripts/per-boot"
PER_BOOT_ENV = "PREFECT_SGPU_PER_BOOT_DIR"
PER_BOOT_SCRIPT = "prefect-sgpu-power-off"
#: a node's absolute lifetime beyond the job's timeout: release, the last uploads, a late first boot
LIFETIME_MARGIN_S = 600.0
MIN_SECRET_LEN = 12  # AWS key ids are 20 characters, secrets 40: shorter strings are not keys


def placement_group_name(run_id: str) -> str:
    """The name of a run's placement group, and of its security group."""
    return f"sgpu-{run_id}"


security_group_name = placement_group_name


def created_group_placeholder(run_id: str) -> str:
    """Stands for the security group provisioning creates, until it exists."""
    return f"<created: {security_group_name(run_id)}>"


def client_token(run_id: str, attempt: int, gang: int = 0, node: int | None = None) -> str:
    """Same run, gang and attempt, same token: a retried launch returns the first one; a
    relaunch after lost capacity (``gang`` > 0) gets new instances; ``node``: the one instance that
    replaces that lost node in that gang."""
    seed = f"{run_id}:{attempt}" if gang == 0 else f"{run_id}:gang-{gang}:{attempt}"
    if node is not None:
        seed += f":node-{node}"
    digest = hashlib.sha256(seed.encode()).hexdigest()[:40]
    return f"sgpu-{digest}"


def expiry(ttl_minutes: int, now: _dt.datetime | None = None) -> str:
    """The ``sgpu:ttl`` tag: when a sweeper may consider the run's resources abandoned."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return (now + _dt.timedelta(minutes=ttl_minutes)).strftime("%Y-%m-%dT%H:%M:%SZ")


def run_tags(store_uri: str, heartbeat_ttl_s: float) -> dict[str, str]:
    """The tags that let a sweeper judge a run (:mod:`prefect_sgpu.compute.remote.sweep`): its store and its TTL."""
    return {STORE_TAG: store_uri, HEARTBEAT_TTL_TAG: str(int(math.ceil(heartbeat_ttl_s)))}


def tags(settings: EC2Settings, run_id: str, expires: str, market: str | None = None,
         extra: Mapping[str, str] | None = None) -> list[dict[str, str]]:
    """Every resource's tags: the run id (cleanup finds resources by it), owner, expiry, the
    run's store and heartbeat TTL (``extra``, see :func:`run_tags`), user tags."""
    values = {
        "Name": f"sgpu-{run_id}",
        RUN_ID_TAG: run_id,
        OWNER_TAG: settings.owner_name,
        TTL_TAG: expires,
        **(extra or {}),
        **settings.tags,
    }
    if market:
        values[MARKET_TAG] = market
    return [{"Key": k, "Value": str(v)} for k, v in values.items()]


def override_for(settings: EC2Settings, gpu_type: str | None) -> str | None:
    """The block's ``instance_types`` override for ``gpu_type``: the one place it is looked up."""
    if not gpu_type:
        return None
    return settings.instance_types.get(catalog.lookup(gpu_type).name)


def instance_type_for(settings: EC2Settings, plan: Plan) -> str:
    """The block's override for the plan's GPU type, else the catalog's instance type."""
    itype = plan.instance_type
    if itype is None:
        raise SGPUConfigError("instance_type", None, "a remote plan with an instance type from the catalog")
    for acc in catalog.CATALOG.values():
        if itype in acc.instance_types:
            override = override_for(settings, acc.name)
            if override:
                known = catalog.instance_type_by_name(override)
                if known is not None and known.gpus != plan.procs_per_node:
                    raise SGPUConfigError(
                        f"instance_types[{acc.name}]", override,
                        f"an instance type with {plan.procs_per_node} GPUs per node (the plan's), "
                        f"{override} has {known.gpus}",
                    )
                return override
    return itype.name


def uses_placement_group(settings: EC2Settings, instance_type: str, nodes: int) -> bool:
    """Whether a launch goes into the run's cluster placement group: ``placement_group='auto'`` (the
    default) only for more than one node of an EFA type, where low-latency networking between the
    nodes pays for the group's higher odds of ``InsufficientInstanceCapacity`` (AWS docs, "Placement
    strategies for your placement groups"); 'cluster' always, 'none' never."""
    choice = settings.placement_group
    if choice != "auto":
        return choice == "cluster"
    return nodes > 1 and efa_interfaces(instance_type) > 0


def efa_interfaces(instance_type: str) -> int:
    known = catalog.instance_type_by_name(instance_type)
    return known.efa_interfaces if known else 0


def run_instances_request(
    settings: EC2Settings,
    run_id: str,
    plan: Plan,
    user_data: str,
    expires: str,
    subnet_id: str | None = None,
    market: str | None = None,
    *,
    attempt: int = 0,
    image_id: str | None = None,
    security_group_id: str | None = None,
    root_device: str = DEFAULT_ROOT_DEVICE,
    extra_tags: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The exact keyword arguments of one ``run_instances`` call.

    Without ``image_id`` the AMI is EC2's own ``resolve:ssm:`` reference to the SSM
    parameter; without a security group it names the group provisioning creates.
    """
    s = settings
    market = market or s.markets()[0]
    if market not in ("spot", "on-demand", "reserved"):
        raise SGPUConfigError("market", market, "one of spot, on-demand, reserved")
    subnet_id = subnet_id or (s.subnet_ids[0] if s.subnet_ids else None)
    itype = instance_type_for(s, plan)
    sg = security_group_id or s.security_group_id or created_group_placeholder(run_id)
    resource_tags = tags(s, run_id, expires, market, extra_tags)
    resource_types = ["instance", "volume", "network-interface"]
    if market == "spot":
        resource_types.append("spot-instances-request")
    request: dict[str, Any] = {
        "ImageId": image_id or s.ami_id or f"resolve:ssm:{s.ami_ssm_parameter}",
        "InstanceType": itype,
        "MinCount": plan.nodes,
        "MaxCount": plan.nodes,
        "ClientToken": client_token(run_id, attempt),
        "UserData": user_data,
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled", "HttpPutResponseHopLimit": 2},
        "BlockDeviceMappings": [{
            "DeviceName": root_device,
            "Ebs": {"VolumeSize": s.volume_size_gb, "VolumeType": "gp3", "DeleteOnTermination": True,
                    "Encrypted": True},
        }],
        "InstanceInitiatedShutdownBehavior": "terminate",
        "TagSpecifications": [{"ResourceType": rt, "Tags": resource_tags} for rt in resource_types],
    }
    if uses_placement_group(s, itype, plan.nodes):
        request["Placement"] = {"GroupName": placement_group_name(run_id)}
    if s.job_roles:  # created by acquire just before launching (prefect_sgpu.compute.ec2.roles)
        request["IamInstanceProfile"] = {"Name": f"sgpu-{run_id}"}
    elif s.instance_profile:
        key = "Arn" if s.instance_profile.startswith("arn:") else "Name"
        request["IamInstanceProfile"] = {key: s.instance_profile}
    interfaces = efa.network_interfaces(itype, subnet_id, [sg])  # the family's layout (compute/ec2/efa.py)
    if interfaces:
        request["NetworkInterfaces"] = interfaces
    else:
        if subnet_id:
            request["SubnetId"] = subnet_id
        request["SecurityGroupIds"] = [sg]
    if market == "spot":
        request["InstanceMarketOptions"] = {
            "MarketType": "spot",
            "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"},
        }
    elif market == "reserved":
        if not s.capacity_reservation_id:
            raise SGPUConfigError("capacity_reservation_id", None, "a capacity reservation id for market='reserved'")
        request["CapacityReservationSpecification"] = {
            "CapacityReservationTarget": {"CapacityReservationId": s.capacity_reservation_id}
        }
    return request


@dataclass(frozen=True)
class LaunchAttempt:
    """One ``run_instances`` a job may send: its market, subnet and the request itself."""

    market: str
    subnet_id: str | None
    params: dict[str, Any] = field(default_factory=dict)

    def resolved(self, image_id: str, security_group_id: str, root_device: str) -> dict[str, Any]:
        """The request with what provisioning created or looked up filled in (nothing else changes)."""
        params = copy.deepcopy(self.params)
        if str(params.get("ImageId", "")).startswith("resolve:ssm:"):
            params["ImageId"] = image_id
        placeholder = created_group_placeholder_of(params)
        if placeholder:
            for nic in params.get("NetworkInterfaces", []):
                nic["Groups"] = [security_group_id if g == placeholder else g for g in nic["Groups"]]
            if "SecurityGroupIds" in params:
                params["SecurityGroupIds"] = [security_group_id if g == placeholder else g
                                              for g in params["SecurityGroupIds"]]
        for mapping in params.get("BlockDeviceMappings", []):
            if mapping.get("DeviceName") == DEFAULT_ROOT_DEVICE:
                mapping["DeviceName"] = root_device
        return params


def created_group_placeholder_of(params: dict[str, Any]) -> str | None:
    groups = list(params.get("SecurityGroupIds", []))
    for nic in params.get("NetworkInterfaces", []):
        groups += nic.get("Groups", [])
    return next((g for g in groups if g.startswith("<created: ")), None)


def launch_attempts(settings: EC2Settings, run_id: str, plan: Plan, user_data: str, expires: str,
                    secrets: list[tuple[str, str]],
                    extra_tags: Mapping[str, str] | None = None) -> tuple[LaunchAttempt, ...]:
    """Every (market, subnet) try in failover order, each with its own request and ClientToken.

    Reserved tries outside the reservation's zone are dropped at launch time (finding
    the zone is an AWS call); everything else is sent as rendered here.
    """
    subnets: list[str | None] = list(settings.subnet_ids) or [None]
    pairs = [(m, sub) for m in settings.markets() for sub in subnets]
    attempts = tuple(
        LaunchAttempt(market, subnet, run_instances_request(settings, run_id, plan, user_data, expires, subnet,
                                                            market, attempt=number, extra_tags=extra_tags))
        for number, (market, subnet) in enumerate(pairs)
    )
    for attempt in attempts:
        refuse_secrets(attempt.params, secrets)
    return attempts


def render_user_data(
    store_uri: str,
    run_id: str,
    region: str,
    heartbeat_ttl: float,
    endpoint_url: str | None = None,
    python: str = "python3",
    setup: str = "",
    backstop_s: float | None = None,
    kms_key_id: str | None = None,
    bucket_owner: str | None = None,
    lease: bool = False,
    environment: "Environment | None" = None,
    gang: int = 0,
    node_index: int | None = None,
    packs: list[str] | tuple[str, ...] = (),
    offer_pack: bool = False,
    lifetime_s: float | None = None,
) -> str:
    """The instance's user-data: a short shell script, with no credential and no key in it.

    With an ``environment`` of mode ``"driver"`` the bootstrap runs in that environment, built
    (or reused) on the node by the environment stage (:mod:`prefect_sgpu.launch.node_env`,
    carried compressed in the user-data) from the manifest whose sha256 is written here
    (:mod:`prefect_sgpu.environment.ship`): the image needs only ``python`` (the stage fetches the uv
    it pins when the image has none). Without one,
    or with ``"image"``, ``python`` must import prefect-sgpu itself (the image has everything).

    With ``lease`` the instance belongs to a warm lease (``run_id`` is the lease's id) and
    serves the jobs the lease assigns to it, one after another, instead of one job.

    ``gang``: which gang of the job the instance serves (a relaunch after infrastructure loss is
    gang 1, 2, ...): the job's stop is bound to it, so the node refuses a lost gang's stop written
    back into the store. Only the first gang's user-data goes without it. ``node_index``: the node an
    instance launched alone replaces (its launch index is 0), when only a lost node is replaced.
    ``packs``: the recorded packs of the environment (``environment_ship.recorded_packs``) a node may
    unpack instead of building; ``offer_pack``: node 0, building cold, packs what it built into the store.

    ``setup`` (shell lines, e.g. installing prefect-sgpu into the AMI's Python) runs first.
    The bootstrap derives the SSM parameter of the job key from ``run_id`` itself.

    A backstop powers the instance off (instance-initiated shutdown terminates it) at once
    when ``setup`` fails or the bootstrap ends without having taken over (the image's Python
    cannot import prefect-sgpu, say): the driver sees the instance go within seconds and
    reports its console output. When the bootstrap has not taken over within ``backstop_s``
    seconds (default: the heartbeat TTL) either (setup hung), it powers off too. Once the
    bootstrap runs it marks that it took over, and its own watch (and its own termination on
    any fatal error) applies. Whenever the bootstrap ends, however (its own termination done,
    or killed: SIGKILL, the OOM killer, a crash below Python), the script powers the machine off
    as it exits: the bootstrap never ends while its machine should live on, and with the driver
    gone nothing else would end it.

    The script is written for cloud-init's world (:func:`cloud_init_lines`): it sets HOME, USER and
    LANG when cloud-init left them unset and works in HOME, not in ``/``; with ``lifetime_s`` (a cold
    job's timeout plus :data:`LIFETIME_MARGIN_S`) it schedules ``shutdown -h +N`` at once, so the
    instance powers off (and terminates) when its lifetime ends even if every process of the product
    died; and it installs a per-boot script that powers a rebooted instance off (a reboot ends the
    product's processes and cloud-init does not run user-data again).
    """
    argv = [python, "-m", "prefect_sgpu.launch.bootstrap", "--host=ec2", f"--store={store_uri}", f"--run-id={run_id}",
            f"--region={region}", f"--heartbeat-ttl={heartbeat_ttl:g}"]
    if endpoint_url:
        argv.append(f"--endpoint-url={endpoint_url}")
    if kms_key_id:
        argv.append(f"--store-kms-key={kms_key_id}")
    if bucket_owner:
        argv.append(f"--bucket-owner={bucket_owner}")
    if lease:
        argv.append("--lease")
    if gang:
        argv.append(f"--gang={gang}")
    if node_index is not None:
        argv.append(f"--node-index={int(node_index)}")
    backstop = float(backstop_s or heartbeat_ttl)
    marker = f"${{HOME:-/root}}/.prefect-sgpu-{run_id}.up"
    lines = [
        "#!/bin/bash",
        "# prefect-sgpu node: AWS access comes from the instance profile, the job key from SSM",
        "export PYTHONUNBUFFERED=1",
        *cloud_init_lines(lifetime_s),
        f'marker="{marker}"',
        "# backstop: power off (which terminates this instance) unless the bootstrap takes over in time",
        f'( sleep {backstop:.0f}; [ -e "$marker" ] || shutdown -h now ) </dev/null >/dev/null 2>&1 &',
        "# setup failed or the bootstrap ended (killed, crashed or done): power off now",
        "trap 'shutdown -h now' EXIT",
        "set -euo pipefail",
        *([setup.strip()] if setup.strip() else []),
    ]
    from prefect_sgpu.environment import ship as environment_ship

    if environment_ship.builds_on_node(environment):
        assert environment is not None
        manifest = environment_ship.manifest_sha256(environment)
        stage, runs = environment_ship.stage_lines(python, environment.digest, manifest, store_uri, run_id, region,
                                                   endpoint_url, bucket_owner, packs, offer_pack,
                                                   transport="ec2_stage")
        lines += [*stage, f'{runs} {shlex.join(argv[1:])} --backstop-marker="$marker"']
    else:
        lines.append(shlex.join(argv) + ' --backstop-marker="$marker"')
    text = "\n".join(lines) + "\n"
    if len(text.encode()) > environment_ship.USER_DATA_LIMIT:
        raise SGPUConfigError("setup_commands", f"user-data of {len(text.encode())} bytes",
                              f"at most {environment_ship.USER_DATA_LIMIT} bytes of user-data in all (EC2's limit)")
    return text


def lifetime_minutes(lifetime_s: float) -> int:
    """``shutdown -h +N``'s N for a lifetime of ``lifetime_s`` seconds: whole minutes, rounded up."""
    if not lifetime_s > 0:
        raise SGPUConfigError("timeout", lifetime_s, "a node lifetime of more than 0 seconds")
    return max(1, math.ceil(lifetime_s / 60.0))


def cloud_init_lines(lifetime_s: float | None = None) -> list[str]:
    """The user-data's first lines, for how cloud-init runs it and for what it does not do.

    cloud-init runs a user-data script as root with cwd ``/`` and without HOME, LANG or USER, and a
    minimal PATH (https://github.com/openfaas/faasd/issues/282 "Install scripts fails when executed in a
    VM cloud-init startup script": "env-var HOME, not set"): pip, uv and torch place their caches under
    HOME, so they are set here when unset (HOME from the user's passwd entry: bash's ``~``, as a login
    would), and the script works in HOME so nothing lands in ``/``.

    It runs the script once per instance, never after a reboot (cloud-init docs, "Module reference:
    Scripts user", frequency once-per-instance), while a reboot ends every process of the node: a
    per-boot script (:data:`PER_BOOT_DIR`, run at every later boot) powers a rebooted node off, which
    terminates it, and the driver treats it as any lost node. With ``lifetime_s``: ``shutdown -h +N``
    (shutdown(8): systemd holds the schedule and returns at once), an end that needs no process of
    the product to be alive. A reboot drops the schedule; the per-boot script covers that case.
    """
    # terse: the user-data's room is the environment stage's and setup_commands' (16 KiB in all)
    lines = [
        'export HOME=${HOME:-~} USER=${USER:-$(id -un)} LANG=${LANG:-C.UTF-8};cd "$HOME"||cd /tmp',
        f"b=${{{PER_BOOT_ENV}:-{PER_BOOT_DIR}}}/{PER_BOOT_SCRIPT}",
        """mkdir -p "${b%/*}"&&printf '#!/bin/sh\\nexec shutdown -h now\\n'>"$b"&&chmod 755 "$b"||echo "no $b">&2""",
    ]
    if lifetime_s is not None:
        minutes = lifetime_minutes(lifetime_s)
        lines.append(f"shutdown -h +{minutes}||echo no lifetime>&2")
    return lines


#: what a credential looks like, whoever's it is: found in a launch request, it is refused
CREDENTIAL_PATTERNS = (
    ("an AWS access key id", re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])")),
    ("an AWS secret access key setting", re.compile(r"aws_secret_access_key\s*[=:]", re.IGNORECASE)),
    ("a Prefect API key", re.compile(r"(?<![A-Za-z0-9])pn[ub]_[A-Za-z0-9]{36}(?![A-Za-z0-9])")),
    ("a private key", re.compile(r"-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----")),
)


def refuse_secrets(request: dict[str, Any], secrets: list[tuple[str, str]]) -> None:
    """Fail if the caller's AWS keys or the Prefect API key, or anything shaped like a credential
    (in ``setup_commands``, tags, the user-data), would reach the instances."""
    text = json.dumps(request)
    for name, secret in secrets:
        if len(secret) >= MIN_SECRET_LEN and secret in text:
            raise SGPUConfigError(
                "user_data/tags", "<redacted>",
                f"no credentials: the request contains the {name}; nodes get AWS access from "
                "the instance profile and never need the Prefect API key",
            )
    for name, pattern in CREDENTIAL_PATTERNS:
        if pattern.search(text):
            raise SGPUConfigError(
                "setup_commands/tags", "<redacted>",
                f"no credentials in what instances are launched with: it contains {name}; nodes get AWS "
                "access from the instance profile, and user-data and tags are readable by anyone who can "
                "describe the instance",
            )


def known_secrets(session: Any | None = None) -> list[tuple[str, str]]:
    """The caller's credentials that must never reach a node (read locally: no AWS call)."""
    from botocore.exceptions import BotoCoreError

    found = [
        ("AWS access key id", os.environ.get("AWS_ACCESS_KEY_ID", "")),
        ("AWS secret access key", os.environ.get("AWS_SECRET_ACCESS_KEY", "")),
        ("AWS session token", os.environ.get("AWS_SESSION_TOKEN", "")),
        ("Prefect API key", os.environ.get("PREFECT_API_KEY", "")),
    ]
    try:
        from prefect.settings import PREFECT_API_KEY

        value = PREFECT_API_KEY.value()
        value = value.get_secret_value() if hasattr(value, "get_secret_value") else value
        found.append(("Prefect API key", str(value or "")))
    except Exception:  # prefect settings unavailable: the env var was checked above
        logger.debug("could not read PREFECT_API_KEY from Prefect settings", exc_info=True)
    if session is not None:
        try:
            creds = session.get_credentials()
        except BotoCoreError:  # no usable credentials configured: nothing to leak
            creds = None
        if creds is not None:
            frozen = creds.get_frozen_credentials()
            found += [("AWS access key id", frozen.access_key or ""),
                      ("AWS secret access key", frozen.secret_key or ""),
                      ("AWS session token", frozen.token or "")]
    return found
