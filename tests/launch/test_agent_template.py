"""Cold local node agents forked from the driver's agent template (torch imported once per
driver), or started as new interpreters when told; both the same program to the job."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from support.processes import job_processes
from prefect_sgpu import distributed, runtime
from prefect_sgpu.compute.local import LocalProcessCompute
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.compute import agent_template


def _lineage() -> dict[str, object]:
    """This rank's node agent (its parent: ranks are forked) and the agent's parent."""
    import torch
    import torch.distributed as dist

    runtime.init_process_group()
    t = torch.ones(1)
    dist.all_reduce(t)
    agent = psutil.Process().parent()
    above = agent.parent()
    return {"sum": t.item(), "agent": agent.pid, "agent_cmdline": " ".join(agent.cmdline()),
            "above": above.pid, "above_cmdline": " ".join(above.cmdline()), "run_id": os.environ["SGPU_RUN_ID"]}


@pytest.mark.parametrize("start", ["fork", "exec"])
def test_cold_agents_fork_from_one_template_or_start_as_new_interpreters(start: str) -> None:
    compute = LocalProcessCompute(isolation="none", keep_warm=0, agent_start=start)
    result = distributed(gpus=4, nodes=2, mlflow=False, compute=compute)(_lineage).run()
    values = result.values
    assert [v["sum"] for v in values] == [4.0] * 4
    agents = {v["agent"] for v in values}
    assert len(agents) == 2, "one agent per node"
    for v in values:
        # the agent's command line is a cold agent's either way: ps and psutil name its job
        assert "prefect_sgpu.launch.node_agent" in v["agent_cmdline"]
        assert f"--run-id={result.run_id}" in v["agent_cmdline"]
    if start == "fork":
        assert len({v["above"] for v in values}) == 1, "both agents forked from the same template"
        assert all("prefect_sgpu.launch.agent_template" in v["above_cmdline"] for v in values)
        assert psutil.Process(values[0]["above"]).parent().pid == os.getpid(), "the driver's own template"
    else:
        assert {v["above"] for v in values} == {os.getpid()}, "each agent a child of the driver"
    assert job_processes(result.run_id) == []


def _kill_the_template_then_return(seconds: float) -> int:
    import torch.distributed as dist

    runtime.init_process_group()
    dist.barrier()
    if runtime.rank() == 0:
        os.kill(psutil.Process().parent().ppid(), signal.SIGKILL)  # the agent's parent
    time.sleep(seconds)
    dist.barrier()
    return runtime.rank()


def test_a_job_whose_template_died_still_ends_with_its_ranks_results() -> None:
    """Agents outlive their template as cold agents outlive their driver; the job's end is seen
    without the template's word on each agent's exit, and the next job gets a new template."""
    compute = LocalProcessCompute(isolation="none", keep_warm=0, agent_start="fork")
    fn = distributed(gpus=4, nodes=2, mlflow=False, compute=compute)(_kill_the_template_then_return)
    result = fn.run(1.0)
    assert result.values == [0, 1, 2, 3]
    assert job_processes(result.run_id) == []
    again = distributed(gpus=2, mlflow=False, compute=compute)(_lineage).run()
    assert [v["sum"] for v in again.values] == [2.0, 2.0]
    assert "prefect_sgpu.launch.agent_template" in again.values[0]["above_cmdline"]


def test_a_bad_agent_start_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SGPUConfigError, match="agent_start"):
        LocalProcessCompute(agent_start="spawn")
    monkeypatch.setenv(agent_template.AGENT_START_ENV, "vfork")
    with pytest.raises(SGPUConfigError, match=f"{agent_template.AGENT_START_ENV}.*vfork.*fork, exec"):
        LocalProcessCompute()
    monkeypatch.setenv(agent_template.AGENT_START_ENV, "exec")
    assert LocalProcessCompute().agent_start == "exec"
