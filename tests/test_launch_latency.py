"""A call's driver imports only what it needs, and an unchanged warm set is not gang-checked at every job."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prefect_sgpu import distributed
from prefect_sgpu.compute.local import LocalProcessCompute
from prefect_sgpu.driver.job import GANG_CHECK_REUSE_ENV, gang_check_reuse_s
from prefect_sgpu.errors import SGPUConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_a_call_outside_a_flow_run_imports_neither_prefect_nor_mlflow(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import sys
        from prefect_sgpu import distributed
        from prefect_sgpu.compute.local import LocalProcessCompute

        def one():
            return 1

        assert distributed(gpus=2, mlflow=False, compute=LocalProcessCompute(keep_warm=0))(one).distributed() == [1, 1]
        print("IMPORTED", sorted(m for m in ("prefect", "mlflow", "torch") if m in sys.modules))
    """)
    env = {**os.environ, "PREFECT_SGPU_DEVICE": "cpu", "PREFECT_SGPU_HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "IMPORTED []" in done.stdout, done.stdout + done.stderr[-2000:]


def test_the_known_prefect_secrets_cover_the_installed_prefect_s_schema() -> None:
    from prefect_sgpu.compute.base import KNOWN_PREFECT_SECRETS, SECRET_ENV, schema_secret_settings

    assert set(schema_secret_settings()) - set(SECRET_ENV) <= set(KNOWN_PREFECT_SECRETS)


def test_a_bad_reuse_setting_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GANG_CHECK_REUSE_ENV, "soon")
    with pytest.raises(SGPUConfigError, match=GANG_CHECK_REUSE_ENV):
        gang_check_reuse_s()
    monkeypatch.setenv(GANG_CHECK_REUSE_ENV, "0")
    assert gang_check_reuse_s() == 0.0


def _fails_on_request(fail: bool) -> int:
    if fail:
        raise ValueError("asked to fail")
    return 1


def test_an_unchanged_warm_set_skips_the_gang_check_until_a_failure_or_a_new_node(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_SGPU_DEVICE", "cpu")
    compute = LocalProcessCompute(keep_warm=120)
    fn = distributed(gpus=2, mlflow=False, compute=compute)(_fails_on_request)
    try:
        first = fn.run(False)
        assert first.gang_check is not None and first.gang_check_reused_s is None  # a new set: checked
        second = fn.run(False)
        assert second.gang_check is None and second.gang_check_reused_s is not None  # unchanged: not again
        with pytest.raises(Exception, match="asked to fail"):
            fn.run(True)  # a failure on the set (the check itself was skipped)
        third = fn.run(False)
        assert third.gang_check is not None  # after a failure: checked again
        assert fn.run(False).gang_check is None
        monkeypatch.setenv(GANG_CHECK_REUSE_ENV, "0")
        assert fn.run(False).gang_check is not None  # older than the reuse window: checked again
        monkeypatch.delenv(GANG_CHECK_REUSE_ENV)
        from prefect_sgpu.compute.warm_pool import POOL

        (warm,) = [w for w in POOL.idle() if w.owner == id(compute)]
        warm.nodes[0].proc.kill()  # the node dies while idle: the pool starts a new set
        warm.nodes[0].proc.wait()
        fifth = fn.run(False)
        assert fifth.gang_check is not None and fifth.gang_check_reused_s is None
    finally:
        compute.close()


def test_a_warm_job_s_agent_and_ranks_import_nothing_the_warm_node_did_not(tmp_path: Path) -> None:
    """Python's import profile (``PYTHONPROFILEIMPORTTIME``, inherited by every fork of the warm node)
    names each module a process imports itself: a warm job's agent and ranks, forked from a node that
    preloaded what they use, name no module of this package (each one costs every warm call)."""
    script = textwrap.dedent("""
        from prefect_sgpu import distributed
        from prefect_sgpu.compute.local import LocalProcessCompute

        def _trivial():
            return 1

        compute = LocalProcessCompute(keep_warm=60)
        fn = distributed(gpus=2, mlflow=False, compute=compute)(_trivial)
        fn.run()  # starts the warm set
        print("JOB", fn.run().run_id)
        compute.close()
    """)
    home = tmp_path / "home"
    env = {**os.environ, "PREFECT_SGPU_DEVICE": "cpu", "PREFECT_SGPU_HOME": str(home), "PYTHONPATH": str(ROOT),
           "PYTHONPROFILEIMPORTTIME": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_id,) = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("JOB ")]
    job = home / "jobs" / run_id
    outputs = [*job.glob("agent/*.out"), *job.glob("logs/*.log")]
    assert len(outputs) == 3, outputs  # the node's agent and two ranks
    imported = sorted({line.rsplit("|", 1)[1].strip() for path in outputs for line in path.read_text().splitlines()
                       if "import time:" in line and "prefect_sgpu" in line})
    assert imported == [], f"imported at every warm job: {imported}"
