"""Ctrl-C, SIGTERM and SIGHUP stop a driver's jobs: no rank keeps running, the MLflow run ends KILLED.

A real driver process runs a 600 s job, in the foreground (``.distributed()``) or in the
background (``.submit()`` then ``.result()``); once its ranks are up the test signals it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from support.processes import default_sigint, job_processes

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]

DRIVER = textwrap.dedent("""
    import sys, time
    from prefect_sgpu import distributed

    @distributed(gpus=2, timeout=900)
    def slow(folder):
        from prefect_sgpu import runtime
        open(f"{folder}/rank-{runtime.rank()}", "w").close()
        time.sleep(600)

    if sys.argv[2] == "submit":
        future = slow.submit(sys.argv[1])
        future.result()
    else:
        slow.distributed(sys.argv[1])
""")


@pytest.mark.parametrize(("mode", "sig"), [("submit", signal.SIGINT), ("submit", signal.SIGTERM),
                                           ("call", signal.SIGHUP)])
def test_a_signal_stops_the_drivers_jobs(tmp_path: Path, mode: str, sig: signal.Signals) -> None:
    from mlflow.tracking import MlflowClient

    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PREFECT_SGPU_DEVICE": "cpu",
           "PYTHONPATH": str(REPO), "PREFECT_SGPU_HOME": str(tmp_path / "home")}
    out = tmp_path / "driver.out"
    with open(out, "wb") as fh:
        driver = subprocess.Popen([sys.executable, str(script), str(tmp_path), mode], env=env, stdout=fh,
                                  stderr=subprocess.STDOUT, preexec_fn=default_sigint)
    run_id = None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and driver.poll() is None:
            if (tmp_path / "rank-0").exists() and (tmp_path / "rank-1").exists():
                break
            time.sleep(0.2)
        assert driver.poll() is None, out.read_text()
        (run_dir,) = (tmp_path / "home" / "jobs").iterdir()  # the driver's only job
        run_id = run_dir.name
        assert job_processes(run_id), "the ranks are running"
        driver.send_signal(sig)
        driver.wait(timeout=90)  # a liveness bound; the stop itself takes the 10 s grace at most
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=10)
    assert run_id is not None
    assert not job_processes(run_id), f"left running after {sig.name}: {job_processes(run_id)}"
    client = MlflowClient(uri)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.tags.get("sgpu.run_id") == run_id and run.info.status == "KILLED", out.read_text()[-3000:]
