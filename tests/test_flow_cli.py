"""The example flows' --gpu-type / --remote / --compute-block: checked before any flow run starts."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefect_sgpu.cli import add_gpu_arguments, gpu_options
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.resolve import REMOTE_COMPUTE_ENV

ROOT = Path(__file__).resolve().parents[1]


def _options(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_gpu_arguments(parser)
    return gpu_options(parser.parse_args(list(argv)))


def test_defaults_run_here_on_whatever_gpus_the_machine_has(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REMOTE_COMPUTE_ENV, raising=False)
    assert _options() == {"gpu_type": None, "remote": False}
    assert _options("--gpu-type", "a10") == {"gpu_type": "a10", "remote": False}


def test_a_compute_block_makes_remote_gpu_tasks_use_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REMOTE_COMPUTE_ENV, raising=False)
    assert _options("--gpu-type", "H100", "--remote", "--compute-block", "sgpu-ec2-compute/h100-pool") == {
        "gpu_type": "H100", "remote": True}
    assert os.environ[REMOTE_COMPUTE_ENV] == "sgpu-ec2-compute/h100-pool"


@pytest.mark.parametrize("argv, match", [
    (("--gpu-type", "B300X"), r"--gpu-type='B300X'.*A10, A100"),
    (("--remote",), r"--remote=True.*--compute-block SLUG/NAME or set PREFECT_SGPU_REMOTE_COMPUTE"),
    (("--remote", "--compute-block", "h100-pool"), r"--compute-block='h100-pool'.*<block-type-slug>/<name>"),
    (("--compute-block", "sgpu-ec2-compute/x"), r"--compute-block='sgpu-ec2-compute/x'.*only with --remote"),
])
def test_bad_flags_are_refused_naming_the_flag(argv: tuple[str, ...], match: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REMOTE_COMPUTE_ENV, raising=False)
    with pytest.raises(SGPUConfigError, match=match):
        _options(*argv)


@pytest.mark.parametrize("script", ["finetune_llm.py", "mlp_ddp.py", "two_tower.py", "ray_digits.py"])
def test_every_example_flow_takes_the_flags_and_refuses_remote_without_a_compute(script: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != REMOTE_COMPUTE_ENV}
    env["PREFECT_API_URL"] = "http://127.0.0.1:9/api"  # a flow run that started would fail on this
    done = subprocess.run([sys.executable, str(ROOT / "flows" / script), "--gpu-type", "A10", "--remote"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--remote=True is not allowed" in done.stderr, done.stderr[-2000:]
    assert "Beginning flow run" not in done.stdout + done.stderr, "the flag was checked after the flow started"
