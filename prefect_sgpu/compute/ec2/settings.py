"""Validated EC2 provisioning settings: the ``EC2Compute`` block's fields, checked up front.

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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from prefect_sgpu import catalog
from prefect_sgpu.errors import SGPUConfigError

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


def reservation_skipped() -> bool:
    return os.environ.get(SKIP_RESERVATION_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class EC2Settings(BaseModel):
    """How instances are bought, placed and tagged (the ``EC2Compute`` block's fields)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    region: str = "us-east-1"
    subnet_ids: list[str] = Field(default_factory=list)
    security_group_id: str | None = None
    instance_profile: str | None = None
    #: a role and instance profile of its own for every job (prefect_sgpu.compute.ec2.roles)
    job_roles: bool = False
    #: the permissions boundary (policy ARN) every job role is created under
    node_permissions_boundary: str | None = None
    ami_id: str | None = None
    ami_ssm_parameter: str = (
        "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
    )
    instance_types: dict[str, str] = Field(default_factory=dict)
    market: Literal["spot", "on-demand", "reserved"] = "on-demand"
    capacity_reservation_id: str | None = None
    fallback_to_on_demand: bool = False
    volume_size_gb: int = Field(200, ge=8, le=16384)
    ttl_minutes: int = Field(15, ge=1)
    tags: dict[str, str] = Field(default_factory=dict)
    endpoint_url: str | None = None
    owner: str | None = None
    #: botocore retry mode and attempts for every AWS call (throttling, 5xx)
    retry_mode: Literal["standard", "adaptive"] = "standard"
    max_attempts: int = Field(5, ge=1, le=20)
    #: how long to wait for launched instances to reach "running", and how often to look
    running_timeout_s: float = Field(900.0, gt=0)
    waiter_delay_s: float = Field(5.0, gt=0)

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise _config_error(exc) from None

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

    @model_validator(mode="after")
    def _market_needs(self) -> EC2Settings:
        if self.job_roles and self.instance_profile:
            raise SGPUConfigError("instance_profile", self.instance_profile,
                                  "empty when job_roles is set (each job gets a role of its own)")
        if self.market == "reserved" and not self.capacity_reservation_id:
            raise SGPUConfigError(
                "capacity_reservation_id", None, "a capacity reservation id (cr-...) when market='reserved'"
            )
        return self

    # -- derived ------------------------------------------------------------------

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


def _config_error(exc: ValidationError) -> SGPUConfigError:
    err = exc.errors()[0]
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, SGPUConfigError):
        return cause
    field = ".".join(str(p) for p in err.get("loc", ())) or "EC2Settings"
    value = err.get("input")
    if field == "market":
        return SGPUConfigError("market", value, "one of " + ", ".join(MARKETS))
    if err.get("type") == "extra_forbidden":
        return SGPUConfigError(
            field, value, "a field of the EC2Compute block: " + ", ".join(EC2Settings.model_fields)
        )
    return SGPUConfigError(field, value, err.get("msg", "invalid value"))
