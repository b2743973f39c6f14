"""A rebalance recommendation is not a reclaim notice: a checkpointer saves early for it only when
asked (``on_rebalance=True``), once; a reclaim notice still makes it save whatever the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefect_sgpu import runtime
from prefect_sgpu.pipeline.checkpoint import SealedSteps


@pytest.fixture
def job_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "job"
    folder.mkdir()
    monkeypatch.setenv("SGPU_JOB_DIR", str(folder))
    return folder


def test_a_rebalance_recommendation_makes_a_save_due_only_when_asked_and_once(job_dir: Path, tmp_path: Path) -> None:
    default = SealedSteps(tmp_path / "a")
    asked = SealedSteps(tmp_path / "b", on_rebalance=True)
    assert not default.reclaim_due(3) and not asked.reclaim_due(3)

    (job_dir / runtime.REBALANCE_FILE).write_text('rebalance recommendation: {"noticeTime": "x"}')
    assert runtime.rebalance_recommendation() is not None and not runtime.preemption_requested()
    assert not default.reclaim_due(4), "a rebalance recommendation was taken for a reclaim notice"
    assert asked.reclaim_due(4) and asked.rebalanced_at == 4
    assert not asked.reclaim_due(5), "one early save for one recommendation"

    (job_dir / runtime.PREEMPT_FILE).write_text("spot interruption: {}")
    assert default.reclaim_due(6) and asked.reclaim_due(6), "a reclaim notice after it still saves at once"
