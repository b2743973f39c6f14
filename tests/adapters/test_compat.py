"""TorchDistributor / DeepspeedTorchDistributor drop-ins, on real torch elastic ranks."""

from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path

import pytest

from prefect_sgpu import RankFailedError, SGPUConfigError, runtime
from prefect_sgpu.compat import DeepspeedTorchDistributor, TorchDistributor, deepspeed_config

pytestmark = pytest.mark.e2e

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "flows"))

SCRIPT = textwrap.dedent(
    """
    import os, sys
    rank = int(os.environ["RANK"])
    print(f"script rank {rank} of {os.environ['WORLD_SIZE']} argv={sys.argv[1:]}")
    if "--fail-rank" in sys.argv and rank == int(sys.argv[sys.argv.index("--fail-rank") + 1]):
        print("giving up", file=sys.stderr)
        sys.exit(3)
    """
)


@pytest.fixture()
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train_script.py"
    path.write_text(SCRIPT)
    return path


def test_torch_distributor_runs_the_mlp_training_function(capfd: pytest.CaptureFixture[str]) -> None:
    from mlp_ddp import train_mlp

    out = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(
        train_mlp.func, 1, batch_size=256)  # positional and keyword arguments, as pyspark passes them
    assert math.isfinite(out["loss"]) and out["start_epoch"] == 0, "rank 0's return value"
    assert "[rank 0 node 0] epoch 0: loss" in capfd.readouterr().out


def test_torch_distributor_runs_a_script_and_returns_none(script: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert TorchDistributor(num_processes=2, use_gpu=False).run(str(script), "--lr", 0.1) is None
    out = capfd.readouterr().out
    assert "[rank 0 node 0] script rank 0 of 2 argv=['--lr', '0.1']" in out
    assert "[rank 1 node 0] script rank 1 of 2 argv=['--lr', '0.1']" in out


def test_a_failing_script_raises(script: Path, capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RankFailedError) as info:
        TorchDistributor(num_processes=2, use_gpu=False).run(str(script), "--fail-rank", "1")
    assert info.value.rank == 1 and info.value.exit_code == 3
    assert "[rank 1 node 0] giving up" in capfd.readouterr().out


def _deepspeed_steps(steps: int) -> dict:
    import deepspeed
    import torch

    config = deepspeed_config()
    model = torch.nn.Linear(8, 1)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                                           config=config)
    gen = torch.Generator().manual_seed(runtime.rank())
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen)
        loss = (engine(x) - x.sum(1, keepdim=True)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    return {"config": config, "world": engine.world_size, "zero": engine.zero_optimization_stage(),
            "loss": float(loss)}


def test_deepspeed_distributor_hands_the_config_to_every_rank(script: Path,
                                                              capfd: pytest.CaptureFixture[str]) -> None:
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True}
    distributor = DeepspeedTorchDistributor(numGpus=2, nnodes=1, localMode=True, useGpu=False,
                                            deepspeedConfig=config)
    out = distributor.run(_deepspeed_steps, 3)
    assert out["config"] == config and out["world"] == 2 and out["zero"] == 1
    assert math.isfinite(out["loss"])

    assert distributor.run(str(script), "--epochs", "1") is None
    logged = capfd.readouterr().out
    expected = f"argv=['--epochs', '1', '--deepspeed', '--deepspeed_config', '{distributor._config_path}']"
    assert f"[rank 1 node 0] script rank 1 of 2 {expected}" in logged


def test_arguments_are_checked_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(SGPUConfigError, match="num_processes"):
        TorchDistributor(num_processes=0)
    with pytest.raises(SGPUConfigError, match="numGpus"):
        DeepspeedTorchDistributor(numGpus=0)
    with pytest.raises(SGPUConfigError, match="deepspeedConfig"):
        DeepspeedTorchDistributor(numGpus=1, deepspeedConfig=str(tmp_path / "missing.json"))
    with pytest.raises(SGPUConfigError, match="path"):
        TorchDistributor(num_processes=1, use_gpu=False).run(str(tmp_path / "missing.py"))
    with pytest.raises(SGPUConfigError, match="kwargs"):
        TorchDistributor(num_processes=1, use_gpu=False).run(str(tmp_path / "x.py"), lr=1)
    assert deepspeed_config() is None, "outside a DeepSpeed job there is no config"
