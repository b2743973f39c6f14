"""DDP, FSDP2 and DeepSpeed ZeRO on real torch.distributed (gloo, 2 CPU ranks).

One job per strategy trains a tiny model through the same loop, checks the state is
sharded where the strategy shards it, and checks that training interrupted at a
checkpoint and resumed (from the newest *complete* checkpoint, with a half-written
newer one beside it) ends with exactly the weights of an uninterrupted run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from prefect_sgpu import distributed
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.pipeline.strategies import STRATEGIES, resolve_strategy

pytestmark = pytest.mark.e2e


def _train_and_resume(folder: str, total: int, stop_at: int, async_save: bool = False) -> dict[str, Any]:
    """On every rank: continuous run vs. run stopped at ``stop_at`` and resumed; same loop for all
    (``async_save``: every checkpoint written in the background)."""
    import torch
    from torch import nn

    from prefect_sgpu import runtime
    from prefect_sgpu.pipeline.checkpoint import Checkpointer, complete_steps
    from prefect_sgpu.pipeline.strategies import wrap

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = torch.tanh(block(x))
            return self.head(x)

    def build() -> Any:
        torch.manual_seed(0)  # same initial weights on every rank and in every phase
        return wrap(Tiny(), lambda params: torch.optim.AdamW(params, lr=0.05), micro_batch_size=16)

    def run(w: Any, ckpt: Checkpointer | None, start: int, end: int, losses: list[float]) -> None:
        w.train()
        for step in range(start, end):
            x = torch.randn(16, 8)  # the global RNG: a resume must restore it to see the same data
            y = x.sum(dim=1, keepdim=True)
            with w.autocast():
                loss = nn.functional.mse_loss(w.model(x), y)
            w.zero_grad()
            w.backward(loss)
            w.step()
            losses.append(loss.item())
            if ckpt is not None:
                ckpt.maybe_save(step + 1, {"losses": list(losses)})
        if ckpt is not None:
            ckpt.wait()  # the last checkpoint complete before anything reads it

    base = Path(folder)
    torch.manual_seed(100 + runtime.rank())
    w = build()
    strategy = w.strategy
    params = list(w.module.parameters())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    continuous: list[float] = []
    run(w, Checkpointer(w, base / "continuous", every=stop_at, async_save=async_save), 0, total, continuous)
    expected = w.full_state_dict()

    torch.manual_seed(100 + runtime.rank())
    w = build()
    interrupted: list[float] = []
    run(w, Checkpointer(w, base / "resumed", every=stop_at, keep=1, async_save=async_save), 0, stop_at, interrupted)
    del w
    if runtime.is_rank_zero():  # a newer checkpoint whose writer died half-way
        partial = base / "resumed" / f"step-{stop_at + 1:08d}"
        partial.mkdir()
        (partial / "extra-rank-00000.pt").write_bytes(b"half a file")
    torch.manual_seed(12345)  # a fresh process would start from other RNG state
    w = build()
    ckpt = Checkpointer(w, base / "resumed", every=stop_at, keep=1, async_save=async_save)
    start, extra = ckpt.restore()
    resumed = list(extra["losses"])
    run(w, ckpt, start, total, resumed)
    got = w.full_state_dict()
    same = None
    if runtime.is_rank_zero():
        same = all(torch.equal(expected[k], got[k]) for k in expected)
    files = sorted(p.name for p in (base / "resumed" / f"step-{total:08d}").iterdir())
    return {"strategy": strategy, "losses": continuous, "resumed_losses": resumed, "start": start,
            "same_weights": same, "local_params": local, "files": files,
            "complete": complete_steps(base / "resumed")}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_trains_and_resumes_from_complete_checkpoint(strategy: str, tmp_path: Path) -> None:
    job = distributed(gpus=2, mlflow=False, env={"SGPU_STRATEGY": strategy})(_train_and_resume)
    rank0, rank1 = job.distributed(folder=str(tmp_path), total=8, stop_at=4)

    assert rank0["strategy"] == strategy, "the strategy came from SGPU_STRATEGY, as gpu_task sets it"
    assert rank0["losses"][-1] < rank0["losses"][0] * 0.5, f"loss did not go down: {rank0['losses']}"
    assert rank0["start"] == 4, "resume took the newest complete checkpoint, not the partial step 5"
    assert rank0["same_weights"] is True, "interrupted + resumed training differs from a continuous run"
    assert rank0["resumed_losses"] == pytest.approx(rank0["losses"], rel=1e-5)
    assert rank0["complete"] == [8], "only the last checkpoint is kept (keep=1)"
    full = 2 * (8 * 8 + 8) + 8 + 1
    if strategy == "fsdp":
        assert rank0["local_params"] + rank1["local_params"] == full, "FSDP2 shards parameters across ranks"
        assert rank0["local_params"] < full
        assert {"dcp", "COMPLETE", "extra-rank-00000.pt", "extra-rank-00001.pt"} <= set(rank0["files"])
        shards = sorted(p.name for p in (tmp_path / "resumed" / "step-00000008" / "dcp").iterdir())
        assert "__0_0.distcp" in shards and "__1_0.distcp" in shards, shards
    elif strategy == "deepspeed":
        assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in rank0["files"]
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in rank0["files"], "ZeRO shards optimizer state"
    else:
        assert rank0["local_params"] == full
        assert "model.pt" in rank0["files"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_checkpoints_written_in_the_background_resume_to_the_same_weights(strategy: str, tmp_path: Path) -> None:
    job = distributed(gpus=2, mlflow=False, env={"SGPU_STRATEGY": strategy})(_train_and_resume)
    rank0, _ = job.distributed(folder=str(tmp_path), total=8, stop_at=4, async_save=True)
    assert rank0["start"] == 4, "resume took the newest complete checkpoint, not the partial step 5"
    assert rank0["same_weights"] is True, "interrupted + resumed training differs from a continuous run"
    assert rank0["resumed_losses"] == pytest.approx(rank0["losses"], rel=1e-5)
    assert rank0["complete"] == [8], "only the last checkpoint is kept (keep=1)"


def _killed_while_saving_in_the_background(folder: str) -> None:
    """Rank 1 is killed (SIGKILL) while its background thread writes step 4's files."""
    import signal

    import torch
    from torch import nn

    from prefect_sgpu import runtime
    from prefect_sgpu.pipeline import checkpoint as checkpoint_mod
    from prefect_sgpu.pipeline.strategies import wrap

    real = checkpoint_mod._atomic_torch_save

    def dies_on_step_4(obj: Any, path: Path) -> None:
        if runtime.rank() == 1 and path.parent.name == "step-00000004":
            os.kill(os.getpid(), signal.SIGKILL)
        real(obj, path)

    checkpoint_mod._atomic_torch_save = dies_on_step_4
    torch.manual_seed(0)
    w = wrap(nn.Linear(4, 2), lambda params: torch.optim.AdamW(params, lr=0.05), micro_batch_size=8)
    ckpt = checkpoint_mod.Checkpointer(w, folder, every=2, keep=3, async_save=True)
    for step in range(1, 7):
        loss = w.model(torch.randn(8, 4)).pow(2).mean()
        w.zero_grad()
        w.backward(loss)
        w.step()
        ckpt.maybe_save(step)
    ckpt.wait()


def test_a_rank_killed_during_a_background_save_leaves_the_previous_checkpoint_the_newest(tmp_path: Path) -> None:
    import torch
    from torch import nn

    from prefect_sgpu.pipeline.checkpoint import Checkpointer, complete_steps
    from prefect_sgpu.pipeline.strategies import Wrapped

    job = distributed(gpus=2, mlflow=False, max_recoveries=0)(_killed_while_saving_in_the_background)
    with pytest.raises(Exception, match="rank 1 .*signal|SIGKILL|Connection reset|Connection closed"):
        job.distributed(str(tmp_path))  # rank 1's death, or its peer's broken collective, whichever came first
    assert complete_steps(tmp_path) == [2], sorted(p.name for p in tmp_path.iterdir())
    model = nn.Linear(4, 2)
    fresh = Wrapped("ddp", model, model, torch.optim.AdamW(model.parameters(), lr=0.05), torch.device("cpu"),
                    torch.float32)
    assert Checkpointer(fresh, tmp_path).restore() == (2, {})


def _returns_while_saving(folder: str, fails: bool) -> None:
    """Both ranks return while step 1's checkpoint is still being written (a slow disk, which
    may end full)."""
    import time

    import torch
    from torch import nn

    from prefect_sgpu.pipeline import checkpoint as checkpoint_mod
    from prefect_sgpu.pipeline.strategies import wrap

    real = checkpoint_mod._atomic_torch_save

    def slow(obj: Any, path: Path) -> None:
        time.sleep(2.0)
        if fails:
            raise OSError(28, "No space left on device")
        real(obj, path)

    checkpoint_mod._atomic_torch_save = slow
    torch.manual_seed(0)
    w = wrap(nn.Linear(4, 2), lambda params: torch.optim.AdamW(params, lr=0.05), micro_batch_size=8)
    checkpoint_mod.Checkpointer(w, folder, every=1, async_save=True).save(1)  # no wait(): the rank ends it


@pytest.mark.parametrize("fails", [False, True], ids=["completes", "fails"])
def test_a_background_save_under_way_when_the_function_returns_ends_before_the_rank_does(
        tmp_path: Path, fails: bool) -> None:
    from prefect_sgpu.pipeline.checkpoint import complete_steps

    job = distributed(gpus=2, mlflow=False)(_returns_while_saving)
    if fails:  # the rank waited for it: its failure is the rank's
        with pytest.raises(OSError, match="No space left on device"):
            job.distributed(str(tmp_path), fails)
        assert complete_steps(tmp_path) == []
    else:
        job.distributed(str(tmp_path), fails)
        assert complete_steps(tmp_path) == [1]


def test_strategy_defaults_to_env_and_rejects_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGPU_STRATEGY", raising=False)
    assert resolve_strategy() == "ddp"
    monkeypatch.setenv("SGPU_STRATEGY", "fsdp")
    assert resolve_strategy() == "fsdp"
    assert resolve_strategy("deepspeed") == "deepspeed"
    with pytest.raises(SGPUConfigError, match="strategy='zero'.*ddp, fsdp, deepspeed"):
        resolve_strategy("zero")
    monkeypatch.setenv("SGPU_STRATEGY", "horovod")
    with pytest.raises(SGPUConfigError):
        resolve_strategy()
    assert os.environ["SGPU_STRATEGY"] == "horovod"


def _deepspeed_tamper(folder: str) -> dict[str, Any]:
    """Save a ZeRO-2 checkpoint, restore it, then plant a pickle in each file DeepSpeed reads and restore again."""
    import torch
    from torch import nn

    from prefect_sgpu.checkpoints import Location
    from prefect_sgpu.errors import CheckpointRefused
    from prefect_sgpu.pipeline.checkpoint import Checkpointer
    from prefect_sgpu.pipeline.strategies import wrap

    marker = Path(folder) / "pwned"
    location = Location(folder)

    class Planted:
        def __reduce__(self) -> tuple:
            return (open, (str(marker), "w"))

    def build() -> Any:
        torch.manual_seed(0)
        return wrap(nn.Linear(8, 1), lambda params: torch.optim.AdamW(params, lr=0.05), micro_batch_size=4,
                    zero_stage=2)

    w = build()
    loss = w.model(torch.randn(4, 8)).pow(2).mean()
    w.zero_grad()
    w.backward(loss)
    w.step()
    Checkpointer(w, folder, every=1).save(1, {"note": "fine"})
    step = Path(folder) / "step-00000001"
    restored = Checkpointer(build(), folder, every=1).restore()
    refusals = {}
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        good = (step / name).read_bytes()
        torch.save({"module": Planted(), "optimizer_state_dict": Planted()}, step / name)
        location.put_marker(step.name, {"step": 1})  # sealed over the planted file, as a key holder could
        try:
            Checkpointer(build(), folder, every=1).restore()
            refusals[name] = None
        except CheckpointRefused as exc:
            refusals[name] = str(exc)
        (step / name).write_bytes(good)
        location.put_marker(step.name, {"step": 1})
    return {"restored": restored, "refusals": refusals, "marker": marker.exists(),
            "again": Checkpointer(build(), folder, every=1).restore()}


def test_a_tampered_deepspeed_checkpoint_is_refused_and_never_runs(tmp_path: Path) -> None:
    job = distributed(gpus=1, mlflow=False, env={"SGPU_STRATEGY": "deepspeed"})(_deepspeed_tamper)
    [got] = job.distributed(folder=str(tmp_path))
    assert got["restored"] == (1, {"note": "fine"}), "DeepSpeed's own files pass the weights-only loader"
    for name, refusal in got["refusals"].items():
        assert refusal is not None, f"a planted pickle in {name} was loaded"
        assert name in refusal and "refused" in refusal
    assert got["marker"] is False, "the planted pickle ran"
    assert got["again"] == (1, {"note": "fine"}), "the restored files load again"
