"""Periodic checkpoints that are complete or ignored, and automatic resume.

Each checkpoint goes to its own step folder (``step-00000040/``). Every rank writes its
part — the whole model and optimizer from rank 0 for DDP, one shard per rank for FSDP2
(``torch.distributed.checkpoint``) and DeepSpeed ZeRO (``engine.save_checkpoint``) —
plus its own extra state (step, data-loader position, RNG). Then all ranks meet at a
barrier and rank 0 writes the ``COMPLETE`` marker, atomically (write to a temporary
name, then rename). Resume picks the newest folder that has the marker, so a job
killed while writing never resumes from half a checkpoint. Only the last ``keep``
complete checkpoints stay.

The folder defaults to ``runtime.checkpoint_dir()``, which ``gpu_task`` keys by flow
run, task and inputs: a Prefect retry of the same task finds the checkpoints of the
failed attempt. On several machines the folder must be on storage every node sees.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect_sgpu import runtime
from prefect_sgpu.errors import SGPUConfigError

if TYPE_CHECKING:
    from prefect_sgpu.pipeline.strategies import Wrapped

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def complete_steps(folder: str | Path) -> list[int]:
    """Steps with a complete checkpoint in ``folder``, oldest first."""
    root = Path(folder)
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / MARKER).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_complete_step(folder: str | Path) -> int | None:
    steps = complete_steps(folder)
    return steps[-1] if steps else None


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _dist_ready():
        import torch.distributed as dist

        dist.barrier()


def _from_rank_zero(value: Any) -> Any:
    """Rank 0's ``value`` on every rank, so all ranks act on the same decision."""
    if not _dist_ready():
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rng_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if runtime.uses_gpu():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and runtime.uses_gpu():
        torch.cuda.set_rng_state(state["cuda"])


def _atomic_torch_save(obj: Any, path: Path) -> None:
    import torch

    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class Checkpointer:
    """Saves ``wrapped`` every ``every`` steps into ``folder``; restores the newest complete one.

    Use it the same way on every rank::

        ckpt = Checkpointer(wrapped, every=10, keep=2)
        start, extra = ckpt.restore()              # (0, {}) on a fresh start
        for step in range(start, total):
            ...
            if ckpt.due(step + 1):
                ckpt.save(step + 1, {"loader": loader.state_dict()})

    ``save``/``maybe_save``/``restore`` are collective: every rank must call them.
    """

    def __init__(self, wrapped: "Wrapped", folder: str | Path | None = None, *, every: int = 10,
                 keep: int = 2) -> None:
        if every < 1:
            raise SGPUConfigError("every", every, "an integer >= 1 (steps between checkpoints)")
        if keep < 1:
            raise SGPUConfigError("keep", keep, "an integer >= 1 (complete checkpoints to keep)")
        self.wrapped = wrapped
        self.folder = Path(folder) if folder is not None else runtime.checkpoint_dir()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.every = every
        self.keep = keep

    # --- saving ------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """True when ``step`` is a multiple of ``every`` (build costly extra state only then)."""
        return step > 0 and step % self.every == 0

    def maybe_save(self, step: int, extra: dict[str, Any] | None = None) -> Path | None:
        """Save when ``step`` is due; returns the folder written, if any."""
        return self.save(step, extra) if self.due(step) else None

    def save(self, step: int, extra: dict[str, Any] | None = None) -> Path:
        """Write a checkpoint of ``step`` and mark it complete once every rank has written."""
        target = self.folder / step_dir_name(step)
        if runtime.is_rank_zero() and target.exists():  # left over from an attempt that died
            shutil.rmtree(target)
        _barrier()
        target.mkdir(parents=True, exist_ok=True)
        self._save_training_state(target)
        state = {"step": step, "extra": extra or {}, "rng": _rng_state()}
        _atomic_torch_save(state, target / f"extra-rank-{runtime.rank():05d}.pt")
        _barrier()  # every rank's part is on disk
        if runtime.is_rank_zero():
            info = {"step": step, "strategy": self.wrapped.strategy, "world_size": runtime.world_size(),
                    "written_at": time.time()}
            tmp = target / (MARKER + ".tmp")
            tmp.write_text(json.dumps(info))
            os.replace(tmp, target / MARKER)
            self._prune(step)
        _barrier()
        return target

    def _save_training_state(self, target: Path) -> None:
        w = self.wrapped
        if w.strategy == "deepspeed":
            w.engine.save_checkpoint(str(self.folder), tag=target.name, save_latest=False)
        elif w.strategy == "fsdp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optim_state = get_state_dict(w.module, w.optimizer)
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(target / "dcp"))
        elif runtime.is_rank_zero():  # DDP: every replica is the same, rank 0 writes it whole
            _atomic_torch_save({"model": w.module.state_dict(), "optimizer": w.optimizer.state_dict()},
                               target / "model.pt")

    def _prune(self, newest: int) -> None:
        """Keep the last ``keep`` complete checkpoints; drop older ones and stale partial folders."""
        complete = complete_steps(self.folder)
        kept = set(complete[-self.keep:])
        for child in self.folder.iterdir():
            match = _STEP_DIR.match(child.name)
            if not match:
                continue
            step = int(match.group(1))
            if step in kept:
                continue
            if step < newest or step in complete:
                shutil.rmtree(child, ignore_errors=True)

    # --- restoring ---------------------------------------------------------------

    def latest(self) -> int | None:
        """The newest complete step, as rank 0 sees it (the same answer on every rank)."""
        return _from_rank_zero(latest_complete_step(self.folder) if runtime.is_rank_zero() else None)

    def restore(self) -> tuple[int, dict[str, Any]]:
        """Load the newest complete checkpoint into the model and optimizer.

        Returns ``(step, extra)``: the step it was saved at and the extra state given to
        ``save``, or ``(0, {})`` when there is none. RNG states are restored too.
        """
        step = self.latest()
        if step is None:
            return 0, {}
        source = self.folder / step_dir_name(step)
        self._load_training_state(source)
        own = source / f"extra-rank-{runtime.rank():05d}.pt"
        state = self._load(own if own.exists() else source / "extra-rank-00000.pt")
        _set_rng_state(state["rng"])
        _barrier()
        return int(state["step"]), dict(state["extra"])

    def _load(self, path: Path) -> Any:
        import torch

        return torch.load(path, map_location="cpu", weights_only=False)

    def _load_training_state(self, source: Path) -> None:
        w = self.wrapped
        if w.strategy == "deepspeed":
            path, _ = w.engine.load_checkpoint(str(self.folder), tag=source.name)
            if path is None:
                raise FileNotFoundError(f"DeepSpeed found no checkpoint in {source}")
        elif w.strategy == "fsdp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_state, optim_state = get_state_dict(w.module, w.optimizer)
            state = {"model": model_state, "optimizer": optim_state}
            dcp.load(state, checkpoint_id=str(source / "dcp"))
            set_state_dict(w.module, w.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        else:
            state = self._load(source / "model.pt")
            w.module.load_state_dict(state["model"])
            w.optimizer.load_state_dict(state["optimizer"])
