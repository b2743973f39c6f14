"""The EC2 node host: what the node bootstrap asks of EC2 (:mod:`prefect_sgpu.launch.node_host`).

- **Identity** from IMDSv2 (:mod:`prefect_sgpu.launch.ec2_stage`'s reader, the environment stage's
  too): the instance id, the AMI launch index (the node's index in its gang) and the private IPv4
  address. ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` points it elsewhere, as botocore honours it.
- **Secrets** are SSM SecureStrings, read and deleted with the instance profile's rights. While IMDS
  serves no credentials yet (an instance profile propagates for up to ~2 minutes after launch) or the
  role's new policy is not in effect yet (a job role), the request is retried with
  :func:`prefect_sgpu.retry.retrying` for :data:`~prefect_sgpu.launch.ec2_stage.CLOUD_BUDGET_S`; a client
  built before there were credentials is built again (botocore resolves them once, when a client is made).
- **Reclaim notices**: IMDS's ``spot/instance-action`` (a spot interruption: the instance is
  stopped or terminated at the time it names), 404 until there is one.
- **Rebalance recommendations**: IMDS's ``events/recommendations/rebalance``, 404 until there is one.
  A recommendation is a warning, not a notice: it may come minutes to hours before an
  ``instance-action``, or with none ever following (AWS docs, "EC2 instance rebalance
  recommendations", https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/rebalance-recommendations.html),
  so it is served apart and never read as a reclaim.
- **Credentials' patience**: the host sets botocore's instance-metadata timeout and attempts
  (:data:`prefect_sgpu.aws.METADATA_PATIENCE`) in this process's environment where they are unset, so
  the agent, the ranks and the user's own boto3 clients inherit them: a busy machine answers IMDS
  late, and botocore's defaults (1 s, one attempt) then find no credentials.
- **Termination**: ``ec2:TerminateInstances`` on itself; the last resort is ``shutdown -h
  now`` (the instance is launched with shutdown behaviour "terminate").
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

from prefect_sgpu import aws, retry
from prefect_sgpu.launch.ec2_stage import IMDS_ENV, imds_base, imds_get, imds_token  # noqa: F401 - IMDS_ENV: its name
from prefect_sgpu.launch.ec2_stage import CLOUD_BUDGET_S, DENIED, EXPIRED, ROLE_PROPAGATION_S
from prefect_sgpu.launch.node_host import NodeIdentity
from prefect_sgpu.procs.processes import node_log as _log

#: what IMDS says when the cloud will take the instance away, and how to say it to people
NOTICE_PATHS = (("spot/instance-action", "spot interruption"),)
#: what IMDS says when the cloud recommends moving work off the instance (no reclaim yet, maybe never)
REBALANCE_PATH = ("events/recommendations/rebalance", "rebalance recommendation")


class NoticeWatch:
    """Reads IMDS for a reclaim notice and a rebalance recommendation (each 404 until there is one),
    at most every ``every`` seconds; :attr:`reclaim` and :attr:`rebalance` hold what was read (a
    rebalance is never taken for a reclaim)."""

    def __init__(self, every: float = 2.0, timeout: float = 1.0) -> None:
        self.every = every
        self.timeout = timeout
        self._token: str | None = None
        self._checked: float | None = None
        self.reclaim: str | None = None
        self.rebalance: str | None = None

    def check(self) -> str | None:
        """The reclaim notice, once there is one (IMDS read again when ``every`` has passed); the
        rebalance recommendation read on the same pass is kept in :attr:`rebalance`."""
        import urllib.error

        now = time.monotonic()
        if self.reclaim is not None or (self._checked is not None and now - self._checked < self.every):
            return self.reclaim
        self._checked = now
        try:
            if self._token is None:
                self._token = imds_token((self.timeout,))
            for path, what in (*NOTICE_PATHS, *([REBALANCE_PATH] if self.rebalance is None else [])):
                try:
                    text = f"{what}: {imds_get(path, self._token, (self.timeout,))}"
                except urllib.error.HTTPError as exc:
                    if exc.code == 401:
                        self._token = None
                    elif exc.code != 404:
                        raise
                    continue
                if (path, what) == REBALANCE_PATH:
                    self.rebalance = text
                else:
                    self.reclaim = text
                    break
        except (OSError, ValueError):
            pass  # the metadata service is unreachable for a moment: ask again next time
        return self.reclaim


def fetch_identity(attempts: int = 30, timeout: float = 2.0) -> NodeIdentity:
    """Instance id, launch index and private IP from IMDSv2 (token PUT, then GETs)."""
    last: Exception | None = None
    for attempt in range(attempts):
        try:
            token = imds_token((timeout,))
            return NodeIdentity(
                instance_id=imds_get("instance-id", token, (timeout,)),
                launch_index=int(imds_get("ami-launch-index", token, (timeout,))),
                private_ip=imds_get("local-ipv4", token, (timeout,)),
            )
        except (OSError, ValueError) as exc:  # the metadata service may lag right after boot
            last = exc
            time.sleep(min(0.2 * (attempt + 1), 2.0))
    raise RuntimeError(f"instance metadata service at {imds_base()} did not answer: {last}")


class EC2NodeHost:
    """An EC2 instance as its bootstrap sees it (see :mod:`prefect_sgpu.launch.node_host`)."""

    def __init__(self, region: str | None = None, endpoint_url: str | None = None,
                 notice_every_s: float = 2.0) -> None:
        for name, value in aws.metadata_patience_env().items():
            os.environ.setdefault(name, value)
        self.region = region
        self.endpoint_url = endpoint_url
        self._clients: dict[str, Any] = {}
        self._notices = NoticeWatch(every=notice_every_s)
        self._born = retry.CLOCK.monotonic()

    def _client(self, service: str) -> Any:
        if service not in self._clients:
            self._clients[service] = aws.client(service, region=self.region, endpoint_url=self.endpoint_url)
        return self._clients[service]

    def _calling(self, service: str, operation: str, **params: Any) -> Any:
        """``operation`` of ``service``, waiting out credentials IMDS does not serve yet (the client is built
        again: botocore resolved none when it was made), expired ones, and a refusal while this node is
        younger than :data:`~prefect_sgpu.launch.ec2_stage.ROLE_PROPAGATION_S` (a job role's policy)."""

        def once() -> Any:
            try:
                return getattr(self._client(service), operation)(**params)
            except Exception as exc:
                if _no_credentials(exc) or aws.error_code(exc) in EXPIRED:
                    self._clients.pop(service, None)
                raise

        def transient(exc: BaseException) -> bool:
            if _no_credentials(exc) or aws.error_code(exc) in EXPIRED:
                return True
            young = retry.CLOCK.monotonic() - self._born < ROLE_PROPAGATION_S
            return young and aws.error_code(exc) in DENIED

        return retry.retrying(once, transient=transient, budget_s=CLOUD_BUDGET_S, base_s=1.0, cap_s=20.0,
                              what=f"{service}:{operation}", log=_log)

    def identity(self) -> NodeIdentity:
        return fetch_identity()

    def read_secret(self, name: str) -> str:
        response = self._calling("ssm", "get_parameter", Name=name, WithDecryption=True)
        return str(response["Parameter"]["Value"])

    def delete_secret(self, name: str) -> None:
        self._calling("ssm", "delete_parameter", Name=name)

    def reclaim_notice(self) -> str | None:
        return self._notices.check()

    def rebalance_notice(self) -> str | None:
        self._notices.check()
        return self._notices.rebalance

    def terminate(self, identity: NodeIdentity) -> None:
        self._client("ec2").terminate_instances(InstanceIds=[identity.instance_id])

    def power_off(self, reason: str) -> int:
        """The last resort when the API cannot terminate this instance: shut the machine down
        (the instance is launched with shutdown behaviour "terminate")."""
        _log(f"{reason}: powering off")
        try:
            subprocess.run(["shutdown", "-h", "now"], check=False, timeout=60)
        except (OSError, subprocess.SubprocessError) as exc:
            _log(f"shutdown failed: {exc}")
        return 2

    def error_text(self, exc: BaseException) -> str:
        return aws.error_code(exc) or type(exc).__name__


def _no_credentials(exc: BaseException) -> bool:
    """botocore found no credentials (IMDS served none yet) or could not read them."""
    return type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError")
