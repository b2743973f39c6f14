"""``prefect-sgpu run``: a script on every rank from a shell, inside a Prefect flow run, torchrun's way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prefect_sgpu.resolve import REMOTE_COMPUTE_ENV

pytestmark = pytest.mark.e2e

SCRIPT = """
import json, os, sys
from pathlib import Path

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
(out / f"rank-{rank}.json").write_text(json.dumps({
    "rank": rank, "world": int(os.environ["WORLD_SIZE"]), "local_rank": int(os.environ["LOCAL_RANK"]),
    "argv": sys.argv[2:], "greeting": os.environ.get("GREETING"), "master": os.environ.get("MASTER_ADDR")}))
print(f"rank {rank} wrote its file")
if rank == 1 and "--fail" in sys.argv:
    sys.exit(3)
"""


def _script(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """The script, and the folder its ranks write to (its first argument)."""
    script = tmp_path / name
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "out"
    out.mkdir()
    return script, out


def _cli(*argv: str, api_url: str | None = None, mlflow: bool = True) -> subprocess.CompletedProcess[str]:
    """``prefect-sgpu run ARGV``; ``mlflow=False``: without its MLflow run (``PREFECT_SGPU_MLFLOW``), where a test
    proves nothing about it (the driver and every rank then skip importing MLflow and opening its store)."""
    env = {k: v for k, v in os.environ.items() if k != REMOTE_COMPUTE_ENV}
    if not mlflow:
        env["PREFECT_SGPU_MLFLOW"] = "false"
    if api_url is None:
        from prefect.settings import PREFECT_API_URL

        api_url = str(PREFECT_API_URL.value())
    env["PREFECT_API_URL"] = api_url
    return subprocess.run([sys.executable, "-m", "prefect_sgpu.cli", "run", *argv], env=env, capture_output=True,
                          text=True, timeout=300)


def _flow_run(name: str) -> tuple[str, list[str], list[str]]:
    """The state of the newest ``prefect-sgpu-run`` flow run called ``name``, its task runs' names and its
    artifacts' keys."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, FlowFilter,
                                                FlowFilterName, FlowRunFilter, FlowRunFilterName,
                                                TaskRunFilter, TaskRunFilterFlowRunId)
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        (run, *_) = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["prefect-sgpu-run"])),
                                          flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])),
                                          sort=FlowRunSort.START_TIME_DESC, limit=1)
        tasks = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[run.id])))
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[run.id])))
    return run.state.type.value, [t.name for t in tasks], [a.key for a in artifacts if a.key]


def test_the_script_runs_on_every_rank_with_its_arguments_inside_a_flow_run(prefect_server: None,
                                                                           tmp_path: Path) -> None:
    script, out = _script(tmp_path, "train_cli.py")
    done = _cli("--gpus", "2", "--env", "GREETING=hi", str(script), str(out), "--lr", "3e-4")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    assert all(r["argv"] == ["--lr", "3e-4"] and r["greeting"] == "hi" and r["master"] for r in ranks), ranks
    assert "[rank 1 node 0] rank 1 wrote its file" in done.stdout + done.stderr
    state, tasks, artifacts = _flow_run("train_cli.py")
    assert state == "COMPLETED" and tasks == ["train_cli.py"], (state, tasks)
    assert "sgpu-train-cli-py-progress" in artifacts, artifacts


def test_a_rank_that_exits_non_zero_fails_the_command_and_its_flow_run(prefect_server: None,
                                                                       tmp_path: Path) -> None:
    script, out = _script(tmp_path, "fails_cli.py")
    done = _cli("--gpus", "2", str(script), str(out), "--fail", mlflow=False)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "prefect-sgpu run:" in done.stderr and "rank 1" in done.stderr and "exit code 3" in done.stderr, \
        done.stderr[-3000:]
    state, tasks, _ = _flow_run("fails_cli.py")
    assert state == "FAILED" and tasks == ["fails_cli.py"], (state, tasks)


@pytest.mark.parametrize("argv, match", [
    (("--gpus", "0", "{script}"), "gpus"),
    (("--env", "NOEQUALS", "{script}"), "--env='NOEQUALS'"),
    (("--remote", "{script}"), "--remote=True"),
    (("--gpus", "2", "{missing}"), "an existing Python file"),
])
def test_bad_arguments_exit_2_naming_the_field_before_any_flow_run(argv: tuple[str, ...], match: str,
                                                                   tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    script.write_text("print('never')\n")
    given = [a.format(script=script, missing=tmp_path / "missing.py") for a in argv]
    done = _cli(*given, api_url="http://127.0.0.1:9/api")  # a flow run that started would fail on this
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert match in done.stderr, done.stderr[-2000:]
    assert "Beginning flow run" not in done.stdout + done.stderr
