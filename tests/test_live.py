"""The live status line: on a terminal only, showing the job's phase, rank 0's step and time."""

from __future__ import annotations

import io
import re

import pytest

from prefect_sgpu import distributed
from prefect_sgpu.observe.live import LIVE_ENV, LiveStatus, enabled


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_on_only_for_a_terminal_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LIVE_ENV, raising=False)
    assert enabled(_Stream(tty=True)) and not enabled(_Stream(tty=False))
    monkeypatch.setenv(LIVE_ENV, "0")
    assert not enabled(_Stream(tty=True)), "PREFECT_SGPU_LIVE=0 turns it off on a terminal"
    monkeypatch.setenv(LIVE_ENV, "1")
    assert enabled(_Stream(tty=False))


def _steps() -> int:
    import time

    from prefect_sgpu import runtime

    runtime.progress(3, total=6, force=True)
    time.sleep(4.0)
    return runtime.rank()


def test_a_job_shows_its_phase_and_rank_zeros_step_on_the_live_line() -> None:
    from rich.console import Console

    out = _Stream(tty=True)
    console = Console(file=out, force_terminal=True, width=200, highlight=False)
    job = distributed(gpus=1, mlflow=False)(_steps).job()
    with LiveStatus(job, console=console, every=0.2):
        result = job.run()
    assert result.values == [0]
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    assert job.run_id in text
    assert "starting 1 rank(s) on 1 node(s)" in text, "the phase the library logged while the job started"
    assert "step 3/6 (50%)" in text, text[-2000:]


def test_off_when_not_a_terminal(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(LIVE_ENV, raising=False)
    job = distributed(gpus=1, mlflow=False)(_steps).job()
    live = LiveStatus(job)
    assert live.on is False  # the test's stderr is captured: no TTY
    with live:
        job.run()
    assert "step 3/6" not in capfd.readouterr().err
