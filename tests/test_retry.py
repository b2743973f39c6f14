"""The one retry helper: backoff with jitter inside a budget, on a clock a test can make virtual."""

from __future__ import annotations

import pytest

from prefect_sgpu import retry


class Late(Exception):
    pass


def test_a_late_answer_is_waited_for_within_the_budget_and_the_wait_is_logged(virtual_clock) -> None:
    answers = iter([Late("not yet")] * 6 + ["ready"])
    logged: list[str] = []

    def call() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert retry.retrying(call, transient=lambda e: isinstance(e, Late), budget_s=120, base_s=2, cap_s=30,
                          what="credentials", log=logged.append) == "ready"
    assert len(virtual_clock.slept) == 6
    assert all(0 <= d <= 30 for d in virtual_clock.slept)
    assert "retrying for up to 120 s" in logged[0] and "succeeded after waiting" in logged[-1]


def test_the_budget_bounds_the_wait_and_the_last_error_is_raised(virtual_clock) -> None:
    def call() -> None:
        raise Late("never")

    with pytest.raises(Late):
        retry.retrying(call, transient=lambda e: True, budget_s=180, base_s=5, cap_s=40)
    assert 170 <= virtual_clock.waited_s <= 180


def test_an_error_that_is_not_transient_is_raised_at_once(virtual_clock) -> None:
    calls = []

    def call() -> None:
        calls.append(1)
        raise ValueError("bad input")

    with pytest.raises(ValueError):
        retry.retrying(call, transient=lambda e: isinstance(e, Late), budget_s=60)
    assert calls == [1] and virtual_clock.slept == []


def test_the_floor_keeps_waits_of_a_slow_cloud_from_being_a_busy_loop(virtual_clock) -> None:
    backoff = retry.Backoff(budget_s=600, base_s=1, cap_s=120, floor_s=30).start()
    delays = [backoff.next_delay() for _ in range(5)]
    assert all(d is not None and d >= 30 for d in delays)
