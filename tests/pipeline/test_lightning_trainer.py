"""Lightning's ``Trainer`` with ``SGPUCheckpoints`` on a real two-node job: a reclaim notice saves
at once on every rank, checkpoints are sealed at the job's location, and the next attempt resumes
from the newest complete one, mid-epoch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prefect_sgpu import distributed, runtime
from prefect_sgpu.pipeline.checkpoint import complete_steps

pytestmark = pytest.mark.e2e

MAX_STEPS, EVERY = 6, 4


def _fit(notice_before: int | None, fail_after: int | None) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from prefect_sgpu.integrations.lightning import SGPUCheckpoints
    from prefect_sgpu.runtime import PREEMPT_FILE

    runtime.init_process_group()
    torch.manual_seed(0)

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)
    notice = Path(runtime._job_dir() or ".") / PREEMPT_FILE
    ran: list[int] = []

    class Faults(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if runtime.rank() == 0 and notice_before is not None:
                if trainer.global_step + 1 == notice_before:
                    notice.write_text("spot interruption notice (test)")  # what the node writes
                elif notice.exists():
                    notice.unlink()  # handled: the job is not relaunched for it

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            ran.append(trainer.global_step)
            if runtime.rank() == 1 and trainer.global_step == fail_after:
                raise RuntimeError(f"loss is nan after step {trainer.global_step}")

    checkpoints = SGPUCheckpoints(every_n_steps=EVERY, keep=2)
    resume = checkpoints.resume_from()
    trainer = pl.Trainer(max_steps=MAX_STEPS, accelerator="cpu", devices=runtime.local_world_size(),
                         num_nodes=runtime.world_size() // runtime.local_world_size(), strategy="ddp",
                         callbacks=[Faults(), checkpoints], enable_checkpointing=False, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(), data, ckpt_path=resume)
    progress = Path(runtime._job_dir() or ".") / runtime.PROGRESS_DIR / f"rank-{runtime.rank()}"
    return {"resumed_from": Path(resume).parent.name if resume else None, "ran": ran,
            "global_step": trainer.global_step, "progress": progress.read_text().split()[1:3]}


def test_a_lightning_trainer_saves_on_a_reclaim_notice_seals_its_checkpoints_and_a_retry_resumes(
        tmp_path: Path) -> None:
    location = tmp_path / "checkpoints"
    job = distributed(gpus=2, nodes=2, mlflow=False, env={"SGPU_CHECKPOINT_URI": str(location)})(_fit)

    with pytest.raises(RuntimeError, match="loss is nan after step 5"):  # rank 1's own exception
        job.distributed(3, 5)
    # step 3 on the notice (every rank at once), step 4 every 4 steps; step 5 died
    assert complete_steps(location) == [3, 4], sorted(p.name for p in location.iterdir())

    values = job.distributed(None, None)
    assert [v["resumed_from"] for v in values] == ["step-00000004"] * 2
    assert [v["ran"] for v in values] == [[5, 6]] * 2, "only the steps after the checkpoint ran again"
    assert [v["global_step"] for v in values] == [MAX_STEPS] * 2
    assert values[0]["progress"] == [str(MAX_STEPS), str(MAX_STEPS)], "progress follows global_step of max_steps"
    assert complete_steps(location) == [3, 4]


def test_every_n_steps_below_one_is_refused(tmp_path: Path) -> None:
    from prefect_sgpu.errors import SGPUConfigError
    from prefect_sgpu.integrations.lightning import SGPUCheckpoints

    with pytest.raises(SGPUConfigError, match="every_n_steps"):
        SGPUCheckpoints(tmp_path, every_n_steps=0)
