"""Checkpoints restored by a world of another size (elastic jobs), and the batch/learning-rate rules.

The FSDP2 test runs real gloo ranks on the local compute: 3 ranks save a sharded DCP checkpoint,
then 2 and 4 ranks restore it. The rest run in one process.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from prefect_sgpu import distributed
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.pipeline.checkpoint import Checkpointer
from prefect_sgpu.pipeline.strategies import Wrapped
from prefect_sgpu.pipeline.world_change import WorldChange, batch_plan, check_restorable, scaled_lr


def _fsdp_phase(folder: str, save: bool) -> dict[str, Any]:
    """Every rank: a tiny FSDP2 model (rows that 2, 3 and 4 ranks split unevenly) trained 3 steps and
    saved (``save``), or a fresh one restored; returns the full weights and optimizer state on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from prefect_sgpu import runtime
    from prefect_sgpu.pipeline.strategies import wrap

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(5, 7), nn.Linear(7, 5)])
            self.head = nn.Linear(5, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = torch.tanh(block(x))
            return self.head(x)

    torch.manual_seed(1 if save else 2)  # a restore starts from other weights than the saver's
    w = wrap(Tiny(), lambda params: torch.optim.AdamW(params, lr=0.05), strategy="fsdp")
    ckpt = Checkpointer(w, folder, every=3)
    step, extra, saved_extras, restored = 0, {}, [], None
    if save:
        torch.manual_seed(10 + runtime.rank())
        for step in range(1, 4):
            x = torch.randn(4, 5)
            loss = nn.functional.mse_loss(w.model(x), x.sum(dim=1, keepdim=True))
            w.zero_grad()
            w.backward(loss)
            w.step()
            ckpt.maybe_save(step, {"rank": runtime.rank(), "samples": 4 * step * runtime.world_size()})
    else:
        step, extra = ckpt.restore()
        saved_extras, restored = ckpt.saved_extras(), ckpt.restored.__dict__
    weights = w.full_state_dict()
    optim = get_optimizer_state_dict(w.module, w.optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    local_rows = w.module.blocks[0].weight.to_local().shape[0]
    return {"rank": runtime.rank(), "world": runtime.world_size(), "step": step, "extra": extra,
            "saved_extras": saved_extras, "restored": restored, "local_rows": local_rows,
            "weights": weights, "optim": optim["state"] if runtime.is_rank_zero() else None,
            "draw": torch.rand(1).item()}


@pytest.mark.e2e
def test_an_fsdp_checkpoint_saved_by_3_ranks_restores_in_2_and_in_4_ranks(tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpt")
    saved = distributed(gpus=3, mlflow=False)(_fsdp_phase).distributed(folder, save=True)
    assert [v["local_rows"] for v in saved] == [3, 3, 1], "7 rows sharded unevenly over 3 ranks"
    want, want_optim = saved[0]["weights"], saved[0]["optim"]
    for world, rows in ((2, [4, 3]), (4, [2, 2, 2, 1])):
        got = distributed(gpus=world, mlflow=False)(_fsdp_phase).distributed(folder, save=False)
        assert [v["local_rows"] for v in got] == rows, "the restore ran sharded in the new world"
        assert all(v["step"] == 3 for v in got)
        assert got[0]["restored"] == {"step": 3, "saved": 3, "now": world}
        assert set(got[0]["weights"]) == set(want)
        for name, value in want.items():
            assert torch.equal(got[0]["weights"][name], value), (world, name)
        for key, state in want_optim.items():  # AdamW's moments and step, resharded too
            for name, value in state.items():
                assert torch.equal(got[0]["optim"][key][name], value), (world, key, name)
        # per-rank state: rank 0's extra on every rank; every saved rank's extra on request
        assert all(v["extra"] == {"rank": 0, "samples": 36} for v in got), [v["extra"] for v in got]
        assert got[0]["saved_extras"] == [{"rank": r, "samples": 36} for r in range(3)]
        draws = [v["draw"] for v in got]
        assert len(set(draws)) == world, "each rank got a stream of its own, not rank 0's"


def _ddp(seed: int = 0) -> Wrapped:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    return Wrapped("ddp", model, model, torch.optim.AdamW(model.parameters(), lr=0.1), torch.device("cpu"),
                   torch.float32)


def test_a_ddp_checkpoint_of_another_world_size_restores_rank_zeros_copy_and_reseeds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One process plays rank 0 of a world of 3 that saves, then of a world of 2 that restores."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    w = _ddp()
    w.model(torch.randn(2, 4)).sum().backward()
    w.step()
    ckpt = Checkpointer(w, tmp_path, every=1)
    ckpt.save(1, {"loader": {"position": 12}})
    saved = {k: v.clone() for k, v in w.module.state_dict().items()}
    next_of_saved_stream = random.random()  # what a restore of the saved RNG state would draw first

    monkeypatch.setenv("WORLD_SIZE", "2")
    fresh = _ddp(seed=5)
    again = Checkpointer(fresh, tmp_path, every=1)
    assert again.restore() == (1, {"loader": {"position": 12}})
    assert again.restored == WorldChange(step=1, saved=3, now=2) and again.restored.changed
    for key, value in fresh.module.state_dict().items():
        assert torch.equal(value, saved[key]), key
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 1, "the optimizer state came back too"
    first = random.random()
    assert first != next_of_saved_stream, "the saved stream belongs to the old world's rank 0: not restored"
    Checkpointer(_ddp(seed=5), tmp_path, every=1).restore()
    assert random.random() == first, "the new stream is seeded from (step, rank): the same on a second resume"

    monkeypatch.setenv("WORLD_SIZE", "3")
    same = Checkpointer(_ddp(seed=5), tmp_path, every=1)
    same.restore()
    assert same.restored == WorldChange(step=1, saved=3, now=3) and not same.restored.changed


def _deepspeed_phase(folder: str, save: bool) -> dict[str, Any]:
    """Every rank: a DeepSpeed ZeRO stage 0 and a stage 2 model, trained 2 steps and saved (``save``),
    or fresh ones restored; returns rank 0's weights per stage, or the restore's refusal."""
    from prefect_sgpu.pipeline.strategies import wrap

    out: dict[str, Any] = {}
    for stage in (0, 2):
        torch.manual_seed(1 if save else 2)
        w = wrap(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)),
                 lambda params: torch.optim.AdamW(params, lr=0.05), strategy="deepspeed", zero_stage=stage,
                 micro_batch_size=4)
        ckpt = Checkpointer(w, f"{folder}/stage-{stage}", every=2)
        if save:
            for step in range(1, 3):
                x = torch.randn(4, 4)
                w.zero_grad()
                w.backward(nn.functional.mse_loss(w.model(x), x.sum(dim=1, keepdim=True)))
                w.step()
                ckpt.maybe_save(step, {"step": step})
        else:
            try:
                ckpt.restore()
            except SGPUConfigError as exc:
                out[f"refused-{stage}"] = str(exc)
                continue
        out[f"weights-{stage}"] = w.full_state_dict()
    return out


@pytest.mark.e2e
def test_a_deepspeed_checkpoint_of_2_ranks_restores_in_1_at_stage_0_and_is_refused_at_stage_2(
        tmp_path: Path) -> None:
    saved = distributed(gpus=2, mlflow=False)(_deepspeed_phase).distributed(str(tmp_path), save=True)[0]
    [got] = distributed(gpus=1, mlflow=False)(_deepspeed_phase).distributed(str(tmp_path), save=False)
    for name, value in saved["weights-0"].items():
        assert torch.equal(got["weights-0"][name], value), name
    refusal = got["refused-2"]
    assert "world_size=1 is not allowed: 2, the world size that wrote the DeepSpeed ZeRO stage 2" in refusal
    assert "ds_to_universal" in refusal


@pytest.mark.parametrize("stage, universal, refused", [
    (0, False, False), (1, False, True), (2, False, True), (3, False, True), (3, True, False)])
def test_deepspeed_restores_across_world_sizes_only_where_its_files_allow(
        stage: int, universal: bool, refused: bool) -> None:
    change = WorldChange(step=40, saved=4, now=2)
    check_restorable("deepspeed", WorldChange(step=40, saved=4, now=4), zero_stage=3)  # same world: fine
    check_restorable("fsdp", change)
    check_restorable("ddp", change)
    if not refused:
        check_restorable("deepspeed", change, zero_stage=stage, universal=universal)
        return
    with pytest.raises(SGPUConfigError) as err:
        check_restorable("deepspeed", change, zero_stage=stage, universal=universal)
    text = str(err.value)
    assert err.value.field == "world_size" and err.value.value == 2
    assert f"ZeRO stage {stage} checkpoint of step 40" in text and "4, the world size that wrote" in text
    assert "ds_to_universal" in text and "load_universal" in text and "'fsdp'" in text


def test_batch_plan_keeps_the_global_batch_and_lr_scales_with_the_world() -> None:
    assert batch_plan(96, 4, max_per_rank=32) == batch_plan(96, 4, 24)
    assert batch_plan(96, 4, 32).per_rank == 24 and batch_plan(96, 4, 32).accumulation == 1
    plan = batch_plan(96, 2, 32)
    assert (plan.per_rank, plan.accumulation) == (24, 2)
    plan = batch_plan(96, 3, 20)
    assert (plan.per_rank, plan.accumulation) == (16, 2)
    assert batch_plan(96, 1, 96) == batch_plan(96, 1, 100)
    with pytest.raises(SGPUConfigError, match="global_batch=96 .*multiple of the world size 5"):
        batch_plan(96, 5, 32)
    with pytest.raises(SGPUConfigError, match="max_per_rank=0"):
        batch_plan(96, 2, 0)
    assert scaled_lr(0.1, 2, 4) == pytest.approx(0.2)
    assert scaled_lr(0.1, 4, 1, "sqrt") == pytest.approx(0.05)
    assert scaled_lr(0.1, 4, 2, "none") == 0.1
    with pytest.raises(SGPUConfigError, match="rule='cubic'.*linear, sqrt, none"):
        scaled_lr(0.1, 2, 4, "cubic")
    with pytest.raises(SGPUConfigError, match="base_lr=-1"):
        scaled_lr(-1, 2, 4)


def test_ray_compute_refuses_min_max_nodes_saying_what_the_installed_ray_train_has() -> None:
    """Ray 2.60's Ray Train v2 has elastic workers; RayCompute does not map onto them and says so, naming
    the Ray Train call that would; with Ray Train v1 (RAY_TRAIN_V2_ENABLED=0) it says Ray has none."""
    import os
    import subprocess
    import sys

    from prefect_sgpu import spec
    from prefect_sgpu.ray.compute import RayTrainCompute

    job = spec.merge(spec.layer("call", gpus=4, nodes=(1, 2)))
    with pytest.raises(SGPUConfigError) as err:
        RayTrainCompute(address="127.0.0.1:1").plan(job, "run-1")
    text = str(err.value)
    assert err.value.field == "nodes" and "on RayCompute: elastic jobs" in text
    assert "Ray Train has elastic workers" in text and "does not map nodes=(min, max)" in text
    assert "ScalingConfig(num_workers=(2, 4))" in text and "nodes=(min, max) on LocalCompute" in text
    probe = ("from prefect_sgpu.ray.placement import ray_train_elastic; print(ray_train_elastic()[1])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RAY_TRAIN_V2_ENABLED": "0"})
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]
