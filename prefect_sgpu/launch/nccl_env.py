"""NCCL's environment on nodes with EFA: what makes NCCL use EFA instead of falling back to TCP sockets.

A node of an EFA instance type gets ``SGPU_EFA=1`` (and ``SGPU_EFA_RDMA``) from the launch
(``compute/ec2/efa.py``). Nothing else tells NCCL about EFA: without the aws-ofi-nccl plugin loaded
NCCL runs over its own TCP sockets, about a tenth of EFA's bandwidth, and says so only at INFO level.
Every value below is set only where the rank's environment has none (the job's ``env=`` and the
image's own settings win):

- ``FI_PROVIDER=efa``: libfabric uses the EFA provider only (AWS "Get started with EFA and NCCL").
- ``FI_EFA_USE_DEVICE_RDMA=1`` where the family supports RDMA (p4d, p5, trn: ``SGPU_EFA_RDMA=1``).
- ``NCCL_NET_PLUGIN``: the aws-ofi-nccl plugin where the image installs it (``/opt/amazon/ofi-nccl/lib``
  on current Deep Learning AMIs, ``/opt/aws-ofi-nccl/lib`` on older ones), named as the installed NCCL
  loads it (:func:`plugin_setting`). The rule, from NCCL's plugin loader (``src/plugin/net.cc``; before
  2.19 ``ncclNetPluginInit`` in ``src/net.cc``) and its ``ext-net/README.md``: NCCL 2.19 and later try
  ``NCCL_NET_PLUGIN`` as a library name or path as given, then ``libnccl-net-<value>.so``; older NCCL
  only ever opens ``libnccl-net-<value>.so`` (or ``libnccl-net.so`` without the variable) through the
  dynamic loader's search path. So with NCCL >= 2.19 the value is the plugin's absolute path
  (``libnccl-net-ofi.so``, else ``libnccl-net.so``), found whatever the loader's path; with older NCCL
  it is ``ofi`` where only ``libnccl-net-ofi.so`` exists, else unset, and the plugin's folder must be
  on ``LD_LIBRARY_PATH`` when the process starts (:func:`agent_env` puts it there for the node agent,
  whose ranks inherit it): the loader reads that variable once, at start.

``NCCL_DEBUG=INFO`` is set by the gang check for its own collective only
(:func:`prefect_sgpu.observe.nccl_transport.debug_env`).
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

from prefect_sgpu.observe.nccl_transport import EFA_ENV, EFA_RDMA_ENV

#: where Deep Learning AMIs install aws-ofi-nccl, newest layout first
PLUGIN_DIRS = ("/opt/amazon/ofi-nccl/lib", "/opt/aws-ofi-nccl/lib")
#: the first NCCL that takes NCCL_NET_PLUGIN as a library name or path as given
PATH_NAMES_SINCE = (2, 19)
#: the plugin's file names: the named one aws-ofi-nccl installs, the default name NCCL looks for
NAMED_PLUGIN, DEFAULT_PLUGIN = "libnccl-net-ofi.so", "libnccl-net.so"


def plugin_dir(exists: Callable[[str], bool] = os.path.exists, dirs: tuple[str, ...] | None = None) -> str | None:
    """The first folder that holds an aws-ofi-nccl plugin, else None."""
    for folder in PLUGIN_DIRS if dirs is None else dirs:
        if exists(os.path.join(folder, NAMED_PLUGIN)) or exists(os.path.join(folder, DEFAULT_PLUGIN)):
            return folder
    return None


def plugin_setting(folder: str, nccl_version: tuple[int, ...] | None,
                   exists: Callable[[str], bool] = os.path.exists) -> str | None:
    """``NCCL_NET_PLUGIN`` for the plugin in ``folder`` under this NCCL (None: leave it unset)."""
    named, default = os.path.join(folder, NAMED_PLUGIN), os.path.join(folder, DEFAULT_PLUGIN)
    if nccl_version is not None and tuple(nccl_version[:2]) >= PATH_NAMES_SINCE:
        return named if exists(named) else default if exists(default) else None
    if exists(default):
        return None  # older NCCL opens libnccl-net.so by default (found through LD_LIBRARY_PATH)
    return "ofi" if exists(named) else None


def rank_env(environ: Mapping[str, str], nccl_version: tuple[int, ...] | None,
             exists: Callable[[str], bool] = os.path.exists, dirs: tuple[str, ...] | None = None) -> dict[str, str]:
    """What a rank on an EFA node sets, leaving every variable the environment already has alone."""
    if environ.get(EFA_ENV) != "1":
        return {}
    wanted = {"FI_PROVIDER": "efa"}
    if environ.get(EFA_RDMA_ENV) == "1":
        wanted["FI_EFA_USE_DEVICE_RDMA"] = "1"
    folder = plugin_dir(exists, dirs)
    if folder is not None:
        plugin = plugin_setting(folder, nccl_version, exists)
        if plugin:
            wanted["NCCL_NET_PLUGIN"] = plugin
    return {name: value for name, value in wanted.items() if name not in environ}


def agent_env(environ: Mapping[str, str], exists: Callable[[str], bool] = os.path.exists,
              dirs: tuple[str, ...] | None = None) -> dict[str, str]:
    """``LD_LIBRARY_PATH`` for a node agent on an EFA node: the plugin's folder first (older NCCL opens
    the plugin by name only), the agent's existing path after it; nothing where it is there already."""
    if environ.get(EFA_ENV) != "1":
        return {}
    folder = plugin_dir(exists, dirs)
    current = environ.get("LD_LIBRARY_PATH", "")
    if folder is None or folder in current.split(":"):
        return {}
    return {"LD_LIBRARY_PATH": f"{folder}:{current}" if current else folder}


def nccl_version() -> tuple[int, ...] | None:
    """The NCCL version torch reports (``torch.cuda.nccl.version()``), None without CUDA torch."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - no NCCL to ask: the plugin is left to NCCL's default lookup
        return None
    if isinstance(version, int):  # older torch: NCCL's version code, major * 10000 + minor * 100 + patch
        return (version // 10000, version // 100 % 100, version % 100)
    return tuple(int(part) for part in version) if isinstance(version, tuple) else None


def apply(environ: "os._Environ[str] | dict[str, str]" = os.environ) -> dict[str, str]:
    """Set NCCL's EFA environment in this rank (before any NCCL communicator exists); what was set."""
    if environ.get(EFA_ENV) != "1":
        return {}
    values = rank_env(environ, nccl_version())
    environ.update(values)
    return values

