"""The one place that builds boto3 clients, and reads AWS error codes.

Every AWS call of prefect-sgpu (the S3 store, EC2 provisioning, SSM, the node
bootstrap) goes through :func:`client`, so they all retry the same way: botocore's
own ``standard``/``adaptive`` retry mode (throttling and 5xx are retried with
backoff, never by hand-written loops) and the same connect/read timeouts. Before
this module the store and the provisioner built clients with different settings,
and a throttled EC2 call gave up sooner than a throttled S3 call.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from prefect_sgpu.errors import SGPUConfigError

RETRY_MODES = ("standard", "adaptive", "legacy")
DEFAULT_RETRY_MODE = "standard"
DEFAULT_MAX_ATTEMPTS = 8
CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 60
USER_AGENT = "prefect-sgpu"


@lru_cache(maxsize=1)
def _data_loader() -> Any:
    """This process's botocore data loader, which keeps every service model it has parsed."""
    import botocore.loaders

    return botocore.loaders.create_loader()


def new_session(region: str | None = None) -> Any:
    """A boto3 session with the environment's credentials that shares this process's botocore
    data loader: a service's model (EC2's is megabytes of JSON) is parsed once per process, not
    once per session (a quarter of a CPU second for EC2, S3 and SSM clients of a new session)."""
    import boto3
    import botocore.session

    core = botocore.session.get_session()
    core.register_component("data_loader", _data_loader())
    return boto3.session.Session(botocore_session=core, region_name=region)


def client(
    service: str,
    session: Any | None = None,
    region: str | None = None,
    endpoint_url: str | None = None,
    retry_mode: str = DEFAULT_RETRY_MODE,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
) -> Any:
    """A boto3 client for ``service`` with botocore's retry mode and bounded timeouts.

    ``session`` defaults to a new :func:`new_session` (the environment's credentials: the
    instance profile on a node); ``endpoint_url`` points it elsewhere (tests, private links).
    """
    from botocore.config import Config

    if retry_mode not in RETRY_MODES:
        raise SGPUConfigError("retry_mode", retry_mode, "one of " + ", ".join(RETRY_MODES))
    config = Config(
        retries={"mode": retry_mode, "max_attempts": max_attempts},
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=READ_TIMEOUT_S,
        user_agent_extra=USER_AGENT,
    )
    session = session or new_session()
    return session.client(service, region_name=region, endpoint_url=endpoint_url or None, config=config)


def error_of(exc: BaseException) -> tuple[str, str]:
    """(AWS error code, message) of a botocore ClientError; ``("", str(exc))`` for anything else."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error", {}) or {}
        return str(err.get("Code", "")), str(err.get("Message", ""))
    return "", str(exc)


def error_code(exc: BaseException) -> str:
    """The AWS error code of ``exc`` (``""`` when it is not an AWS error response)."""
    return error_of(exc)[0]
