"""``transformers.Trainer`` with ``SGPUCallback`` on a real two-node job: progress follows
``global_step``, a reclaim notice saves at once on every rank, checkpoints are sealed at the
job's location, and the next attempt resumes from the newest complete one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prefect_sgpu import distributed, runtime
from prefect_sgpu.pipeline.checkpoint import complete_steps

pytestmark = pytest.mark.e2e

MAX_STEPS, SAVE_STEPS = 6, 4


def _fine_tune(notice_before: int | None, fail_after: int | None) -> dict[str, Any]:
    """A GPT-2 built from a config (nothing downloaded), trained by ``transformers.Trainer``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from prefect_sgpu.integrations.hf import SGPUCallback
    from prefect_sgpu.runtime import PREEMPT_FILE

    runtime.init_process_group()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    tokens = torch.randint(0, 32, (64, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    callback = SGPUCallback(keep=2)
    resume = callback.resume_from()
    notice = Path(runtime._job_dir() or ".") / PREEMPT_FILE
    ran: list[int] = []

    class Faults(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if runtime.rank() == 0 and notice_before is not None:
                if state.global_step + 1 == notice_before:
                    notice.write_text("spot interruption notice (test)")  # what the node writes
                elif notice.exists():
                    notice.unlink()  # handled: the job is not relaunched for it

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ran.append(state.global_step)
            if runtime.rank() == 1 and state.global_step == fail_after:
                raise RuntimeError(f"loss is nan after step {state.global_step}")

    args = TrainingArguments(output_dir=callback.output_dir, max_steps=MAX_STEPS, save_strategy="steps",
                             save_steps=SAVE_STEPS, per_device_train_batch_size=2, report_to=[], use_cpu=True,
                             logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Faults(), callback])
    trainer.train(resume_from_checkpoint=resume)
    progress = Path(runtime._job_dir() or ".") / runtime.PROGRESS_DIR / f"rank-{runtime.rank()}"
    return {"resumed_from": Path(resume).name if resume else None, "ran": ran,
            "global_step": trainer.state.global_step, "progress": progress.read_text().split()[1:3]}


def test_a_trainer_saves_on_a_reclaim_notice_seals_its_checkpoints_and_a_retry_resumes(tmp_path: Path) -> None:
    location = tmp_path / "checkpoints"
    job = distributed(gpus=2, nodes=2, mlflow=False, env={"SGPU_CHECKPOINT_URI": str(location)})(_fine_tune)

    with pytest.raises(RuntimeError, match="loss is nan after step 5"):  # rank 1's own exception
        job.distributed(3, 5)
    # step 3 on the notice (every rank at once), step 4 on the trainer's own schedule; step 5 died
    assert complete_steps(location) == [3, 4], sorted(str(p.relative_to(location)) for p in location.rglob("*"))
    assert not list(location.glob("checkpoint-*")), "every trainer checkpoint became a sealed step folder"

    values = job.distributed(None, None)
    assert [v["resumed_from"] for v in values] == ["step-00000004"] * 2
    assert [v["ran"] for v in values] == [[5, 6]] * 2, "only the steps after the checkpoint ran again"
    assert [v["global_step"] for v in values] == [MAX_STEPS] * 2
    assert values[0]["progress"] == [str(MAX_STEPS), str(MAX_STEPS)], "progress follows global_step of max_steps"
    assert complete_steps(location) == [4, 6], "the trainer's save at the end; keep=2 dropped step 3"


def test_output_dir_elsewhere_is_refused_before_training(tmp_path: Path) -> None:
    def elsewhere() -> None:
        from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

        from prefect_sgpu.integrations.hf import SGPUCallback

        model = GPT2LMHeadModel(GPT2Config(vocab_size=8, n_positions=4, n_embd=8, n_layer=1, n_head=1))
        Trainer(model=model, args=TrainingArguments(output_dir="/tmp/elsewhere", report_to=[], use_cpu=True),
                callbacks=[SGPUCallback(tmp_path / "checkpoints")])

    from prefect_sgpu.errors import SGPUConfigError

    with pytest.raises(SGPUConfigError, match=r"TrainingArguments.output_dir.*/tmp/elsewhere"):
        elsewhere()
