"""Starting a Ray node on a busy machine: Ray's fixed 30 s raylet wait is retried, nothing else is."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Callable

import pytest

from prefect_sgpu.ray.node_process import STARTUP_TIMED_OUT, RayNodeProcess, RayNodeSpec


class Scripted(RayNodeProcess):
    """A node whose start attempts fail with the given messages (None: the node comes up)."""

    def __init__(self, outcomes: list[str | None]) -> None:
        super().__init__(RayNodeSpec(node_ip="127.0.0.21", temp_dir="/nonexistent"), env={}, output=io.StringIO())
        self.outcomes = outcomes
        self.tries = 0
        self.stops = 0

    def _start_once(self, timeout: float, should_stop: Callable[[], bool]) -> None:
        self.tries += 1
        outcome = self.outcomes.pop(0)
        if outcome is not None:
            raise RuntimeError(f"ray start exited with code 1 before the node was up; its last lines:\n{outcome}")

    def stop(self, grace: float = 10.0) -> None:
        self.stops += 1


def test_a_startup_timeout_is_retried_and_the_node_comes_up() -> None:
    node = Scripted([f"Exception: The current node {STARTUP_TIMED_OUT}.", None])
    node.start(timeout=60)
    assert (node.tries, node.stops) == (2, 1), "stopped once, then started again"
    assert "starting it again" in node.output.getvalue()


def test_other_failures_and_the_last_attempt_are_raised() -> None:
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
