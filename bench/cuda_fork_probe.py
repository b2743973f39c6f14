"""Which module, imported before a fork, leaves CUDA unusable in the forked child.

A warm node imports its preload list and forks each job's agent and ranks from it: if any
import queries CUDA (``torch.cuda.is_available()`` and ``device_count()`` count), torch
refuses CUDA in every forked child ("Cannot re-initialize CUDA in forked subprocess").
This imports the warm node's preload list one module at a time, forking a child after each
that tries CUDA, and prints the first module after which the child fails.

    python bench/cuda_fork_probe.py
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def child_uses_cuda() -> bool:
    pid = os.fork()
    if pid == 0:
        try:
            import torch

            torch.zeros(1, device="cuda")
            os._exit(0)
        except BaseException:  # noqa: BLE001
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def main() -> int:
    from prefect_sgpu.launch.warm_node import PRELOAD

    for name in PRELOAD:
        importlib.import_module(name)
        ok = child_uses_cuda()
        print(f"after importing {name}: a forked child {'can' if ok else 'CANNOT'} use CUDA", flush=True)
        if not ok:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
