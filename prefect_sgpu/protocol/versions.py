"""What a process runs a job's calls with, as far as driver and nodes must agree on it.

Functions, arguments and results travel pickled by value (cloudpickle): code objects load
only on the same Python minor version, and a cloudpickle of another minor version may not read
what this one wrote. The node half speaks this package's store protocol, so both sides run the
same prefect-sgpu; ranks join torch collectives, so torch agrees on major.minor.

Every remote node reports :func:`runtime_versions` in its ``alive`` document; the driver checks
them (:func:`differences`) once every node is up and before any rank starts, and fails the job
with :class:`~prefect_sgpu.errors.EnvironmentMismatch` naming both sides.
"""

from __future__ import annotations

import platform
import sys
from functools import lru_cache

#: what must agree, and on how many leading parts of the version (None: exactly)
MUST_AGREE: dict[str, int | None] = {"python": 2, "prefect-sgpu": None, "cloudpickle": 2, "torch": 2}

_WHY = {
    "python": "pickled functions load only on the same Python minor version",
    "prefect-sgpu": "driver and nodes speak this package's protocol",
    "cloudpickle": "payloads and results are cloudpickled",
    "torch": "ranks join torch collectives and exchange tensors",
}


def distribution_version(name: str) -> str:
    """The installed version of distribution ``name``; "" when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


@lru_cache(maxsize=1)
def runtime_versions() -> dict[str, str]:
    """This interpreter's versions of what must agree ("" where a distribution is not installed).
    Reads package metadata only: nothing heavy is imported."""
    info = sys.version_info
    found = {"python": f"{info.major}.{info.minor}.{info.micro}",
             "python_implementation": platform.python_implementation()}
    for name in MUST_AGREE:
        if name != "python":
            found[name] = distribution_version(name)
    return found


def _leading(version: str, parts: int | None) -> str:
    return version if parts is None else ".".join(version.split("+")[0].split(".")[:parts])


def differences(driver: dict[str, str], node: dict[str, str]) -> list[str]:
    """Each way ``node``'s versions keep it from running ``driver``'s calls, as a sentence; [] when
    they agree. A node that reports nothing runs an older prefect-sgpu than this check."""
    if not node:
        return ["prefect-sgpu: the node reports no versions (an older prefect-sgpu than the driver's "
                f"{driver.get('prefect-sgpu') or 'unknown'})"]
    found = []
    if driver.get("python_implementation") != node.get("python_implementation"):
        found.append(f"Python implementation: {node.get('python_implementation')} on the node, "
                     f"{driver.get('python_implementation')} on the driver")
    for name, parts in MUST_AGREE.items():
        mine, theirs = driver.get(name, ""), node.get(name, "")
        if name == "torch" and not mine:
            continue  # a driver without torch runs nothing of torch itself
        if _leading(mine, parts) != _leading(theirs, parts):
            found.append(f"{name} {theirs or 'not installed'} on the node, {mine or 'not installed'} on "
                         f"the driver ({_WHY[name]})")
    return found
