"""What the gang check costs, and how soon it names a broken node.

On the local default (2 nodes x 2 CPU ranks, gloo, warm agents after the first call):

1. the same trivial job ``--runs`` times with ``gang_check`` on and off, alternating: the median
   wall time of each, and the check's own seconds as rank 0 measured them;
2. a job whose node 1 cannot open its network device (``GLOO_SOCKET_IFNAME`` names an interface the
   machine lacks, set for that node only): seconds from the call to ``GangCheckFailed``, with
   each check step allowed 300 s.

    ./dev bench gang_check [--runs 7] [--mib 16]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefect_sgpu import distributed  # noqa: E402
from prefect_sgpu.compute.local import LocalProcessCompute  # noqa: E402
from prefect_sgpu.errors import GangCheckFailed  # noqa: E402


def _rank() -> int:
    from prefect_sgpu import runtime

    return runtime.rank()


class _BrokenNode1(LocalProcessCompute):
    """The local default, with node 1's network device set to one that does not exist."""

    def node_env(self, allocation, node):  # type: ignore[no-untyped-def]
        env = super().node_env(allocation, node)
        return {**env, "GLOO_SOCKET_IFNAME": "sgpu-missing0"} if node == 1 else env


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--mib", type=int, default=16)
    args = parser.parse_args()
    env = {"SGPU_GANG_CHECK_BYTES": str(args.mib << 20)}
    os.environ["PREFECT_SGPU_GANG_CHECK_REUSE_S"] = "0"  # the check's own cost on every job, warm set or not
    print(f"# gang check, {platform.node()} ({os.cpu_count()} cores), {dt.date.today()}: 2 nodes x 2 CPU ranks, "
          f"{args.mib} MiB per link exchange")
    walls: dict[bool, list[float]] = {True: [], False: []}
    checks: list[float] = []
    links: list[float] = []
    distributed(gpus=4, nodes=2, mlflow=False, env=env)(_rank).run()  # warm the agents first
    for _ in range(args.runs):
        for on in (True, False):
            began = time.perf_counter()
            result = distributed(gpus=4, nodes=2, mlflow=False, gang_check=on, env=env)(_rank).run()
            walls[on].append(time.perf_counter() - began)
            if on:
                checks.append(result.gang_check["seconds"])
                links.extend(link["GB/s"] for link in result.gang_check["links"])
    on, off = statistics.median(walls[True]), statistics.median(walls[False])
    print(f"job wall, median of {args.runs}: check on {on:.2f} s, off {off:.2f} s, added {on - off:+.2f} s")
    print(f"the check itself (rank 0): median {statistics.median(checks):.3f} s, "
          f"max {max(checks):.3f} s; link bandwidth median {statistics.median(links):.2f} GB/s")

    began = time.perf_counter()
    try:
        distributed(gpus=4, nodes=2, mlflow=False, compute=_BrokenNode1(keep_warm=0),
                    env={**env, "SGPU_GANG_CHECK_TIMEOUT_S": "300"})(_rank).run()
    except GangCheckFailed as exc:
        print(f"broken node named in {time.perf_counter() - began:.2f} s from the call (step timeout 300 s): "
              f"nodes {exc.nodes}")
    else:
        print("the broken node was not found")


if __name__ == "__main__":
    main()
