"""Validated EC2 settings: the ``EC2Compute`` block's fields, each default and check written once.

Everything that can be wrong with a configuration (an unknown GPU type in the
overrides, no subnet to launch into, a reservation market without a reservation, a
malformed id) is caught here, before a single AWS call, and reported as an
:class:`~prefect_sgpu.errors.SGPUConfigError` naming the field, the value and what is
allowed.
"""

from __future__ import annotations

import getpass
import os
import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from prefect_sgpu import catalog
from prefect_sgpu.errors import SGPUConfigError
from typing_extensions import Self

MARKETS = ("spot", "on-demand", "reserved")
#: set to 1 to launch on the configured market even when a capacity reservation is set
SKIP_RESERVATION_ENV = "PREFECT_SGPU_SKIP_RESERVATION"
RESERVED_TAG_PREFIXES = ("aws:", "sgpu:")
MAX_USER_TAGS = 43  # AWS allows 50 tags per resource; sgpu adds 6 plus Name

_PATTERNS = {
    "subnet_ids": (r"^subnet-[0-9a-f]{8,17}$", "subnet ids like subnet-0123456789abcdef0"),
    "security_group_id": (
        r"^sg-[0-9a-f]{8,17}$",
        "a security group id like sg-0123456789abcdef0, or empty to create one",
    ),
    "ami_id": (
        r"^ami-[0-9a-f]{8,17}$",
        "an AMI id like ami-0123456789abcdef0, or empty to use ami_ssm_parameter",
    ),
    "capacity_reservation_id": (
        r"^cr-[0-9a-f]{8,17}$",
        "a capacity reservation id like cr-0123456789abcdef0",
    ),
    "region": (r"^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-\d$", "an AWS region name such as us-east-1"),
}
_INSTANCE_TYPE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9]+$")
_SSM_NAME = re.compile(r"^/?[A-Za-z0-9_.\-/]{1,2040}$")
_TAG_TEXT = re.compile(r"^[\w .:/=+\-@]*$", re.UNICODE)


def _check(field: str, value: str) -> str:
    pattern, allowed = _PATTERNS[field]
    if not re.match(pattern, value):
        raise SGPUConfigError(field, value, allowed)
    return value


def check_region(value: str) -> str:
    """``value`` when it is an AWS region name; else SGPUConfigError naming ``region``."""
    return _check("region", value)


def reservation_skipped() -> bool:
    return os.environ.get(SKIP_RESERVATION_ENV, "").strip().lower() in ("1", "true", "yes", "on")


_DLAMI = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"


class EC2ComputeFields(BaseModel):
    """The ``EC2Compute`` block's own fields: each default, description and check written here once.

    The block (:class:`prefect_sgpu.adapters.blocks.EC2Compute`) *is* these fields (it adds the AWS
    credentials and the environment), so a bad value fails where the block is made, as an
    :class:`SGPUConfigError`; :class:`EC2Settings` is these fields and the knobs only code turns.
    Descriptions end with a period and stay as they are: they are the block's schema in the UI
    and in the ``sgpu`` work pool's base job template.
    """

    region: str = Field(default="us-east-1", description="AWS region of the instances.")
    subnet_ids: list[str] = Field(
        default_factory=list, description="Subnets to try in order (one per availability zone) for failover."
    )
    security_group_id: Optional[str] = Field(
        default=None, description="Security group; empty creates one that only admits itself."
    )
    instance_profile: Optional[str] = Field(
        default=None, description="IAM instance profile name that grants the nodes access to the S3 store "
        "(shared by every job; leave empty with job_roles)."
    )
    job_roles: bool = Field(
        default=False, description="Give every job an IAM role and instance profile of its own, created and "
        "deleted with the job: its nodes reach only that job's store folder, key and instances "
        "(policies in prefect_sgpu/policies/). A warm lease gets one for the lease, which reaches the job "
        "it serves only while that job runs.",
    )
    node_permissions_boundary: Optional[str] = Field(
        default=None, description="ARN of the managed policy every job role is created under "
        "(policies/node-boundary.json); the shipped driver policy requires it.",
    )
    ami_id: Optional[str] = Field(default=None, description="AMI to boot; overrides ami_ssm_parameter.")
    ami_ssm_parameter: str = Field(default=_DLAMI, description="SSM parameter naming a Deep Learning AMI.")
    instance_types: dict[str, str] = Field(
        default_factory=dict,
        description="Overrides of the catalog, GPU type to instance type (for example A10 to g5.48xlarge).",
    )
    market: Literal["spot", "on-demand", "reserved"] = Field(
        default="on-demand", description="How instances are bought."
    )
    capacity_reservation_id: Optional[str] = Field(
        default=None, description="An EC2 capacity reservation used by default when set."
    )
    fallback_to_on_demand: bool = Field(
        default=False, description="After spot capacity errors in every subnet, try on-demand."
    )
    placement_group: Literal["auto", "cluster", "none"] = Field(
        default="auto", description=(
            "A cluster placement group for the job's nodes: 'auto' uses one for multi-node jobs of EFA "
            "instance types only (low-latency networking is what it is for, and it raises the odds of "
            "InsufficientInstanceCapacity); 'cluster' always; 'none' never.")
    )
    volume_size_gb: int = Field(default=200, ge=8, le=16384, description="Root volume size in GiB.")
    store_uri: str = Field(default="", description="s3://bucket/prefix the driver and nodes exchange files through.")
    ttl_minutes: int = Field(
        default=15, ge=1, description="Nodes terminate themselves when the driver's heartbeat is older than this."
    )
    tags: dict[str, str] = Field(default_factory=dict, description="Extra tags on every resource.")
    owner: Optional[str] = Field(
        default=None, description="Value of the sgpu:owner tag on every resource; empty uses the local user name."
    )
    python: str = Field(default="python3", description=(
        "Python 3.7+ on the node that runs the environment stage, which builds the job's environment "
        "with uv: the image's own, else the uv wheel the stage pins by sha256, fetched from the environment's "
        "index (docs/environment.md); with environment='image' it must import prefect-sgpu itself."))
    setup_commands: str = Field(
        default="",
        description=(
            "Shell lines the node runs before its bootstrap, for anything the image lacks "
            "(for example: export PREFECT_SGPU_UV_INDEX=https://mirror.internal/simple)."
        ),
    )
    pack_environments: bool = Field(
        default=True, description=(
            "With environment='driver': the first node to install an environment's packages packs them into "
            "the store (.environments/packages-<digest>/, about the size of the venv), and later cold boots of "
            "the same packages unpack them instead of installing from the index (docs/environment.md).")
    )
    agent_timeout_s: float = Field(
        default=900.0, gt=0, description=(
            "Seconds from an instance's 'running' until every node's agent must be up. Left at 900, the "
            "instance family's boot time applies instead: 45 minutes for p5/p5e/p5en/trn2, 30 for "
            "p4d/p4de/trn1, 15 for g5/g6 (prefect_sgpu.compute.ec2.capacity.BOOT_TIMEOUTS_S).")
    )
    reservation_slot_wait_s: float = Field(
        default=600.0, ge=0, description=(
            "Seconds a lost node's replacement inside a capacity reservation or Capacity Block waits for "
            "the lost instance's slot, which EC2 frees minutes after the termination.")
    )
    elastic_seek_s: float = Field(
        default=3600.0, ge=0, description=(
            "Seconds an elastic job (nodes=(min, max)) that started with fewer than max instances keeps "
            "launching the rest in the background (every subnet and market it may use, a few minutes apart "
            "while EC2 has no capacity), at most until the job ends; 0: only its first launch.")
    )
    node_silence_s: float = Field(
        default=120.0, gt=0, description="Seconds a running node may go without reporting before the job fails."
    )
    replace_lost: Literal["nodes", "gang"] = Field(
        default="nodes", description=(
            "After a node is lost or reclaimed: 'nodes' launches one instance per lost node and keeps the "
            "others (their agents start the next gang in place); 'gang' replaces every instance. 'nodes' "
            "falls back to 'gang' when a kept node did not end cleanly or a lone instance cannot be had.")
    )
    rendezvous_port: int = Field(
        default=29400, ge=1024, le=65535, description="Port of the c10d rendezvous on node 0."
    )
    kms_key_id: Optional[str] = Field(
        default=None, description="KMS key of the job key's SSM parameter and of every object written to the "
                                  "store (SSE-KMS; without one, SSE-S3)."
    )
    bucket_owner: Optional[str] = Field(
        default=None, description="12-digit account id that must own the store's bucket (ExpectedBucketOwner "
                                  "on every S3 call); empty skips the check."
    )
    keep_warm: float = Field(
        default=0.0, ge=0,
        description="Seconds a finished job's instances wait (billed) for the next job of the same shape, which "
                    "then starts on them without a boot; 0: every job terminates its instances. A flow's task "
                    "runner ends them when the flow ends. With job_roles the lease has a role of its own that "
                    "reaches each job only while it runs.",
    )
    endpoint_url: Optional[str] = Field(default=None, description="Custom AWS endpoint (tests, private links).")

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise _config_error(exc, type(self)) from None

    @field_validator("region")
    @classmethod
    def _region(cls, value: str) -> str:
        return _check("region", value)

    @field_validator("subnet_ids")
    @classmethod
    def _subnets(cls, value: list[str]) -> list[str]:
        for subnet in value:
            _check("subnet_ids", subnet)
        if len(set(value)) != len(value):
            raise SGPUConfigError("subnet_ids", value, "distinct subnet ids (each is tried once, in order)")
        return value

    @field_validator("security_group_id", "ami_id", "capacity_reservation_id")
    @classmethod
    def _ids(cls, value: str | None, info: Any) -> str | None:
        return _check(info.field_name, value) if value else None

    @field_validator("ami_ssm_parameter")
    @classmethod
    def _ssm(cls, value: str) -> str:
        if not _SSM_NAME.match(value):
            raise SGPUConfigError(
                "ami_ssm_parameter", value, "an SSM parameter name such as /aws/service/deeplearning/..."
            )
        return value

    @field_validator("instance_types")
    @classmethod
    def _overrides(cls, value: dict[str, str]) -> dict[str, str]:
        resolved = {}
        for gpu_type, itype in value.items():
            name = catalog.lookup(gpu_type).name  # unknown GPU type -> SGPUConfigError
            if not _INSTANCE_TYPE.match(itype):
                raise SGPUConfigError(
                    f"instance_types[{gpu_type}]", itype, "an EC2 instance type such as g5.48xlarge"
                )
            known = catalog.instance_type_by_name(itype)
            if known is not None and known not in catalog.CATALOG[name].instance_types:
                raise SGPUConfigError(
                    f"instance_types[{gpu_type}]",
                    itype,
                    f"an instance type carrying {name} GPUs: "
                    + ", ".join(it.name for it in catalog.CATALOG[name].instance_types),
                )
            resolved[name] = itype
        return resolved

    @field_validator("tags")
    @classmethod
    def _tags(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > MAX_USER_TAGS:
            raise SGPUConfigError(
                "tags", f"{len(value)} tags", f"at most {MAX_USER_TAGS} (AWS allows 50 per resource)"
            )
        for key, text in value.items():
            if not key or len(key) > 128 or key.lower().startswith(RESERVED_TAG_PREFIXES) or key == "Name":
                raise SGPUConfigError(
                    "tags",
                    key,
                    "keys of 1-128 characters not starting with aws: or sgpu: and not Name (sgpu sets those)",
                )
            if len(str(text)) > 256 or not _TAG_TEXT.match(key) or not _TAG_TEXT.match(str(text)):
                raise SGPUConfigError(
                    f"tags[{key}]", text, "values of at most 256 letters, digits, spaces and _ . : / = + - @"
                )
        return value

    @field_validator("owner")
    @classmethod
    def _owner(cls, value: str | None) -> str | None:
        if value is not None and (len(value) > 256 or not _TAG_TEXT.match(value)):
            raise SGPUConfigError("owner", value, "a user name of at most 256 tag-safe characters")
        return value

    @field_validator("node_permissions_boundary")
    @classmethod
    def _boundary(cls, value: str | None) -> str | None:
        if value and not re.match(r"^arn:aws[a-z-]*:iam::(\d{12}|aws):policy/.+$", value):
            raise SGPUConfigError("node_permissions_boundary", value,
                                  "the ARN of an IAM managed policy, arn:aws:iam::<account>:policy/<name>")
        return value or None

    @field_validator("bucket_owner")
    @classmethod
    def _bucket_owner(cls, value: str | None) -> str | None:
        owner = (value or "").strip()
        if owner and not (len(owner) == 12 and owner.isdigit()):
            raise SGPUConfigError("bucket_owner", owner, "the 12-digit id of the AWS account that owns the store's "
                                  "bucket, or empty")
        return owner or None

    @field_validator("kms_key_id")
    @classmethod
    def _empty_is_none(cls, value: str | None) -> str | None:
        return value or None

    @field_validator("python")
    @classmethod
    def _empty_is_default(cls, value: str, info: Any) -> str:
        return value or cls.model_fields[info.field_name].default

    @model_validator(mode="after")
    def _fields_agree(self) -> Self:
        unknown = sorted(set(self.model_extra or ()) - {"block_type_slug"})  # the block keeps what it is given
        if unknown:
            raise _unknown_field(unknown[0], (self.model_extra or {})[unknown[0]], type(self))
        if self.job_roles and self.instance_profile:
            raise SGPUConfigError("instance_profile", self.instance_profile,
                                  "empty when job_roles is set (each job gets a role of its own)")
        if self.market == "reserved" and not self.capacity_reservation_id:
            raise SGPUConfigError(
                "capacity_reservation_id", None, "a capacity reservation id (cr-...) when market='reserved'"
            )
        return self


class EC2Settings(EC2ComputeFields):
    """Everything an EC2 compute reads: the block's fields, and knobs only code turns (tests, benchmarks)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: botocore retry mode and attempts for every AWS call (throttling, 5xx)
    retry_mode: Literal["standard", "adaptive"] = "standard"
    max_attempts: int = Field(5, ge=1, le=20)
    #: how long to wait for launched instances to reach "running", and how often to look
    running_timeout_s: float = Field(900.0, gt=0)
    waiter_delay_s: float = Field(5.0, gt=0)
    #: the driver's heartbeat TTL in seconds, instead of ttl_minutes (tests that kill a driver)
    heartbeat_ttl_s: Optional[float] = Field(None, gt=0)
    #: how often the driver looks at the job folder
    poll_interval_s: float = Field(1.0, gt=0)

    @classmethod
    def of(cls, fields: EC2ComputeFields) -> EC2Settings:
        """The settings of a block (or of any object with the block's fields), checked again."""
        return cls.model_validate(fields, from_attributes=True)

    # -- derived ------------------------------------------------------------------

    @property
    def heartbeat_ttl(self) -> float:
        """One TTL for everything that watches the driver: both the bootstrap's and the node agent's."""
        return self.heartbeat_ttl_s or 60.0 * self.ttl_minutes

    def require_store(self) -> str:
        """The store URI, which a compute needs (a sweeper or a dry run of the provisioner may go without)."""
        if not self.store_uri.startswith("s3://"):
            raise SGPUConfigError("store_uri", self.store_uri, "an s3://bucket/prefix both the driver and the "
                                  "instances (through their instance profile) can read and write")
        return self.store_uri

    @property
    def owner_name(self) -> str:
        """The ``sgpu:owner`` tag: the block's owner, else the local user name."""
        if self.owner:
            return self.owner
        try:
            name = getpass.getuser()
        except (KeyError, OSError):  # no passwd entry in some containers
            name = "unknown"
        return re.sub(r"[^\w .:/=+\-@]", "_", name)[:256]

    def markets(self) -> list[str]:
        """Markets to try, in order.

        A configured capacity reservation is used first (it is already paid for) unless
        ``PREFECT_SGPU_SKIP_RESERVATION=1``; then the configured market; on-demand last
        when ``fallback_to_on_demand`` is set.
        """
        if self.capacity_reservation_id and not reservation_skipped():
            first = "reserved"
        elif self.market == "reserved":
            first = "on-demand"
        else:
            first = self.market
        order = [first]
        if first == "reserved" and self.market == "spot":
            order.append("spot")
        if self.fallback_to_on_demand and "on-demand" not in order:
            order.append("on-demand")
        return order

    def require_launchable(self) -> None:
        """Settings that only launching needs (a dry run may go without them)."""
        if not self.subnet_ids:
            raise SGPUConfigError(
                "subnet_ids",
                [],
                "at least one subnet id in the region (one per availability zone for failover)",
            )
        if not self.instance_profile and not self.job_roles:
            raise SGPUConfigError(
                "instance_profile",
                None,
                "an IAM instance profile name or ARN (nodes use it, never keys, to reach the store), "
                "or job_roles=True for a role of each job's own",
            )


def _config_error(exc: ValidationError, model: type[BaseModel]) -> SGPUConfigError:
    """The first error as the field, its value and what is allowed (a check's own error as it is)."""
    err = exc.errors()[0]
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, SGPUConfigError):
        return cause
    field = ".".join(str(p) for p in err.get("loc", ())) or model.__name__
    value = err.get("input")
    if err.get("type") == "extra_forbidden":
        return _unknown_field(field, value, model)
    known = model.model_fields.get(field)
    allowed = "one of " + ", ".join(MARKETS) if field == "market" else err.get("msg", "invalid value")
    return SGPUConfigError(field, value, allowed, known.description if known else None)


def _unknown_field(field: str, value: Any, model: type[BaseModel]) -> SGPUConfigError:
    return SGPUConfigError(field, value, f"a field of {model.__name__}: " + ", ".join(model.model_fields))
