"""The c10d rendezvous of a real two-node job: where its stores listen, and what its id gives away."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import pytest

from support.processes import job_processes
from prefect_sgpu import distributed, runtime
from prefect_sgpu.launch.rendezvous import rendezvous_id

pytestmark = pytest.mark.e2e

WILDCARDS = ("0.0.0.0", "::")


def _hold_until_released(folder: str) -> str:
    """Say which job and rendezvous this rank is in, then wait for the test to look at them."""
    Path(folder, f"rank-{runtime.rank()}").write_text(
        f"{os.environ['SGPU_RUN_ID']}\n{os.environ['TORCHELASTIC_RUN_ID']}")
    deadline = time.monotonic() + 180
    while not Path(folder, "release").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return os.environ["TORCHELASTIC_RUN_ID"]


class Listener(NamedTuple):
    pid: int
    address: str
    port: int


def listeners(procs: list[psutil.Process]) -> list[Listener]:
    """Every listening TCP socket (IPv4 and IPv6) of ``procs``, each read in its own network namespace."""
    found = []
    for proc in procs:
        try:
            found += [Listener(proc.pid, c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    return found


def _this_jobs_processes(run_id: str) -> list[psutil.Process]:
    """The job's agents and ranks (its run id on their command line) of this test session's home."""
    found = []
    for line in job_processes(run_id):
        try:
            proc = psutil.Process(int(line.split(":", 1)[0]))
            home = os.environ["PREFECT_SGPU_HOME"]
            if any(w.startswith(f"--job-dir={home}{os.sep}") for w in _words(proc)):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _words(proc: psutil.Process) -> list[str]:
    """A process's command line, word by word (a forked agent's is one string: its title)."""
    return " ".join(proc.cmdline()).split()


def _is_agent(proc: psutil.Process) -> bool:
    """A node agent, not what holds its namespaces (``unshare``, or the process a forked agent's
    template made for it) nor a rank forked from it (same command line)."""
    from prefect_sgpu.launch.warm_node import NAMESPACE_TITLE

    def agent_image(p: psutil.Process | None) -> bool:
        if p is None:
            return False
        words = _words(p)
        return "prefect_sgpu.launch.node_agent" in words and "unshare" not in words[0] and NAMESPACE_TITLE != words[0]

    return agent_image(proc) and not agent_image(proc.parent())


def _argument(proc: psutil.Process, name: str) -> str:
    return next(a.split("=", 1)[1] for a in _words(proc) if a.startswith(f"{name}="))


@pytest.mark.parametrize("agent_start", ["fork", "exec"])
def test_the_rendezvous_stores_listen_on_the_nodes_address_under_an_id_on_no_command_line(
        tmp_path: Path, agent_start: str) -> None:
    from prefect_sgpu.compute.local import LocalProcessCompute

    fn = distributed(gpus=2, nodes=2, mlflow=False, compute=LocalProcessCompute(agent_start=agent_start))(
        _hold_until_released)
    job = fn.job(str(tmp_path))
    outcome: dict[str, Any] = {}

    def run_job() -> None:
        try:
            outcome["result"] = job.run()
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            outcome["error"] = exc

    runner = threading.Thread(target=run_job, daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 240
        while not all((tmp_path / f"rank-{r}").exists() for r in (0, 1)):
            assert runner.is_alive(), f"the job ended before both ranks ran: {outcome}"
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        run_id, rdzv = (tmp_path / "rank-0").read_text().split("\n")
        procs = _this_jobs_processes(run_id)
        agents = [p for p in procs if _is_agent(p)]
        assert sorted(_argument(a, "--node-index") for a in agents) == ["0", "1"]
        node0 = next(a for a in agents if _argument(a, "--node-index") == "0")
        host, port = _argument(node0, "--rdzv-endpoint").rsplit(":", 1)

        # the rendezvous id: derived from the job key, the same on every node, on no command line
        assert job.allocation is not None
        assert rdzv == rendezvous_id(job.allocation.folder.key, 0) != run_id
        assert (tmp_path / "rank-1").read_text().split("\n")[1] == rdzv
        for proc in procs:
            assert rdzv not in " ".join(proc.cmdline()), f"the rendezvous id is on the command line of {proc.pid}"

        # node 0's rendezvous store listens on node 0's address alone; nothing of the job on every interface
        found = listeners(procs)
        on_port = [(l.pid, l.address) for l in found if l.port == int(port)]
        assert on_port == [(node0.pid, host)], f"rendezvous port {port}: {on_port}"
        assert not [l for l in found if l.address in WILDCARDS], f"listening on every interface: {found}"
        # and the workers' store (MASTER_PORT), which an agent hosts, is among them: on its address too
        agent_listeners = [l for l in found if l.pid in {a.pid for a in agents}]
        assert len(agent_listeners) >= 2, agent_listeners
    finally:
        (tmp_path / "release").touch()
        runner.join(timeout=240)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"].values == [rdzv, rdzv]
    assert job_processes(run_id) == []
