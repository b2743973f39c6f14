"""Checkpoints are complete or ignored; resume restores model, optimizer, extra state and RNG.

These run in one process (no process group: barriers are no-ops) on a plain module;
the sharded FSDP2 / DeepSpeed versions run on real gloo ranks in test_strategies.py.
"""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.pipeline.checkpoint import MARKER, Checkpointer, complete_steps, latest_complete_step
from prefect_sgpu.pipeline.strategies import Wrapped


def _wrapped(seed: int = 0) -> Wrapped:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    return Wrapped("ddp", model, model, torch.optim.AdamW(model.parameters(), lr=0.1), torch.device("cpu"),
                   torch.float32)


def _train_step(w: Wrapped) -> None:
    loss = w.model(torch.randn(8, 4)).pow(2).mean()
    w.zero_grad()
    w.backward(loss)
    w.step()


def test_resume_skips_a_half_written_newer_checkpoint(tmp_path: Path) -> None:
    w = _wrapped()
    ckpt = Checkpointer(w, tmp_path, every=2, keep=3)
    for step in range(1, 5):
        _train_step(w)
        ckpt.maybe_save(step, {"loader": {"sample_in_epoch": step * 8}})
    assert complete_steps(tmp_path) == [2, 4]
    saved = {k: v.clone() for k, v in w.module.state_dict().items()}

    # a newer checkpoint whose writer died before the marker: files there, no COMPLETE
    for _ in range(2):
        _train_step(w)
    partial = tmp_path / "step-00000006"
    partial.mkdir()
    torch.save({"model": w.module.state_dict()}, partial / "model.pt")
    (partial / "extra-rank-00000.pt").write_bytes(b"truncated")
    assert latest_complete_step(tmp_path) == 4

    fresh = _wrapped(seed=1)
    step, extra = Checkpointer(fresh, tmp_path, every=2, keep=3).restore()
    assert step == 4 and extra == {"loader": {"sample_in_epoch": 32}}
    for key, value in fresh.module.state_dict().items():
        assert torch.equal(value, saved[key]), key
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 4, "optimizer state came back too"


def test_a_marker_written_last_is_what_makes_a_checkpoint_count(tmp_path: Path) -> None:
    w = _wrapped()
    path = Checkpointer(w, tmp_path, every=1).save(3, {"note": "x"})
    info = json.loads((path / MARKER).read_text())
    assert info["step"] == 3 and info["strategy"] == "ddp" and info["world_size"] == 1
    assert not list(path.glob("*.tmp")), "no temporary files remain"
    (path / MARKER).unlink()
    assert Checkpointer(_wrapped(), tmp_path).restore() == (0, {}), "without its marker it is not a checkpoint"


def test_keeps_the_last_k_and_clears_stale_partials(tmp_path: Path) -> None:
    w = _wrapped()
    stale = tmp_path / "step-00000001"
    stale.mkdir(parents=True)
    (stale / "model.pt").write_bytes(b"from a crashed attempt")
    ckpt = Checkpointer(w, tmp_path, every=5, keep=2)
    assert [s for s in range(0, 12) if ckpt.due(s)] == [5, 10]
    for step in range(1, 21):
        _train_step(w)
        ckpt.maybe_save(step)
    assert complete_steps(tmp_path) == [15, 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000015", "step-00000020"]


def test_rewriting_a_step_replaces_what_a_dead_attempt_left(tmp_path: Path) -> None:
    w = _wrapped()
    left = tmp_path / "step-00000002"
    left.mkdir(parents=True)
    (left / "junk.bin").write_bytes(b"x")
    Checkpointer(w, tmp_path, every=2).save(2)
    assert not (left / "junk.bin").exists()
    assert (left / MARKER).is_file()


def test_rng_state_is_restored(tmp_path: Path) -> None:
    w = _wrapped()
    ckpt = Checkpointer(w, tmp_path, every=1)
    torch.manual_seed(7)
    random.seed(7)
    ckpt.save(1)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(99)
    random.seed(99)
    assert ckpt.restore()[0] == 1
    got = (torch.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]


def test_checkpoint_dir_defaults_to_the_runtime_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGPU_CHECKPOINT_DIR", str(tmp_path / "ckpts"))
    ckpt = Checkpointer(_wrapped(), every=1)
    assert ckpt.folder == tmp_path / "ckpts" and ckpt.folder.is_dir()


@pytest.mark.parametrize(("field", "kwargs"), [("every", {"every": 0}), ("keep", {"keep": 0})])
def test_bad_settings_fail_before_anything_is_written(tmp_path: Path, field: str, kwargs: dict) -> None:
    with pytest.raises(SGPUConfigError) as info:
        Checkpointer(_wrapped(), tmp_path / "never", **kwargs)
    assert info.value.field == field
    assert not (tmp_path / "never").exists()


class _Planted:
    """A pickle that creates ``marker`` when it is loaded (what a store writer would plant)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def test_a_tampered_checkpoint_file_is_refused_and_never_runs(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A planted pickle differs from the sealed manifest: the step is skipped. Even sealed (by a key
    holder), the weights-only loader refuses it before it runs."""
    from prefect_sgpu.checkpoints import Location
    from prefect_sgpu.errors import CheckpointRefused

    w = _wrapped()
    ckpt = Checkpointer(w, tmp_path / "ckpt", every=1, keep=2)
    _train_step(w)
    ckpt.save(1, {"note": "fine"})
    marker = tmp_path / "pwned"
    location = Location(tmp_path / "ckpt")
    for name in ("model.pt", "extra-rank-00000.pt"):
        good = (tmp_path / "ckpt" / "step-00000001" / name).read_bytes()
        torch.save({"model": _Planted(marker)}, tmp_path / "ckpt" / "step-00000001" / name)
        assert Checkpointer(_wrapped(seed=1), tmp_path / "ckpt", every=1).restore() == (0, {})
        assert f"{name} differs from its sealed manifest" in caplog.text
        location.put_marker("step-00000001", {"step": 1})  # sealed over the planted file
        with pytest.raises(CheckpointRefused, match=name):
            Checkpointer(_wrapped(seed=1), tmp_path / "ckpt", every=1).restore()
        assert not marker.exists(), "the planted pickle ran"
        (tmp_path / "ckpt" / "step-00000001" / name).write_bytes(good)
        location.put_marker("step-00000001", {"step": 1})
    step, extra = Checkpointer(_wrapped(seed=1), tmp_path / "ckpt", every=1).restore()
    assert (step, extra) == (1, {"note": "fine"}), "the untouched checkpoint still restores (RNG states included)"


def test_a_tampered_dcp_metadata_is_refused_before_dcp_reads_it(tmp_path: Path) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    from prefect_sgpu.errors import CheckpointRefused
    from prefect_sgpu.pipeline.safe_load import check_dcp_metadata

    model = nn.Linear(4, 2)
    with pytest.warns(UserWarning):  # one process, no process group: DCP says so
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    check_dcp_metadata(tmp_path / "dcp" / ".metadata")  # DCP's own metadata passes
    marker = tmp_path / "pwned"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(CheckpointRefused, match="builtins.open|io.open"):
        check_dcp_metadata(tmp_path / "dcp" / ".metadata")
    assert not marker.exists()


class _ByName:
    """Pickles as ``getattr(target, name)``, as Python 3.11.0 to 3.11.2 pickle an enum member."""

    def __init__(self, target: Any, name: str) -> None:
        self.target, self.name = target, name

    def __reduce__(self) -> tuple:
        return (getattr, (self.target, self.name))


def test_dcp_metadata_written_by_a_python_that_pickles_enum_members_by_name_passes_and_nothing_else_does(
        tmp_path: Path) -> None:
    """A node's Python of another micro version (uv's, the image's) writes the metadata another driver
    or node reads: DCP's memory-format enum arrives as ``getattr(_MEM_FORMAT_ENCODING, name)``."""
    import pickle

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from prefect_sgpu.errors import CheckpointRefused
    from prefect_sgpu.pipeline.safe_load import check_dcp_metadata

    member = next(iter(_MEM_FORMAT_ENCODING))
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps({"format": _ByName(_MEM_FORMAT_ENCODING, member.name)}))
    assert b"getattr" in path.read_bytes()
    check_dcp_metadata(path)
    assert pickle.loads(path.read_bytes())["format"] is member
    for target, name in ((_MEM_FORMAT_ENCODING, "__class__"), (torch.Size, "__init__"), (torch.Size, "mro")):
        path.write_bytes(pickle.dumps(_ByName(target, name)))
        with pytest.raises(CheckpointRefused, match=r"builtins\.getattr\("):
            check_dcp_metadata(path)


def test_a_planted_dcp_entry_is_refused_and_never_runs(tmp_path: Path) -> None:
    """DCP keeps non-tensor entries (optimizer settings) as pickles; its default planner loads them
    with weights_only=False. The restore's planner refuses one that would run code."""
    import torch.distributed.checkpoint as dcp

    from prefect_sgpu.errors import CheckpointRefused
    from prefect_sgpu.pipeline.safe_load import check_dcp_metadata, load_dcp

    marker = tmp_path / "pwned"
    model = nn.Linear(4, 2)
    with pytest.warns(UserWarning):  # one process, no process group: DCP says so
        dcp.save({"model": model.state_dict(), "extra": {"lr": 0.1, "planted": _Planted(marker)}},
                 checkpoint_id=str(tmp_path / "dcp"))
    assert not marker.exists()
    check_dcp_metadata(tmp_path / "dcp" / ".metadata")  # the metadata itself is DCP's own
    state = {"model": nn.Linear(4, 2).state_dict(), "extra": {"lr": 0.0, "planted": None}}
    with pytest.warns(UserWarning), pytest.raises(CheckpointRefused, match="planted.*refused"):
        load_dcp(state, tmp_path / "dcp")
    assert not marker.exists()

    clean = {"model": nn.Linear(4, 2).state_dict(), "extra": {"lr": 0.0}}
    with pytest.warns(UserWarning):
        load_dcp(clean, tmp_path / "dcp")
    assert clean["extra"]["lr"] == 0.1 and torch.equal(clean["model"]["weight"], model.weight.detach())


def test_an_async_save_returns_before_writing_and_keeps_the_state_of_its_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect_sgpu.pipeline import checkpoint as checkpoint_mod

    release = threading.Event()
    writing = threading.Event()
    real = checkpoint_mod._atomic_torch_save

    def slow_write(obj: object, path: Path) -> None:  # the disk (or S3) being slow
        writing.set()
        assert release.wait(60)
        real(obj, path)

    monkeypatch.setattr(checkpoint_mod, "_atomic_torch_save", slow_write)
    w = _wrapped()
    ckpt = Checkpointer(w, tmp_path, every=1, async_save=True)
    _train_step(w)
    saved = {k: v.clone() for k, v in w.module.state_dict().items()}
    ckpt.save(1, {"note": "step one"})
    assert writing.wait(30), "the background save did not start"
    assert complete_steps(tmp_path) == [], "sealed before its files were written"
    _train_step(w)  # the loop goes on while the checkpoint is written
    release.set()
    ckpt.wait()
    assert complete_steps(tmp_path) == [1]

    fresh = _wrapped(seed=1)
    assert Checkpointer(fresh, tmp_path, async_save=True).restore() == (1, {"note": "step one"})
    for key, value in fresh.module.state_dict().items():
        assert torch.equal(value, saved[key]), f"{key}: the checkpoint holds a later step's weights"


def test_a_failed_async_save_raises_in_the_next_save_and_is_not_sealed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect_sgpu.pipeline import checkpoint as checkpoint_mod

    real = checkpoint_mod._atomic_torch_save

    def fails_on_step_2(obj: object, path: Path) -> None:
        if path.parent.name == "step-00000002":
            raise OSError(28, "No space left on device")
        real(obj, path)

    monkeypatch.setattr(checkpoint_mod, "_atomic_torch_save", fails_on_step_2)
    w = _wrapped()
    ckpt = Checkpointer(w, tmp_path, every=1, async_save=True)
    ckpt.save(1)
    ckpt.save(2)
    with pytest.raises(OSError, match="No space left"):
        ckpt.save(3)
    assert complete_steps(tmp_path) == [1]
