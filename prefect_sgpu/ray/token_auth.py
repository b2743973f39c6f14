"""The Ray that ``@ray_launch`` needs: one with token authentication (Ray 2.52.0 and later).

Every ``@ray_launch`` cluster runs with ``RAY_AUTH_MODE=token`` and a token derived from the
job key (``prefect_sgpu.ray.node``), so that only the job's own nodes and driver can join it
or submit work. A Ray older than 2.52.0 does not know these variables and runs the cluster
with no authentication at all: whoever reaches the head's port runs code on every node. Such
a Ray is refused twice: by the caller before anything is spent (where Ray is installed
there; a driver of remote nodes may not have it), and by every node before it starts a Ray
process (the nodes' own Ray is the one that serves the cluster).

Imports neither Ray nor Prefect: the version comes from the installed distribution's metadata.
"""

from __future__ import annotations

from importlib import metadata

from prefect_sgpu.errors import SGPUConfigError

#: the first Ray release with token authentication (docs.ray.io, "Ray token authentication")
TOKEN_AUTH_RAY = "2.52.0"


def installed_ray_version() -> str | None:
    """The version of the Ray this interpreter would import, or None when there is none."""
    try:
        return metadata.version("ray")
    except metadata.PackageNotFoundError:
        return None


def require_token_auth(version: str | None) -> None:
    """Refuse a Ray ``version`` without token authentication (None: Ray is not installed)."""
    from packaging.version import InvalidVersion, Version

    try:
        ok = version is not None and Version(version) >= Version(TOKEN_AUTH_RAY)
    except InvalidVersion:
        ok = False
    if not ok:
        raise SGPUConfigError(
            "ray", version or "not installed",
            f"Ray >= {TOKEN_AUTH_RAY}, the first with token authentication, which every @ray_launch "
            "cluster runs with so that only the job's own nodes and driver can use it",
            f"Install ray[default]>={TOKEN_AUTH_RAY} where the nodes run; an older Ray would run the "
            "cluster with no authentication")
