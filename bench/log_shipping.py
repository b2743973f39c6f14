"""Bytes a node ships to the S3 store for a growing rank log, against the log's size.

A moto server on 127.0.0.1 stands in for S3; a node bootstrap (the code an EC2 node runs)
syncs a rank log that grows by ``--line-kb`` KB between syncs until it reaches ``--mb`` MB,
then seals it as at the end of a job. Bytes are counted where the store writes them. The
same log shipped the way nodes did before (the whole file on every sync that saw it
change) is computed from the same growth, without sending it.

    ./dev bench log_shipping [--mb 50] [--line-kb 64]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=50.0, help="final size of the rank log (MB)")
    parser.add_argument("--line-kb", type=float, default=64.0, help="what the log gains between two syncs (KB)")
    args = parser.parse_args()

    import boto3
    from moto.server import ThreadedMotoServer

    from prefect_sgpu.launch.bootstrap import NodeBootstrap, NodeIdentity
    from prefect_sgpu.store.s3 import S3Store

    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request lines
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)

        class Counting(S3Store):
            sent = 0
            puts = 0

            def put(self, run_id: str, key: str, data: bytes) -> None:
                Counting.sent += len(data)
                Counting.puts += 1
                super().put(run_id, key, data)

        store = Counting(f"s3://{bucket}/jobs", endpoint_url=endpoint, region="us-east-1")
        with tempfile.TemporaryDirectory() as tmp:
            node = NodeBootstrap(store, "run", NodeIdentity("i-0123456789abcdef0", 0, "10.0.0.5"), Path(tmp),
                                 heartbeat_ttl=60)
            log = Path(tmp) / "run" / "logs" / "rank-00000.log"
            log.parent.mkdir(parents=True)
            target = int(args.mb * 1_000_000)
            piece = (b"x" * (int(args.line_kb * 1000) - 1)) + b"\n"
            whole_each_sync = 0
            syncs = 0
            started = time.perf_counter()
            with open(log, "ab") as fh:
                while fh.tell() < target:
                    fh.write(piece)
                    fh.flush()
                    node.sync_up()
                    syncs += 1
                    whole_each_sync += fh.tell()
            during = Counting.sent
            node.seal_appended()
            elapsed = time.perf_counter() - started
            size = log.stat().st_size
            assert store.get("run", "logs/rank-00000.log") == log.read_bytes()
    finally:
        server.stop()

    import boto3 as b3
    import moto

    print(f"# log shipping, {dt.date.today()} on {platform.node()} ({os.cpu_count()} cores), "
          f"Python {sys.version.split()[0]}, boto3 {b3.__version__}, moto {moto.__version__}")
    print(f"rank log: {size / 1e6:.1f} MB in {syncs} syncs of {args.line_kb:g} KB")
    print(f"shipped while running: {during / 1e6:.1f} MB ({during / size:.2f}x the log) in {syncs} appended pieces")
    print(f"shipped in all (sealed whole at the end): {Counting.sent / 1e6:.1f} MB ({Counting.sent / size:.2f}x), "
          f"{Counting.puts} PUTs, {elapsed:.1f} s")
    print(f"the whole file on every sync (before): {whole_each_sync / 1e6:.0f} MB ({whole_each_sync / size:.0f}x)")


if __name__ == "__main__":
    main()
