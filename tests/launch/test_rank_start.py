"""How a cold node agent starts its ranks: forked from itself where they use no GPU, new
interpreters where they may (or when told), and a bad setting refused before anything starts."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from prefect_sgpu import distributed
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.launch import node_agent


def _how_started() -> dict[str, object]:
    """This rank's own command line and its parent's (the node agent's, or torch elastic's spawn),
    and what its stop signals do."""
    import signal

    me = psutil.Process()
    stops = {sig.name: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    return {"cmdline": me.cmdline(), "parent": me.parent().cmdline(),
            "stops": {name: how.name if isinstance(how, signal.Handlers) else how.__name__
                      for name, how in stops.items()}}


@pytest.mark.parametrize(
    ("env", "uses_cuda"),
    [
        ({"SGPU_DEVICE": "cpu"}, False),
        ({"SGPU_DEVICE": "cuda"}, True),
        ({"CUDA_VISIBLE_DEVICES": ""}, False),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, False),
    ],
)
def test_the_launcher_s_device_decides_whether_ranks_may_use_cuda(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], uses_cuda: bool) -> None:
    for name in ("SGPU_DEVICE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert node_agent.ranks_may_use_cuda() is uses_cuda
    assert node_agent.rank_start_method("auto", forked=False) == ("spawn" if uses_cuda else "fork")


def test_without_a_device_setting_the_nvidia_device_file_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SGPU_DEVICE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    real_exists = os.path.exists
    for present in (True, False):
        monkeypatch.setattr(os.path, "exists",
                            lambda p, present=present: present if p == "/dev/nvidiactl" else real_exists(p))
        assert node_agent.rank_start_method("auto", forked=False) == ("spawn" if present else "fork")


def test_an_explicit_start_wins_and_a_warm_node_always_forks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGPU_DEVICE", "cuda")
    assert node_agent.rank_start_method("fork", forked=False) == "fork"
    assert node_agent.rank_start_method("spawn", forked=True) == "fork"
    monkeypatch.setenv("SGPU_DEVICE", "cpu")
    assert node_agent.rank_start_method("spawn", forked=False) == "spawn"
    with pytest.raises(ValueError, match="vfork"):
        node_agent.rank_start_method("vfork", forked=False)


def test_a_bad_rank_start_setting_fails_the_call_before_anything_is_started(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_SGPU_RANK_START", "vfork")
    job = distributed(gpus=2)(_how_started).job()
    with pytest.raises(SGPUConfigError) as info:
        job.run()
    assert "PREFECT_SGPU_RANK_START" in str(info.value) and "vfork" in str(info.value)
    assert "spawn" in str(info.value)
    assert job.allocation is None, "nothing was acquired"
    assert not (Path(os.environ["PREFECT_SGPU_HOME"]) / "jobs" / job.run_id).exists()


@pytest.mark.e2e
@pytest.mark.parametrize("start", ["auto", "spawn"])
def test_cpu_ranks_are_forked_from_their_agent_unless_spawn_is_asked_for(
        monkeypatch: pytest.MonkeyPatch, start: str) -> None:
    monkeypatch.setenv("PREFECT_SGPU_RANK_START", start)
    monkeypatch.setenv("PREFECT_SGPU_KEEP_WARM", "0")
    result = distributed(gpus=4, nodes=2)(_how_started).job().run()
    assert len(result.values) == 4
    for seen in result.values:
        own, parent = " ".join(seen["cmdline"]), " ".join(seen["parent"])
        if start == "spawn":  # a new interpreter running the rank entry point, below the agent
            assert "prefect_sgpu.launch.rank_main" in own
        else:  # the agent's own process image: same command line, torch already loaded
            assert "prefect_sgpu.launch.node_agent" in own and "prefect_sgpu.launch.rank_main" not in own
            assert own == parent
        assert "prefect_sgpu.launch.node_agent" in parent
        # as in a new interpreter: a stop kills the rank, not torch elastic's handler in the agent
        assert seen["stops"] == {"SIGTERM": "SIG_DFL", "SIGHUP": "SIG_DFL",
                                 "SIGINT": "default_int_handler"}, seen["stops"]
