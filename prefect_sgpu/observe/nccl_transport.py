"""Which transport NCCL chose, how fast an all-reduce ran on it, and whether the CUDA stack fits the driver.

The gang check (:mod:`prefect_sgpu.observe.gang_check`) runs its own NCCL collective with NCCL's INFO log
in a file of its own, and on an EFA instance type asks this module three things:

- :func:`transport_from_log`: the network NCCL's INFO lines say it uses. With the aws-ofi-nccl plugin
  loaded they say ``NET/Plugin: Loaded net plugin Libfabric`` (older plugins: ``AWS Libfabric``),
  ``NET/OFI Selected provider is efa`` and ``Using network Libfabric`` / ``Using network AWS Libfabric``,
  and the inter-node channels run ``via NET/Libfabric/...``; when NCCL falls back to TCP it says
  ``Using network Socket`` and its channels run ``via NET/Socket/...`` (the line formats of NCCL's
  ``src/init.cc`` / ``src/transport/net.cc`` and of aws-ofi-nccl's ``nccl_ofi_net.cpp``).
- :func:`bus_bandwidth`: nccl-tests' bus bandwidth of an all-reduce, ``algbw * 2 (n - 1) / n`` with
  ``algbw = bytes / seconds`` (nccl-tests' ``doc/PERFORMANCE.md``), comparable across gang sizes and
  with published tables.
- :func:`verdict`: the failure message for a Socket transport or a bus bandwidth under the instance
  family's floor (``SGPU_EFA_MIN_BUS_GBPS``; the launch sets it from the family's table, the job's own
  ``env`` wins, ``0`` turns the floor off; ``SGPU_EFA_REQUIRED=0`` turns the whole EFA check off).

:func:`cuda_findings` compares the CUDA version torch's wheel was built for with the one the driver
supports (``cuDriverGetVersion``): a driver of an older major version cannot run the wheel at all
(CUDA's "CUDA Compatibility" guide: minor-version compatibility holds within a major version only).

Standard library only: the gang check imports torch itself.
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path
from typing import Iterable, Mapping

#: set by the launch on EFA instance types (the table in ``compute/ec2/efa.py``)
EFA_ENV = "SGPU_EFA"
EFA_RDMA_ENV = "SGPU_EFA_RDMA"
INSTANCE_TYPE_ENV = "SGPU_INSTANCE_TYPE"
FLOOR_ENV = "SGPU_EFA_MIN_BUS_GBPS"
#: "0": no transport or bandwidth check on an EFA type (an image without EFA's libraries, knowingly)
REQUIRED_ENV = "SGPU_EFA_REQUIRED"
#: bytes of the check's timed all-reduce: large enough that TCP's ~8 GB/s and EFA's tens of GB/s differ ten-fold
BUS_BYTES_ENV = "SGPU_GANG_CHECK_BUS_BYTES"
DEFAULT_BUS_BYTES = 256 * 1024 * 1024

_EFA = (re.compile(r"NET/OFI Selected [Pp]rovider is efa"), re.compile(r"Using network (AWS )?Libfabric"),
        re.compile(r"via NET/(AWS )?Libfabric"))
_SOCKET = (re.compile(r"Using network Socket"), re.compile(r"via NET/Socket"))
_IB = (re.compile(r"Using network IB"), re.compile(r"via NET/IB"))


def transport_from_log(lines: Iterable[str]) -> tuple[str | None, list[str]]:
    """``("socket" | "efa" | "ib" | None, the lines that say so)``. Socket wins: one inter-node channel
    over TCP is enough to hold every collective to its speed."""
    found: dict[str, list[str]] = {"socket": [], "efa": [], "ib": []}
    for line in lines:
        if "NCCL" not in line and "NET/" not in line:
            continue
        for name, patterns in (("socket", _SOCKET), ("efa", _EFA), ("ib", _IB)):
            if any(p.search(line) for p in patterns):
                found[name].append(line.strip())
    for name in ("socket", "efa", "ib"):
        if found[name]:
            return name, found[name][:3]
    return None, []


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    """nccl-tests' all-reduce bus bandwidth in GB/s (1e9 bytes)."""
    if seconds <= 0 or world < 1:
        raise ValueError(f"seconds={seconds!r}, world={world!r}: a positive time and at least one rank")
    algbw = nbytes / seconds / 1e9
    return algbw * 2 * (world - 1) / world


def floor_from(value: str | None) -> float | None:
    """The floor a rank's environment gives: None where none is set or it is ``0``."""
    if value is None or not value.strip():
        return None
    try:
        floor = float(value)
    except ValueError:
        raise ValueError(f"{FLOOR_ENV}={value!r}: a number of GB/s, or 0 for no floor") from None
    if floor < 0:
        raise ValueError(f"{FLOOR_ENV}={value!r}: a number of GB/s >= 0 (0: no floor)")
    return floor or None


def verdict(instance_type: str, transport: str | None, evidence: list[str], bus_gbps: float | None,
            floor_gbps: float | None, nbytes: int) -> str | None:
    """Why the gang must not run on this EFA instance type, or None."""
    where = instance_type or "an EFA instance type"
    if transport == "socket":
        return (f"NCCL uses TCP sockets, not EFA, on {where} ({evidence[0] if evidence else 'Using network Socket'}): "
                "the aws-ofi-nccl plugin was not loaded or found no EFA device (is the image's EFA software "
                "installed, and are the EFA interfaces attached?); set SGPU_EFA_REQUIRED=0 to run anyway")
    if floor_gbps is not None and bus_gbps is not None and bus_gbps < floor_gbps:
        seen = f"over {transport}" if transport else "(NCCL's log did not name its transport)"
        return (f"all-reduce of {nbytes / 2**20:g} MiB reached {bus_gbps:.1f} GB/s bus bandwidth {seen} on {where}, "
                f"under the floor of {floor_gbps:g} GB/s for this instance family; set {FLOOR_ENV}=0 in the "
                "job's env to turn the floor off")
    return None


def _version(text: str | None) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def cuda_findings(available: bool, wheel_cuda: str | None, driver_cuda: int | None) -> tuple[list[str], list[str]]:
    """``(faults, warnings)`` about torch's CUDA on this node. ``wheel_cuda``: ``torch.version.cuda``
    (``"12.4"``, None for a CPU wheel); ``driver_cuda``: the driver's ``cuDriverGetVersion`` (12020 is
    12.2; None where no driver library loads)."""
    wheel = _version(wheel_cuda)
    driver = (driver_cuda // 1000, driver_cuda % 1000 // 10) if driver_cuda else None
    said = (f"torch is built for CUDA {wheel_cuda or 'none (a CPU wheel)'}, the driver supports "
            + (f"CUDA {driver[0]}.{driver[1]}" if driver else "no CUDA (no libcuda.so.1 loads)"))
    faults: list[str] = []
    warnings: list[str] = []
    if wheel is None:
        faults.append(f"CUDA is not available to torch: {said}; install a CUDA build of torch")
    elif driver is None:
        faults.append(f"CUDA is not available to torch: {said}; is the NVIDIA driver installed?")
    elif wheel[0] > driver[0]:
        faults.append(f"CUDA is not available to torch: {said}; CUDA {wheel[0]} needs a driver for CUDA "
                      f"{wheel[0]}.x: upgrade the driver or install torch built for CUDA {driver[0]}")
    elif not available:
        faults.append(f"CUDA is not available to torch ({said}): no usable GPU is visible to this rank")
    elif wheel > driver:
        warnings.append(f"{said}: it runs under CUDA's minor-version compatibility, without features "
                        "that need the newer driver (PTX of the newer version does not load)")
    return faults, warnings


def driver_cuda_version() -> int | None:
    """The CUDA version the installed driver supports (``cuDriverGetVersion``), None without a driver."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
        return version.value or None
    except (OSError, AttributeError):
        return None


def debug_env(environ: Mapping[str, str], log_file: Path) -> dict[str, str]:
    """``NCCL_DEBUG=INFO`` (init and network lines) into ``log_file``, for the gang check's own process
    group; nothing where the job set ``NCCL_DEBUG`` itself. NCCL reads these once per process, at its
    first communicator: later communicators' init lines go to the same file, not to the rank's log."""
    if "NCCL_DEBUG" in environ:
        return {}
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": environ.get("NCCL_DEBUG_SUBSYS", "INIT,NET"),
            "NCCL_DEBUG_FILE": str(log_file)}


def set_env(values: Mapping[str, str]) -> dict[str, str | None]:
    """Set ``values`` in this process's environment; what each name held before (None: unset)."""
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    return previous


def restore_env(previous: Mapping[str, str | None]) -> None:
    """The environment variables as :func:`set_env` found them."""
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
