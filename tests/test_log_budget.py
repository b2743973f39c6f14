"""What watching a job costs the store: one listing per poll for every rank's log, reads only of logs
that grew, bounded reads of a log however large, and nodes that ship log lines every few seconds.

The S3 tests count requests where they cross the fault proxy in front of moto (its request record is
the meter); the memory test measures the driver's peak RSS in a subprocess."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

from support.aws_fixtures import MotoAWS
from prefect_sgpu.launch.bootstrap import NodeBootstrap, NodeIdentity
from prefect_sgpu.launch.node_sync import LOG_COALESCE_S
from prefect_sgpu.observe.logs import MAX_LINE, SLOW_S, LogTailer
from prefect_sgpu.store import LocalStore
from prefect_sgpu.store.s3 import S3Store


@pytest.fixture
def store(aws_env: MotoAWS) -> S3Store:
    bucket = f"sgpu-budget-{uuid.uuid4().hex[:12]}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    return S3Store(f"s3://{bucket}/jobs", session=aws_env.session(), endpoint_url=aws_env.endpoint_url)


def test_one_listing_per_poll_and_reads_only_of_logs_that_grew(store: S3Store, aws_faults: Any) -> None:
    ranks = 8
    lines: list[tuple[int, str]] = []
    tailer = LogTailer(store, "run", procs_per_node=1, sink=lambda r, n, t: lines.append((r, t)))
    for rank in range(ranks):  # as nodes write them: appended pieces, one rank sealed already
        key = f"logs/rank-{rank:05d}.log"
        store.append("run", key, 0, f"rank {rank} line 0\n".encode())
        store.append("run", key, len(f"rank {rank} line 0\n"), f"rank {rank} line 1\n".encode())
    store.seal_appended("run", "logs/rank-00000.log", b"rank 0 line 0\nrank 0 line 1\n")
    tailer.poll()
    assert sorted(lines) == sorted((r, f"rank {r} line {i}") for r in range(ranks) for i in range(2))

    aws_faults.reset()
    assert tailer.poll() is False
    assert aws_faults.s3_requests() == {"LIST": 1}, "unchanged logs: one listing and no GET"

    aws_faults.reset()
    store.append("run", "logs/rank-00005.log", len("rank 5 line 0\nrank 5 line 1\n"), b"rank 5 line 2\n")
    tailer.poll()
    assert aws_faults.s3_requests() == {"PUT": 1, "LIST": 1, "GET": 1}, "one log grew: one GET, of its new piece"
    assert lines[-1] == (5, "rank 5 line 2")


def test_polls_back_off_while_nothing_changes_and_return_to_fast(tmp_path: Path) -> None:
    tailer = LogTailer(LocalStore(tmp_path), "run", procs_per_node=1, sink=lambda r, n, t: None)
    delays = [tailer.interval]
    for _ in range(8):
        delays.append(tailer.next_delay(delays[-1], changed=False))
    assert 1.0 <= delays[0] <= 2.0 and delays == sorted(delays) and delays[-1] == SLOW_S
    assert tailer.next_delay(delays[-1], changed=True) == delays[0]


def test_a_node_coalesces_log_lines_and_ships_the_rest_at_the_end(tmp_path: Path, virtual_clock: Any) -> None:
    class Counting(LocalStore):
        appends = 0

        def append(self, run_id: str, key: str, offset: int, data: bytes) -> None:
            Counting.appends += 1
            super().append(run_id, key, offset, data)

    store = Counting(tmp_path / "store")
    node = NodeBootstrap(store, "run", NodeIdentity("i-0123456789abcdef0", 0, "10.0.0.5"), tmp_path / "node",
                         heartbeat_ttl=60)
    log = tmp_path / "node" / "run" / "logs" / "rank-00000.log"
    log.parent.mkdir(parents=True)
    seconds = 60
    with open(log, "ab") as fh:
        for second in range(seconds):  # a line a second, a sync a second
            fh.write(f"step {second}\n".encode())
            fh.flush()
            node.sync_up()
            virtual_clock.advance(1.0)
    assert Counting.appends <= seconds / LOG_COALESCE_S + 1, Counting.appends
    node.sync_up(final=True)
    node.seal_appended()
    assert store.get("run", "logs/rank-00000.log") == log.read_bytes(), "nothing lost at the end"


def test_a_big_burst_ships_without_waiting(tmp_path: Path, virtual_clock: Any) -> None:
    store = LocalStore(tmp_path / "store")
    node = NodeBootstrap(store, "run", NodeIdentity("i-0123456789abcdef0", 0, "10.0.0.5"), tmp_path / "node",
                         heartbeat_ttl=60)
    log = tmp_path / "node" / "run" / "logs" / "rank-00000.log"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"first\n")
    node.sync_up()
    with open(log, "ab") as fh:
        fh.write(b"x" * 40_000 + b"\n")
    node.sync_up()  # no time passed, but tens of KiB wait
    assert store.get("run", "logs/rank-00000.log") == log.read_bytes()


def test_a_long_line_is_cut_with_one_warning_and_the_next_lines_follow(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = LocalStore(tmp_path)
    lines: list[str] = []
    tailer = LogTailer(store, "run", procs_per_node=1, sink=lambda r, n, t: lines.append(t))
    store.put("run", "logs/rank-00000.log", b"before\n" + b"y" * (3 * MAX_LINE))
    with caplog.at_level(logging.WARNING, logger="prefect_sgpu"):
        tailer.poll()
        store.put("run", "logs/rank-00000.log", b"before\n" + b"y" * (5 * MAX_LINE) + b"\nafter\n")
        tailer.poll(final=True)
    assert lines[0] == "before" and lines[-1] == "after" and len(lines) == 3
    assert lines[1].startswith("y" * MAX_LINE) and len(lines[1]) < MAX_LINE + 100
    assert sum("line too long" in r.getMessage() for r in caplog.records) == 1


def test_a_512_mib_log_without_a_newline_does_not_grow_the_driver_by_its_size(tmp_path: Path) -> None:
    """The log is sparse on disk (no 512 MiB written); the driver reads it as it would any log."""
    size = 512 * 1024 * 1024
    log = tmp_path / "run" / "logs" / "rank-00000.log"
    log.parent.mkdir(parents=True)
    with open(log, "wb") as fh:
        fh.write(b"start of a very long line ")
        fh.truncate(size)
    script = textwrap.dedent(f"""
        import logging, resource
        from prefect_sgpu.observe.logs import LogTailer
        from prefect_sgpu.store import LocalStore
        logging.basicConfig(level=logging.WARNING)
        lines = []
        tailer = LogTailer(LocalStore({str(tmp_path)!r}), "run", procs_per_node=1,
                           sink=lambda r, n, t: lines.append(len(t)))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        while tailer.poll():
            pass
        tailer.poll(final=True)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print("GROWTH_KIB", after - before, "LINES", lines)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]
    growth_kib = int(done.stdout.split("GROWTH_KIB")[1].split()[0])
    print(f"driver peak RSS growth for a {size >> 20} MiB log: {growth_kib / 1024:.1f} MiB")
    assert growth_kib < 64 * 1024, f"peak RSS grew by {growth_kib / 1024:.0f} MiB"
    assert "line too long" in done.stderr
    assert "LINES [" in done.stdout and len(done.stdout.split("LINES [")[1].split(",")) == 1


def test_an_oversized_control_document_is_refused_before_it_is_read(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    import tracemalloc

    from prefect_sgpu.protocol import jobfolder
    from prefect_sgpu.protocol.jobfolder import JobFolder, NodeStatus, status_key
    from prefect_sgpu.protocol.limits import CONTROL_LIMIT

    folder = JobFolder(LocalStore(tmp_path), "job-1", jobfolder.new_key())
    folder.put_status(0, NodeStatus(node=0, host="h", exit_code=0))
    assert folder.status(0) is not None, "a document within its limit is read"
    path = tmp_path / "job-1" / status_key(1)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:  # a writer of the store planted 200 MiB (sparse) as node 1's status
        fh.truncate(200 * 1024 * 1024)
    tracemalloc.start()
    with caplog.at_level(logging.WARNING, logger="prefect_sgpu"):
        assert folder.status(1) is None
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 4 * CONTROL_LIMIT, f"{peak} bytes held to refuse it"
    assert any("larger than the" in r.getMessage() and "status" in r.getMessage() for r in caplog.records)


def test_s3_reads_at_most_the_limit_of_a_document(store: S3Store, aws_faults: Any) -> None:
    store.put("run", "nodes/status-1", b"x" * 5000)
    assert store.get_at_most("run", "nodes/status-1", 100) == (b"x" * 100, False)
    assert store.get_at_most("run", "nodes/status-1", 5000) == (b"x" * 5000, True)
    assert store.get_at_most("run", "nodes/missing", 100) == (None, True)
    store.put("run", "nodes/empty", b"")
    assert store.get_at_most("run", "nodes/empty", 100) == (b"", True)
