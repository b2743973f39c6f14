"""Live rank logs: what a rank writes cannot drive the user's terminal, and one bad log name stops nothing.

Whoever runs code in a rank (or writes the store) chooses the bytes of its log and the
names under ``logs/``. The driver prints those lines on the user's terminal or hands them
to the Prefect run's logger, so control characters are shown as escapes; a name that is
not ``logs/rank-N.log`` is skipped with one warning while every other rank's log goes on.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from prefect_sgpu.observe.logs import LogTailer, RankLogSink, printable
from prefect_sgpu.store import LocalStore

HOSTILE = b"\x1b]0;owned\x07\x1b[2J\x1b[1Aloss 0.1\tok\rfake line\xc2\x9b31m \xe2\x80\xae\x00end\n"


def test_printable_keeps_text_and_tabs_and_escapes_every_control() -> None:
    assert printable("step 3\tloss 0.25 ünïcode") == "step 3\tloss 0.25 ünïcode"
    shown = printable(HOSTILE.decode())
    assert shown == "\\x1b]0;owned\\x07\\x1b[2J\\x1b[1Aloss 0.1\tok\\rfake line\\x9b31m \\u202e\\x00end\\n"
    assert all(c.isprintable() or c == "\t" for c in shown)


def test_a_rank_line_is_printed_without_its_escape_sequences(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    store = LocalStore(tmp_path)
    store.put("run", "logs/rank-00001.log", HOSTILE)
    LogTailer(store, "run", procs_per_node=2, sink=RankLogSink("train", echo=True).line).poll()
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "\x9b" not in out and "\u202e" not in out
    assert out.startswith("[rank 1 node 0] \\x1b]0;owned\\x07\\x1b[2J") and "\tok\\rfake line" in out


def test_the_prefect_run_logger_gets_the_escaped_line_too(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    store = LocalStore(tmp_path)
    store.put("run", "logs/rank-00000.log", HOSTILE)
    run_logger = logging.getLogger("test-run-logger")
    with caplog.at_level(logging.INFO, logger="test-run-logger"):
        sink = RankLogSink("train", run_logger=run_logger)
        LogTailer(store, "run", procs_per_node=1, sink=sink.line).poll()
    [message] = [r.getMessage() for r in caplog.records if r.name == "test-run-logger"]
    assert "\x1b" not in message and "\\x1b[2J" in message


@pytest.mark.parametrize("bad", ["logs/rank-abc.log", "logs/notes.txt", "logs/rank-.log",
                                 "logs/rank-\x1b[2J.log"])
def test_one_malformed_log_name_is_skipped_once_and_the_others_go_on(
        bad: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = LocalStore(tmp_path)
    lines: list[tuple[int, int, str]] = []
    tailer = LogTailer(store, "run", procs_per_node=2, sink=lambda r, n, t: lines.append((r, n, t)))
    store.put("run", bad, b"planted\n")
    store.put("run", "logs/rank-00000.log", b"first\n")
    store.put("run", "logs/rank-00003.log", b"third\n")
    with caplog.at_level(logging.WARNING, logger="prefect_sgpu"):
        tailer.poll()
        store.put("run", "logs/rank-00000.log", b"first\nsecond\n")
        tailer.poll()
        tailer.poll(final=True)
    assert sorted(lines) == [(0, 0, "first"), (0, 0, "second"), (3, 1, "third")]
    skipped = [r.getMessage() for r in caplog.records if "skipping log object" in r.getMessage()]
    assert len(skipped) == 1 and "\x1b" not in skipped[0], skipped


def test_a_rank_the_compute_cannot_place_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = LocalStore(tmp_path)
    lines: list[tuple[int, int, str]] = []
    tailer = LogTailer(store, "run", procs_per_node=1, sink=lambda r, n, t: lines.append((r, n, t)))
    tailer.node_of = [0, 1].__getitem__  # two ranks placed: a log of rank 7 names no rank of this job
    store.put("run", "logs/rank-00001.log", b"real\n")
    store.put("run", "logs/rank-00007.log", b"planted\n")
    with caplog.at_level(logging.WARNING, logger="prefect_sgpu"):
        tailer.poll(final=True)
    assert lines == [(1, 1, "real")]
    assert any("rank-00007.log" in r.getMessage() for r in caplog.records)
