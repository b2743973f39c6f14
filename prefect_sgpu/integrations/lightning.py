"""Lightning's ``Trainer`` in a prefect-sgpu job: progress, reclaim notices and checkpoints that
survive the nodes.

::

    import lightning.pytorch as pl
    from prefect_sgpu import runtime
    from prefect_sgpu.integrations.lightning import SGPUCheckpoints

    @gpu_task(gpus=4, nodes=2)
    def train() -> float:
        checkpoints = SGPUCheckpoints(every_n_steps=50, keep=2)
        trainer = pl.Trainer(max_steps=1000, num_nodes=runtime.world_size() // runtime.local_world_size(),
                             devices=runtime.local_world_size(), strategy="ddp", callbacks=[checkpoints],
                             enable_checkpointing=False)
        trainer.fit(model, data, ckpt_path=checkpoints.resume_from())

On every rank, the callback:

- reports each optimizer step to ``runtime.progress(global_step, total=max_steps)`` (the task's
  progress artifact, the hang watchdog, the straggler watch);
- saves a checkpoint (``trainer.save_checkpoint``: weights, optimizers, schedulers and the loops'
  position, so a resume continues mid-epoch) every ``every_n_steps`` optimizer steps, and at
  once, on every rank at the same step, when any node of the job has a reclaim notice;
- seals each checkpoint as the step folder ``step-0000000N`` of the job's checkpoint location
  (``runtime.checkpoint_uri()``; uploaded from every node on ``s3://``) once it is stored, keeping
  the last ``keep``, as :class:`~prefect_sgpu.pipeline.checkpoint.Checkpointer` does;
- ``resume_from()`` (collective) is the newest complete checkpoint whose files match its sealed
  manifest, fetched onto every node, for ``trainer.fit(..., ckpt_path=...)``; None for a fresh
  start. Lightning's own ``ModelCheckpoint`` may run beside it; its files are not sealed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from prefect_sgpu import runtime
from prefect_sgpu.checkpoints import step_dir_name
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.pipeline.checkpoint import SealedSteps

__all__ = ["SGPUCheckpoints"]

#: the file a sealed step folder holds (``trainer.save_checkpoint``'s)
CHECKPOINT_FILE = "lightning.ckpt"


class SGPUCheckpoints(Callback):  # type: ignore[misc]
    """Connects a Lightning ``Trainer`` to the job (see the module docstring). Create it on every
    rank with the same arguments."""

    def __init__(self, folder: str | Path | None = None, *, every_n_steps: int = 100, keep: int = 2) -> None:
        if every_n_steps < 1:
            raise SGPUConfigError("every_n_steps", every_n_steps, "an integer >= 1 (optimizer steps between "
                                                                  "checkpoints)")
        self.every_n_steps = every_n_steps
        self.steps = SealedSteps(folder, keep=keep)
        self._saved_at: int | None = None

    def resume_from(self) -> str | None:
        """The newest complete, verified checkpoint for ``trainer.fit(..., ckpt_path=...)``, or None
        (collective: every rank calls it)."""
        step = self.steps.newest_verified()
        return None if step is None else str(self.steps.folder / step_dir_name(step) / CHECKPOINT_FILE)

    # -- the trainer's hooks --------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        runtime.progress(trainer.global_step, total=_total(trainer), force=True)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        runtime.progress(step, total=_total(trainer))
        reclaim = self.steps.reclaim_due(step)  # collective: every rank, every batch
        if step > 0 and step != self._saved_at and (reclaim or step % self.every_n_steps == 0):
            self.save(trainer, step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        runtime.progress(trainer.global_step, force=True)

    def save(self, trainer: Any, step: int) -> Path:
        """Write and seal the checkpoint of ``step`` (collective: every rank calls it)."""
        name = step_dir_name(step)
        target = self.steps.fresh_step_folder(name)
        trainer.save_checkpoint(str(target / CHECKPOINT_FILE))  # rank 0 writes, every rank takes part
        self.steps.seal(step, name, None)
        self._saved_at = step
        runtime.progress(step, force=True)
        return target


def _total(trainer: Any) -> int | None:
    steps = trainer.max_steps
    return int(steps) if steps is not None and steps > 0 else None
