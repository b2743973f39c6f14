"""Progress files are sealed: what a rank reports through ``runtime.progress`` carries its line sealed
with the job's progress key, and the driver's straggler watch and progress report act on nothing a
store writer without that key wrote (unsealed, forged, moved from another rank, job or gang, or an
older file of the same rank written back)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from prefect_sgpu import runtime
from prefect_sgpu.observe.live import read_step
from prefect_sgpu.observe.progress_watch import StragglerWatch
from prefect_sgpu.observe.stragglers import StragglerDetector
from prefect_sgpu.protocol import rank_progress
from prefect_sgpu.protocol.jobfolder import GANG_ENV, new_key
from prefect_sgpu.store import LocalStore

RUN = "job-1"


def _sealed(key: str, rank: int, step: int, at: float, *, run_id: str = RUN, gang: int = 0) -> bytes:
    """What rank ``rank`` of ``run_id`` writes, sealed with the progress key of ``key``."""
    return rank_progress.file_bytes(f"99 {step} 0 {at:.3f}", rank_progress.progress_key(key), run_id, rank, gang)


def _forge(how: str, key: str, rank: int, step: int, at: float) -> bytes:
    """A slow rank 2's file, written by someone who can write the store but holds no key of this job."""
    line = f"99 {step} 0 {at:.3f}"
    if how == "unsealed":
        return f"{line}\n".encode()  # what ranks wrote before files were sealed
    if how == "another job's key":
        return _sealed(new_key(), rank, step, at)
    if how == "another job's file":
        return _sealed(key, rank, step, at, run_id="job-2")  # the same key cannot be had; the binding is checked too
    if how == "another rank's file":
        return _sealed(key, 1, step, at)  # rank 1's genuine seal, copied to rank 2's name
    if how == "another gang's file":
        return _sealed(key, rank, step, at, gang=1)
    if how == "a seal of garbage":
        return f"{line}\nnot-base64!\n".encode()
    raise AssertionError(how)


def _run_watch(store: LocalStore, key: str, write_rank_2) -> tuple[StragglerWatch, list]:
    """Ranks 0 and 1 step ten a tick (sealed, as their runtime writes them), rank 2's file is ``write_rank_2``'s."""
    watch = StragglerWatch(store, RUN, 3, 2.0, 2, key=key, interval=0.0)
    named = []
    for tick in range(1, 12):
        for rank in (0, 1):
            store.put(RUN, f"progress/rank-{rank}", _sealed(key, rank, tick * 10, 1000 + tick))
        store.put(RUN, "progress/rank-2", write_rank_2(tick))
        named.extend(watch.poll(now=float(tick)))
    return watch, named


def test_a_slow_rank_that_sealed_its_progress_is_named(tmp_path: Path) -> None:
    key = new_key()
    watch, named = _run_watch(LocalStore(tmp_path), key, lambda tick: _sealed(key, 2, tick, 1000 + tick))
    assert [s.rank for s in named] == [2] and watch.refused == {}


@pytest.mark.parametrize("how", ["unsealed", "another job's key", "another job's file", "another rank's file",
                                 "another gang's file", "a seal of garbage"])
def test_a_progress_file_forged_in_the_store_names_no_straggler_and_is_refused_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str) -> None:
    key = new_key()
    with caplog.at_level(logging.WARNING, logger="prefect_sgpu.observe.progress_watch"):
        watch, named = _run_watch(LocalStore(tmp_path), key, lambda tick: _forge(how, key, 2, tick, 1000 + tick))
    assert named == [], f"a forged progress file ({how}) named a straggler"
    assert watch.refused == {2: 11}, watch.refused  # every read of rank 2, never rank 0 or 1
    assert 2 not in watch.detector.rates()
    warnings = [r.getMessage() for r in caplog.records if "progress file of rank 2" in r.getMessage()]
    assert len(warnings) == 1, warnings  # one line per rank, the rest counted
    assert f"job {RUN}" in warnings[0] and "refused" in warnings[0], warnings[0]


def test_an_older_sealed_file_written_back_is_refused_and_does_not_restart_the_ranks_history(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    key = new_key()
    store = LocalStore(tmp_path)
    first = _sealed(key, 2, 1, 1001.0)  # what a store reader copies early on: genuine, sealed

    def slow_then_written_back(tick: int) -> bytes:
        return first if tick > 3 and tick % 2 else _sealed(key, 2, tick, 1000 + tick)

    fed: list[tuple[int, int]] = []
    observe = StragglerDetector.observe

    def recording(detector, rank: int, step: int, t: float):  # noqa: ANN001, ANN202 - a spy on the detector
        fed.append((rank, step))
        return observe(detector, rank, step, t)

    with caplog.at_level(logging.WARNING, logger="prefect_sgpu.observe.progress_watch"), \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(StragglerDetector, "observe", recording)
        watch, named = _run_watch(store, key, slow_then_written_back)
    # the written-back file would start rank 2's history over (a lower step) at every other read
    assert [step for rank, step in fed if rank == 2] == [1, 2, 3, 4, 6, 8, 10]
    assert [s.rank for s in named] == [2]
    assert watch.refused[2] == 4, watch.refused  # ticks 5, 7, 9, 11
    assert any("older than a step already read" in r.getMessage() for r in caplog.records)


def test_runtime_progress_seals_the_line_with_the_key_the_rank_was_armed_with(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = new_key()
    job_dir = tmp_path / RUN
    monkeypatch.setenv("SGPU_JOB_DIR", str(job_dir))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(GANG_ENV, "2")
    monkeypatch.delenv(rank_progress.KEY_ENV, raising=False)
    rank_progress.arm(key)  # what rank_main does before the user's function runs
    runtime.progress(7, total=20, force=True)
    store = LocalStore(tmp_path)
    line = rank_progress.read_line(store, RUN, 0, key, gang=2)
    assert line is not None and line.split()[1:3] == ["7", "20"], line
    # the plain first line is what the node's own hang watchdog reads, as before
    assert (job_dir / "progress" / "rank-0").read_text().split()[1:3] == ["7", "20"]
    assert read_step(store, RUN, key=key, gang=2) == (7, 20)
    # bound to its gang and job: another gang's or job's reader refuses it
    with pytest.raises(rank_progress.ProgressRefused, match="bound to"):
        rank_progress.read_line(store, RUN, 0, key, gang=0)
    with pytest.raises(rank_progress.ProgressRefused, match="signature does not match"):
        rank_progress.read_line(store, RUN, 0, new_key(), gang=2)
    monkeypatch.delenv(rank_progress.KEY_ENV)


def test_the_progress_report_shows_no_step_a_store_writer_wrote(tmp_path: Path) -> None:
    key = new_key()
    store = LocalStore(tmp_path)
    store.put(RUN, "progress/rank-0", b"99 90 100 1000.000\n")  # unsealed: 90 % done
    assert read_step(store, RUN, key=key) is None
    store.put(RUN, "progress/rank-0", b"99 90 100 1000.000\n" + b"A" * 5000 + b"\n")
    assert read_step(store, RUN, key=key) is None  # larger than any progress file: not read whole
    store.put(RUN, "progress/rank-0", rank_progress.file_bytes("99 3 100 1000.000",
                                                               rank_progress.progress_key(key), RUN, 0))
    assert read_step(store, RUN, key=key) == (3, 100)
