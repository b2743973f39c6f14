"""The decorator's surface: direct calls, .func, .with_options, argument binding, dry runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefect_sgpu import DistributedFunction, SGPUConfigError, distributed
from prefect_sgpu.errors import JobCancelled
from prefect_sgpu.store import LocalStore
from support.fake_compute import FakeCompute


@distributed(gpus=4, nodes=2, mlflow=False)
def run_train(num_epochs: int, batch_size: int = 32) -> float:
    return num_epochs * 0.5 + batch_size


def test_direct_call_says_to_use_distributed() -> None:
    with pytest.raises(TypeError, match=r"run_train\.distributed\(\.\.\.\)"):
        run_train(3)


def test_func_is_the_plain_function() -> None:
    assert run_train.func(2, batch_size=1) == 2.0
    assert run_train.__name__ == "run_train"
    assert isinstance(run_train, DistributedFunction)


def test_with_options_returns_a_validated_copy() -> None:
    wider = run_train.with_options(gpus=8, nodes=4, timeout=60)
    assert (wider.spec.gpus, wider.spec.nodes, wider.spec.timeout) == (8, 4, 60)
    assert (run_train.spec.gpus, run_train.spec.timeout) == (4, 3 * 3600)
    with pytest.raises(SGPUConfigError, match="gpus=0"):
        run_train.with_options(gpus=0)
    with pytest.raises(SGPUConfigError, match="gpu=.*one of gpus"):
        run_train.with_options(gpu=2)


def test_arguments_are_checked_against_the_signature_before_launch(tmp_path) -> None:
    fn = run_train.with_options(store=LocalStore(tmp_path))
    with pytest.raises(TypeError, match="missing a required argument: 'num_epochs'"):
        fn.distributed()
    with pytest.raises(TypeError, match="unexpected keyword argument 'lr'"):
        fn.distributed(1, lr=0.1)
    assert not any(tmp_path.iterdir())


def test_dry_run_shows_every_node_command_without_secrets(tmp_path) -> None:
    job = run_train.with_options(store=LocalStore(tmp_path)).job(1)
    plan = job.dry_run()
    assert plan["plan"].nodes == 2 and plan["plan"].procs_per_node == 2
    assert [n["index"] for n in plan["nodes"]] == [0, 1]
    for node in plan["nodes"]:
        assert "prefect_sgpu.launch.node_agent" in node["command"]
        assert "--nproc-per-node=2" in node["command"] and "--nnodes=2" in node["command"]
        assert "SGPU_PAYLOAD_KEY" not in node["env"], "the job key travels apart from the launch"
    assert job.prepare()[2] not in repr(plan)
    assert not any(tmp_path.iterdir()), "a dry run writes nothing"


def test_package_imports_without_heavy_libraries() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import prefect_sgpu; from prefect_sgpu import distributed, runtime;"
        "heavy = [m for m in ('torch', 'ray', 'mlflow', 'deepspeed') if m in sys.modules];"
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_submit_runs_every_job_at_once_without_a_pool_cap(tmp_path: Path) -> None:
    """40 submitted jobs are all started (each waits in acquire): none waits unseen behind a pool limit."""
    import time as _time

    compute = FakeCompute(acquire_blocks=True)
    fn = distributed(compute=compute, store=LocalStore(tmp_path), mlflow=False)(_identity_for_submit)
    futures = [fn.submit(i) for i in range(40)]
    try:
        deadline = _time.monotonic() + 60
        while _time.monotonic() < deadline and sum(c[0] == "acquire" for c in compute.calls) < 40:
            _time.sleep(0.05)
        assert sum(c[0] == "acquire" for c in compute.calls) == 40
    finally:
        for future in futures:
            future.cancel()
    for future in futures:
        with pytest.raises(JobCancelled):
            future.result(timeout=60)


def _identity_for_submit(x: int) -> int:
    return x
