"""The one place that builds boto3 clients, and reads AWS error codes.

Every AWS call of prefect-sgpu (the S3 store, EC2 provisioning, SSM, the node
bootstrap) goes through :func:`client`, so they all retry the same way: botocore's
own ``standard``/``adaptive`` retry mode (throttling and 5xx are retried with
backoff, never by hand-written loops) and the same connect/read timeouts. Before
this module the store and the provisioner built clients with different settings,
and a throttled EC2 call gave up sooner than a throttled S3 call.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

from prefect_sgpu.errors import SGPUConfigError

RETRY_MODES = ("standard", "adaptive", "legacy")
DEFAULT_RETRY_MODE = "standard"
DEFAULT_MAX_ATTEMPTS = 8
CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 60
USER_AGENT = "prefect-sgpu"
#: error codes botocore's retry leaves to the caller, per service: EC2 answers "no capacity here" with
#: HTTP 500, which botocore's standard mode retries as a server error (``reached max retries: 4`` in
#: ansible-collections/amazon.aws#1038; aws/aws-sdk-ruby#568). Capacity does not come back in seconds,
#: and the provisioner's own failover (another zone, another market) is what helps.
NOT_RETRIED = {
    "ec2": frozenset({
        "InsufficientInstanceCapacity", "InsufficientCapacity", "InsufficientHostCapacity",
        "InsufficientReservedInstanceCapacity", "InsufficientAddressCapacity",
    }),
}
#: how long botocore waits for the instance metadata service when it reads an instance profile's
#: credentials, and how often it asks: botocore's defaults (1 s, one attempt) fail on a machine whose
#: CPUs a job keeps busy, with ``NoCredentialsError`` at a rank's first S3 call, and a client made then
#: has no credentials for good (boto/botocore#1791, #2117, #2304; aws/aws-cli#2289 points to these
#: settings). A token request that times out is not retried at all (botocore's ``IMDSFetcher``), so the
#: timeout is what counts. Each: (botocore's config name, its environment variable, the value used
#: unless the environment or the profile sets it)
METADATA_PATIENCE = (
    ("metadata_service_timeout", "AWS_METADATA_SERVICE_TIMEOUT", 5),
    ("metadata_service_num_attempts", "AWS_METADATA_SERVICE_NUM_ATTEMPTS", 3),
)


def metadata_patience_env() -> dict[str, str]:
    """:data:`METADATA_PATIENCE` as environment variables (a node sets them for its agent, its ranks and
    the user's own boto3 clients, unless already set)."""
    return {env: str(value) for _name, env, value in METADATA_PATIENCE}


def _patient_metadata(core: Any) -> None:
    """:data:`METADATA_PATIENCE` on botocore session ``core``, where neither the environment nor the
    profile names a value."""
    try:
        scoped = core.get_scoped_config()
    except Exception:  # noqa: BLE001 - a profile botocore cannot read fails later, where it is used
        scoped = {}
    for name, env, value in METADATA_PATIENCE:
        if env not in os.environ and name not in scoped:
            core.set_config_variable(name, value)


@lru_cache(maxsize=1)
def _data_loader() -> Any:
    """This process's botocore data loader, which keeps every service model it has parsed."""
    import botocore.loaders

    return botocore.loaders.create_loader()


def new_session(region: str | None = None) -> Any:
    """A boto3 session with the environment's credentials that shares this process's botocore
    data loader: a service's model (EC2's is megabytes of JSON) is parsed once per process, not
    once per session (a quarter of a CPU second for EC2, S3 and SSM clients of a new session).
    It waits for the instance metadata service as :data:`METADATA_PATIENCE` says."""
    import boto3
    import botocore.session

    core = botocore.session.get_session()
    core.register_component("data_loader", _data_loader())
    _patient_metadata(core)
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
    made = session.client(service, region_name=region, endpoint_url=endpoint_url or None, config=config)
    if service in NOT_RETRIED and retry_mode != "legacy":
        leave_to_caller(made, NOT_RETRIED[service])
    return made


def leave_to_caller(made: Any, codes: frozenset[str]) -> None:
    """botocore's ``standard``/``adaptive`` retry of client ``made``, except for answers with one of
    ``codes``: those reach the caller at once, and take nothing from the client's retry quota
    (a retry botocore merely declined would still have spent its share of it).

    botocore offers no switch for this; its retry handler is registered under the unique id
    ``retry-config-<service>``, which this replaces with a handler that asks a standard one only
    about the other answers."""
    from botocore.retries import standard

    events = made.meta.events
    name = made.meta.service_model.service_id.hyphenize()
    unique_id = f"retry-config-{name}"
    events.unregister(f"needs-retry.{name}", unique_id=unique_id)
    total = made.meta.config.retries.get("total_max_attempts")
    handler = standard.register_retry_handler(made, **({"max_attempts": total} if total else {}))
    events.unregister(f"needs-retry.{name}", unique_id=unique_id)

    def needs_retry(**kwargs: Any) -> Any:
        response = kwargs.get("response")
        parsed = response[1] if isinstance(response, tuple) and len(response) > 1 else None
        if isinstance(parsed, dict) and (parsed.get("Error") or {}).get("Code") in codes:
            return None
        return handler.needs_retry(**kwargs)

    events.register(f"needs-retry.{name}", needs_retry, unique_id=unique_id)


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
