"""S3 requests per rank-minute while a job's ranks print a line a second: the cost of watching a job.

Moto stands in for S3 behind the fault proxy, whose request record is the meter. Each rank has a
node bootstrap (the code an EC2 node runs) syncing its rank log every second as it does on a node,
and the driver follows every log with its live log tailer (the thread a running job starts), for
``--seconds`` of real time. Every S3 request in that window is counted: the nodes' PUTs and the
driver's LISTs and GETs. At the end the node logs are sealed and the driver's lines checked complete.

    ./dev bench log_requests [--ranks 2 16] [--seconds 60]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from prefect_sgpu.launch.bootstrap import NodeBootstrap, NodeIdentity  # noqa: E402
from prefect_sgpu.observe.logs import LogTailer  # noqa: E402
from prefect_sgpu.store.s3 import S3Store  # noqa: E402
from support.aws_fixtures import offline_aws  # noqa: E402


def measure(aws, proxy, ranks: int, seconds: float) -> dict[str, float]:
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    aws.client("s3").create_bucket(Bucket=bucket)
    store = S3Store(f"s3://{bucket}/jobs", session=aws.session(), endpoint_url=aws.endpoint_url)
    seen: dict[int, int] = {}
    lock = threading.Lock()

    def sink(rank: int, node: int, text: str) -> None:
        with lock:
            seen[rank] = seen.get(rank, 0) + 1

    with tempfile.TemporaryDirectory() as tmp:
        nodes, files = [], []
        for rank in range(ranks):
            node = NodeBootstrap(store, "run", NodeIdentity(f"i-{rank:017x}", rank, f"10.0.0.{rank + 5}"),
                                 Path(tmp) / f"node{rank}", heartbeat_ttl=60)
            log = Path(tmp) / f"node{rank}" / "run" / "logs" / f"rank-{rank:05d}.log"
            log.parent.mkdir(parents=True)
            nodes.append(node)
            files.append(open(log, "ab"))
        proxy.reset()
        tailer = LogTailer(store, "run", procs_per_node=1, sink=sink).start()
        started = time.monotonic()
        tick = 0
        while time.monotonic() - started < seconds:
            for rank, (node, fh) in enumerate(zip(nodes, files)):
                fh.write(f"rank {rank} step {tick} loss {1.0 / (tick + 1):.4f}\n".encode())
                fh.flush()
                node.sync_up()
            tick += 1
            time.sleep(max(0.0, started + tick - time.monotonic()))
        elapsed = time.monotonic() - started
        counts = proxy.s3_requests()
        tailer._stop.set()
        for node, fh in zip(nodes, files):
            fh.close()
            node.sync_up(final=True)
            node.seal_appended()
        tailer.close()
    rank_minutes = ranks * elapsed / 60
    total = sum(counts.values())
    complete = all(seen.get(r, 0) == tick for r in range(ranks))
    return {"ranks": ranks, "seconds": elapsed, "lines": tick, "complete": complete, "total": total,
            "per_rank_minute": total / rank_minutes,
            **{k: v / rank_minutes for k, v in counts.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 16])
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SGPU_LIVE", "0")
    rows = []
    with offline_aws() as (aws, proxy):
        for ranks in args.ranks:
            rows.append(measure(aws, proxy, ranks, args.seconds))
    import boto3
    import moto

    print(f"# S3 requests while ranks print a line a second, {dt.date.today()} on {platform.node()} "
          f"({os.cpu_count()} cores), Python {sys.version.split()[0]}, boto3 {boto3.__version__}, "
          f"moto {moto.__version__}")
    print("| ranks | seconds | lines/rank | all lines shown | S3 requests | per rank-minute | "
          "LIST | GET | PUT (per rank-minute) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['seconds']:.0f} | {r['lines']} | {r['complete']} | {r['total']} | "
              f"{r['per_rank_minute']:.1f} | {r.get('LIST', 0):.1f} | {r.get('GET', 0):.1f} | {r.get('PUT', 0):.1f} |")


if __name__ == "__main__":
    main()
