"""A simulated node's bytecode cache for the files uv hard-linked into its venv, shared by every node.

Each environment a node builds is a venv of its own (one per digest: every change to the shipped
files is a new one), and uv hard-links each package's files into it from its cache. Python keeps a
module's bytecode beside its source, so the first process to import torch in each new venv compiled
all of it again (about 4 CPU seconds for what a node agent imports). A hard link is the same file:
this hook keys the bytecode of a source file with more than one link by its device, inode, size and
modification time, in one folder for the machine (``SGPU_TEST_NODE_PYCACHE``), so a file compiled in
one venv is not compiled again in the next. Python still checks each cached file against its source
(size and modification time) before using it. Files with one link (the shipped files, the image's
own) keep their ``__pycache__``.

The simulator (``support.ec2_simulator``) puts this folder first on a node's ``PYTHONPATH``. Only one
``sitecustomize`` runs per process: when the node's clock is scaled, this one runs
``support/node_clock``'s too (found on ``sys.path``).
"""

from __future__ import annotations

import importlib.util
import os
import sys

PYCACHE_ENV = "SGPU_TEST_NODE_PYCACHE"


def _install(root: str) -> None:
    from importlib import _bootstrap_external as external

    original = external.cache_from_source

    def cache_from_source(path, debug_override=None, *, optimization=None):  # type: ignore[no-untyped-def]
        cached = original(path, debug_override, optimization=optimization)
        try:
            st = os.stat(path)
        except OSError:
            return cached
        if st.st_nlink < 2:
            return cached
        key = f"{st.st_dev:x}-{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"
        return os.path.join(root, key[-2:], key, os.path.basename(cached))

    external.cache_from_source = cache_from_source


def _chain_node_clock() -> None:
    """Run ``support/node_clock``'s sitecustomize when it is on the path (this one shadows it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(entry, "sitecustomize.py")
        if entry and os.path.abspath(entry) != here and os.path.basename(entry) == "node_clock" \
                and os.path.exists(candidate):
            spec = importlib.util.spec_from_file_location("_sgpu_node_clock_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if os.environ.get(PYCACHE_ENV) and not sys.flags.dont_write_bytecode:
    _install(os.environ[PYCACHE_ENV])
_chain_node_clock()
