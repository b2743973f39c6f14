"""Starting a Ray node on a busy machine: Ray's fixed 30 s raylet wait is retried, nothing else is."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Callable

import pytest

from prefect_sgpu.ray.node_process import STARTUP_TIMED_OUT, RayNodeProcess, RayNodeSpec
from support.fast_clock import VirtualClock


class Scripted(RayNodeProcess):
    """A node whose start attempts fail with the given messages (None: the node comes up); each try
    takes ``try_s`` seconds of the retry clock (Ray's own 30 s wait, on a virtual clock)."""

    def __init__(self, outcomes: list[str | None], try_s: float = 0.0) -> None:
        super().__init__(RayNodeSpec(node_ip="127.0.0.21", temp_dir="/nonexistent"), env={}, output=io.StringIO())
        self.outcomes = outcomes
        self.try_s = try_s
        self.tries = 0
        self.stops = 0
        self.timeouts: list[float] = []

    def _start_once(self, timeout: float, should_stop: Callable[[], bool]) -> None:
        from prefect_sgpu import retry

        self.tries += 1
        self.timeouts.append(timeout)
        retry.CLOCK.sleep(self.try_s)
        outcome = self.outcomes.pop(0)
        if outcome is not None:
            raise RuntimeError(f"ray start exited with code 1 before the node was up; its last lines:\n{outcome}")

    def stop(self, grace: float = 10.0) -> None:
        self.stops += 1


def test_a_startup_timeout_is_retried_and_the_node_comes_up(virtual_clock: VirtualClock) -> None:
    node = Scripted([f"Exception: The current node {STARTUP_TIMED_OUT}.", None])
    node.start(timeout=60)
    assert (node.tries, node.stops) == (2, 1), "stopped once, then started again"
    assert "starting it again" in node.output.getvalue()


def test_a_node_that_times_out_four_times_in_a_row_comes_up_on_the_fifth_try(virtual_clock: VirtualClock) -> None:
    """A loaded machine can run out Ray's fixed 30 s wait several times running; the launcher's
    600 s join budget leaves room for five tries, with a short backoff between them."""
    timed_out = f"Exception: The current node {STARTUP_TIMED_OUT}."
    node = Scripted([timed_out] * 4 + [None], try_s=31.0)
    node.start(timeout=600)
    assert (node.tries, node.stops) == (5, 4)
    assert node.output.getvalue().count("starting it again") == 4
    assert 0 < len(virtual_clock.slept) - 5 <= 4 and all(s <= 5.0 for s in virtual_clock.slept[1::2]), \
        "a backoff of at most 5 s between tries"
    assert node.timeouts[0] == pytest.approx(600, abs=1) and node.timeouts[-1] < 600 - 4 * 31, \
        "every try within the one budget"


def test_no_try_starts_that_could_not_outlast_rays_wait_or_after_the_job_is_done(
        virtual_clock: VirtualClock) -> None:
    timed_out = f"Exception: The current node {STARTUP_TIMED_OUT}."
    short = Scripted([timed_out] * 5, try_s=31.0)
    with pytest.raises(RuntimeError, match=STARTUP_TIMED_OUT):
        short.start(timeout=120)
    assert short.tries == 3, "the third try ends past 120 - 35 s: no fourth"
    done = Scripted([timed_out] * 5, try_s=31.0)
    with pytest.raises(RuntimeError, match=STARTUP_TIMED_OUT):
        done.start(timeout=600, should_stop=lambda: True)
    assert done.tries == 1


def test_other_failures_and_the_last_attempt_are_raised(virtual_clock: VirtualClock) -> None:
    broken = Scripted(["ValueError: bad --resources"])
    with pytest.raises(RuntimeError, match="bad --resources"):
        broken.start(timeout=60)
    assert broken.tries == 1, "only a startup timeout is worth another try"
    busy = Scripted([STARTUP_TIMED_OUT] * 3)
    with pytest.raises(RuntimeError, match=STARTUP_TIMED_OUT):
        busy.start(timeout=60, attempts=3)
    assert busy.tries == 3


def test_every_process_of_a_node_is_told_its_own_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``RAY_ADDRESS`` names the node's own cluster: Ray code that looks "the" cluster up by
    itself (Ray Train's placement-group cleaner) must not meet another cluster on the host."""
    from prefect_sgpu.ray import node_process

    seen: list[dict[str, str]] = []

    class Refused(Exception):
        pass

    def popen(argv: list[str], env: dict[str, str], **_: object) -> None:
        seen.append(env)
        raise Refused  # the command line and environment are all this test looks at

    monkeypatch.setattr(node_process.subprocess, "Popen", popen)
    head = RayNodeSpec(node_ip="127.0.0.21", temp_dir=str(tmp_path / "head"), gcs_port=46123)
    joiner = RayNodeSpec(node_ip="127.0.0.22", temp_dir=str(tmp_path / "joiner"), head_address="127.0.0.21:46123")
    for spec in (head, joiner):
        with pytest.raises(Refused):
            RayNodeProcess(spec, env={"RAY_ADDRESS": "127.0.0.99:1"}, output=io.StringIO())._start_once(5.0, bool)
    assert [env["RAY_ADDRESS"] for env in seen] == ["127.0.0.21:46123", "127.0.0.21:46123"]
