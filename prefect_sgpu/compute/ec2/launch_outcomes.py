"""What a launch's answer means: IAM not caught up yet, a quota, or instances that died pending.

- **An instance profile IAM has not propagated** (IAM is eventually consistent: seconds, at times
  minutes): RunInstances answers ``InvalidParameterValue`` naming ``iamInstanceProfile``, or
  ``UnauthorizedOperation`` for ``iam:PassRole`` on the role just made. For a profile the driver made
  for the job (``job_roles``) that is waited out (:data:`PROFILE_PROPAGATION_S`) in the same subnet:
  another zone would wait for the same IAM. For a profile the settings name, it is a setting to fix.
- **Quotas are regional**: ``VcpuLimitExceeded`` and ``MaxSpotInstanceCountExceeded`` say the same
  in every zone of a market; the launch moves on to another market, never to another zone.
- **An accepted launch can still die pending**: EC2 ends the instances with a state reason. A capacity
  reason (``Server.InsufficientInstanceCapacity``, ``Server.Spot*``) is what an
  ``InsufficientInstanceCapacity`` at launch would have said, and fails over the same way;
  ``Client.InternalError`` is almost always an encrypted EBS volume whose KMS key the launching
  principal cannot use (AWS: "Troubleshoot Amazon EC2 instance launch issues: Instance terminates
  immediately"), which no other zone fixes.
"""

from __future__ import annotations

from typing import Any

from prefect_sgpu.aws import error_of
from prefect_sgpu.errors import ProvisioningError

#: how long a launch waits for EC2 to see a job's new instance profile (IAM: seconds, at times minutes)
PROFILE_PROPAGATION_S = 180.0
#: error codes of a regional quota: the other zones of the market count against the same one
QUOTA_ERRORS = frozenset({"VcpuLimitExceeded", "MaxSpotInstanceCountExceeded"})
#: state reasons of instances EC2 ended while pending for want of capacity (spot: reclaimed at once)
CAPACITY_STATE_REASONS = frozenset({"Server.InsufficientInstanceCapacity"})
CAPACITY_STATE_PREFIXES = ("Server.Spot",)
#: the state reason of an instance ended while pending by an EBS volume it could not decrypt or encrypt
KMS_STATE_REASON = "Client.InternalError"


def profile_not_visible(exc: BaseException) -> bool:
    """Whether a RunInstances error says EC2 or IAM does not see an instance profile or its role yet."""
    code, message = error_of(exc)
    text = message.lower()
    if code == "InvalidParameterValue":
        return "iaminstanceprofile" in text
    return code in ("UnauthorizedOperation", "AccessDenied") and "iam:passrole" in text


def is_capacity_reason(code: str) -> bool:
    return code in CAPACITY_STATE_REASONS or code.startswith(CAPACITY_STATE_PREFIXES)


class DiedPending(ProvisioningError):
    """EC2 accepted the launch, then ended instances of it before they ran.

    ``reasons``: instance id -> (state, state reason code, state reason message) of every instance of
    the launch that did not come up. ``capacity``: whether the reasons are all "no capacity" ones
    (another zone or market may have room)."""

    def __init__(self, run_id: str, reasons: dict[str, tuple[str, str, str]], hint: str = "") -> None:
        self.run_id = run_id
        self.reasons = reasons
        listed = ", ".join(f"{i}: {state} ({code or 'no reason given'}{': ' + msg if msg else ''})"
                           for i, (state, code, msg) in sorted(reasons.items())) or "EC2 gave no states"
        super().__init__(f"run {run_id}: instances ended before running: {listed}" + (f". {hint}" if hint else ""))

    @property
    def codes(self) -> list[str]:
        return sorted({code for _, code, _ in self.reasons.values()})

    @property
    def capacity(self) -> bool:
        return bool(self.reasons) and all(is_capacity_reason(code) for _, code, _ in self.reasons.values())

    @property
    def message(self) -> str:
        return "; ".join(sorted({msg or code for _, code, msg in self.reasons.values()}))


def kms_hint(region: str, image_id: str, image: dict[str, Any] | None, request: dict[str, Any]) -> str:
    """What to check when instances die pending with ``Client.InternalError``: the KMS keys of the
    volumes the launch makes (the request's own, the account's default EBS key, the AMI's snapshots)."""
    keys = sorted({m["Ebs"]["KmsKeyId"] for m in request.get("BlockDeviceMappings", [])
                   if m.get("Ebs", {}).get("KmsKeyId")})
    snapshots = sorted({m["Ebs"]["SnapshotId"] for m in (image or {}).get("BlockDeviceMappings", [])
                        if m.get("Ebs", {}).get("SnapshotId")})
    where = (f"KMS key {', '.join(keys)}" if keys else
             f"the account's default EBS encryption key in {region} (`aws ec2 get-ebs-default-kms-key-id "
             f"--region {region}`; aws/ebs unless changed)")
    return (f"{KMS_STATE_REASON} while pending is almost always an encrypted EBS volume whose KMS key the "
            f"launching principal cannot use: the root volume is encrypted with {where}"
            + (f", and AMI {image_id} is made from snapshot(s) {', '.join(snapshots)} (their key too)"
               if snapshots else "")
            + ". Check that the key is enabled and that its key policy (or a grant) lets the identity that "
            "launches, through EC2 (kms:ViaService ec2." + region + ".amazonaws.com), use kms:CreateGrant, "
            "kms:Decrypt, kms:DescribeKey, kms:GenerateDataKeyWithoutPlaintext and kms:ReEncrypt*. "
            "Not retried: every zone uses the same key")


def quota_message(code: str, message: str, quota: str, nodes: int, instance_type: str, region: str) -> str:
    """The error of a launch over a regional quota, naming the quota to raise."""
    what = "more spot instances" if code == "MaxSpotInstanceCountExceeded" else "more vCPUs"
    return (f"{message} {nodes} x {instance_type} needs {what} than the {quota} in {region} leaves: "
            "raise it in Service Quotas")
