"""Hugging Face ``transformers.Trainer`` in a prefect-sgpu job: progress, reclaim notices and
checkpoints that survive the nodes.

::

    from transformers import Trainer, TrainingArguments
    from prefect_sgpu.integrations.hf import SGPUCallback

    @gpu_task(gpus=4, nodes=2)
    def fine_tune() -> float:
        callback = SGPUCallback(keep=2)
        args = TrainingArguments(output_dir=callback.output_dir, save_strategy="steps", save_steps=50, ...)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
        trainer.train(resume_from_checkpoint=callback.resume_from())
        ...

What the callback does, on every rank:

- **progress**: each optimizer step reaches ``runtime.progress(global_step, total=max_steps)``, so
  the task's progress artifact follows ``global_step``, the hang watchdog sees the rank alive and
  the straggler watch measures its step rate;
- **reclaim notices**: when any node of the job is told it will be reclaimed, every rank agrees
  on it at the same step and the trainer saves a checkpoint at the end of that step;
- **checkpoints**: ``output_dir`` is the job's checkpoint location (``runtime.checkpoint_uri()``:
  kept across relaunches and Prefect retries; on ``s3://`` each node's stage of it). Each
  checkpoint the trainer writes (``checkpoint-N``) becomes the sealed step folder ``step-0000000N``
  once every rank's files are stored: every node's files are uploaded where the location is
  remote, and a marker with the sealed manifest of all of them is written last, as
  :class:`~prefect_sgpu.pipeline.checkpoint.Checkpointer` does. Only the last ``keep`` stay.
- **resume**: ``resume_from()`` (collective) is the newest complete checkpoint whose files match
  its sealed manifest, fetched onto every node, or None for a fresh start: pass it to
  ``trainer.train(resume_from_checkpoint=...)``. A half-written or tampered checkpoint is skipped
  with a warning.

The trainer's own rotation (``save_total_limit``) and ``load_best_model_at_end`` name
``checkpoint-N`` folders, which do not stay: both are refused when the trainer starts.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from prefect_sgpu import runtime
from prefect_sgpu.checkpoints import step_dir_name
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.pipeline.checkpoint import SealedSteps
from prefect_sgpu.pipeline.collectives import barrier

__all__ = ["SGPUCallback"]

#: how ``transformers.Trainer`` names the checkpoint of step N in its ``output_dir``
TRAINER_FOLDER = "checkpoint-{step}"


class SGPUCallback(TrainerCallback):  # type: ignore[misc]
    """Connects a ``transformers.Trainer`` to the job (see the module docstring). Create it on every
    rank, after the process group exists (``runtime.init_process_group()``), or before any
    distributed call when the trainer creates the group itself."""

    def __init__(self, folder: str | Path | None = None, *, keep: int = 2) -> None:
        self.steps = SealedSteps(folder, keep=keep)

    @property
    def output_dir(self) -> str:
        """The trainer's ``output_dir``: this node's folder of the job's checkpoint location."""
        return str(self.steps.folder)

    def resume_from(self) -> str | None:
        """The newest complete, verified checkpoint for ``trainer.train(resume_from_checkpoint=...)``,
        or None (collective: every rank calls it)."""
        step = self.steps.newest_verified()
        return None if step is None else str(self.steps.folder / step_dir_name(step))

    # -- the trainer's events -------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if Path(args.output_dir).resolve() != self.steps.folder.resolve():
            raise SGPUConfigError("TrainingArguments.output_dir", args.output_dir,
                                  f"{self.output_dir} (SGPUCallback.output_dir): the job's checkpoint location")
        if getattr(args, "save_total_limit", None):
            raise SGPUConfigError("TrainingArguments.save_total_limit", args.save_total_limit,
                                  "None: SGPUCallback(keep=...) keeps the newest complete checkpoints")
        if getattr(args, "load_best_model_at_end", False):
            raise SGPUConfigError("TrainingArguments.load_best_model_at_end", True,
                                  "False: checkpoints are kept by step (SGPUCallback(keep=...))")
        _plain_cpu_device(args)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        runtime.progress(state.global_step, total=state.max_steps or None, force=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        runtime.progress(state.global_step, total=state.max_steps or None)
        if self.steps.reclaim_due(state.global_step):  # collective: every rank, every step
            control.should_save = True
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The trainer wrote ``checkpoint-N`` on every rank: make it step ``N``'s folder and seal it."""
        step = state.global_step
        written = Path(args.output_dir) / TRAINER_FOLDER.format(step=step)
        name = step_dir_name(step)
        barrier()  # every rank's files of checkpoint-N are written
        if self.steps.clears():
            target = self.steps.folder / name
            if target.exists():  # what an attempt that died while sealing this step left
                shutil.rmtree(target)
            if written.is_dir():
                written.rename(target)
            else:
                target.mkdir(parents=True)
        self.steps.seal(step, name, None)
        runtime.progress(step, force=True)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        runtime.progress(state.global_step, force=True)


def _plain_cpu_device(args: Any) -> None:
    """CPU ranks: ``cpu``, not ``cpu:0``. accelerate names a multi-process CPU rank's device ``cpu:0``,
    and the trainer loads a checkpoint's optimizer with ``map_location=args.device``, which torch
    refuses for ``cpu:0`` ("don't know how to restore data location"): a CPU job could not resume.
    The same device, named as torch's loader accepts it (the arguments' cached device)."""
    import torch

    device = args.device
    if device.type == "cpu" and device.index is not None:
        args.__dict__["_setup_devices"] = torch.device("cpu")
