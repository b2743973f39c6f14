"""Fine-tune a small causal language model with Hugging Face ``transformers.Trainer`` on 2 nodes x 2 ranks.

The same pipeline as ``finetune_llm.py`` (tokenize -> train -> held-out perplexity -> MLflow
registry), with the training loop left to ``transformers.Trainer``, as most Hugging Face users
write it. ``SGPUCallback`` (``prefect_sgpu.integrations.hf``) connects the trainer to the job:

- the task's progress artifact follows the trainer's ``global_step`` of ``max_steps``;
- a reclaim notice on any node makes every rank save at that step;
- the trainer's checkpoints are sealed at the job's checkpoint location, which a Prefect retry
  of the task keeps: the retry resumes from the newest complete one (``resume_from()``).

The trainer's loss reaches the job's MLflow run (``report_to="mlflow"`` picks up the run the
job made, through ``MLFLOW_RUN_ID``); the registered version links to that run.

The model is a GPT-2 built from a config (2 layers, width 64, 256 byte tokens): nothing is
downloaded. The blocks travel with the task's arguments (the corpus is 27 KB), so the same flow
runs on remote nodes::

    python flows/finetune_hf.py                      # 2 nodes x 2 CPU ranks on this machine
    python flows/finetune_hf.py --gpus 8 --nodes 1 --gpu-type H100 --remote --compute-block sgpu-ec2-compute/h100
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

sys.path.insert(0, str(Path(__file__).resolve().parent))  # finetune_llm: the shared data and evaluation steps

from finetune_llm import CORPUS, evaluate, model_config, register, tokenize_corpus  # noqa: E402

from prefect_sgpu import GPUTaskRunner, gpu_task, runtime  # noqa: E402
from prefect_sgpu.errors import SGPUConfigError  # noqa: E402


def train_with_trainer(train_tokens: Any, config: dict[str, Any], steps: int = 12, batch_size: int = 8,
                       lr: float = 3e-3, seed: int = 0, checkpoint_every: int = 6,
                       fault_file: str | None = None, fault_step: int = -1) -> dict[str, Any]:
    """On every rank: ``transformers.Trainer`` over the train blocks; rank 0 stores the final weights.

    ``fault_file`` / ``fault_step``: a failure drill, as in ``finetune_llm``: rank 0 fails once
    after ``fault_step`` if the file exists, and deletes it.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from prefect_sgpu.integrations.hf import SGPUCallback
    from prefect_sgpu.pipeline.checkpoint import save_model

    runtime.init_process_group()
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = GPT2LMHeadModel(GPT2Config(**config))
    model.loss_type = "ForCausalLM"
    blocks = torch.as_tensor(train_tokens, dtype=torch.long)
    data = [{"input_ids": row, "labels": row} for row in blocks]
    print(f"{len(data)} blocks of {blocks.shape[1]} tokens, world size {runtime.world_size()}")
    checkpoints = SGPUCallback(keep=2)
    resume = checkpoints.resume_from()
    if resume:
        print(f"resuming from {Path(resume).name}")

    class Drill(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if (fault_file and state.global_step == fault_step and runtime.is_rank_zero()
                    and Path(fault_file).exists()):
                Path(fault_file).unlink()
                raise RuntimeError(f"injected fault after step {state.global_step}")

    # the job's run, read now: HF's MLflow callback reattaches to it, and MLflow then drops the variable
    mlflow_run_id = os.environ.get("MLFLOW_RUN_ID")
    args = TrainingArguments(
        output_dir=checkpoints.output_dir, max_steps=steps, per_device_train_batch_size=batch_size,
        learning_rate=lr, weight_decay=0.01, lr_scheduler_type="constant", seed=seed, data_seed=seed,
        save_strategy="steps", save_steps=checkpoint_every, logging_strategy="steps", logging_steps=2,
        report_to=["mlflow"] if mlflow_run_id else [], use_cpu=not runtime.uses_gpu(),
        bf16=runtime.uses_gpu(), ddp_find_unused_parameters=False, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Drill(), checkpoints])
    trainer.train(resume_from_checkpoint=resume)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    model_uri = save_model({k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}
                           if runtime.is_rank_zero() else None)
    return {"model_uri": model_uri, "train_loss": float(losses[-1]) if losses else float("nan"),
            "start_step": int(Path(resume).name.split("-")[-1]) if resume else 0,
            "global_step": trainer.state.global_step, "strategy": "ddp",
            "mlflow_run_id": mlflow_run_id}


#: training as a Prefect task: one gang-launched job on 2 nodes x 2 ranks; a retry resumes
train = gpu_task(train_with_trainer, gpus=4, nodes=2, retries=1, name="train-hf", persist_result=True)


def _check(steps: int, batch_size: int, checkpoint_every: int, seq_len: int) -> None:
    for field, value in (("steps", steps), ("batch_size", batch_size), ("checkpoint_every", checkpoint_every),
                         ("seq_len", seq_len)):
        if not isinstance(value, int) or value < 1:
            raise SGPUConfigError(field, value, "a positive integer")


@flow(name="finetune-hf", log_prints=True, task_runner=GPUTaskRunner())
def finetune_hf(gpus: int = 4, nodes: int = 2, steps: int = 12, batch_size: int = 8, lr: float = 3e-3,
                seq_len: int = 64, checkpoint_every: int = 6, model_name: str = "finetune-hf",
                gpu_type: str | None = None, remote: bool = False, corpus: str | None = None,
                fault_file: str | None = None, fault_step: int = -1) -> dict[str, Any]:
    """Tokenize -> train with ``transformers.Trainer`` (``gpus`` ranks over ``nodes``) -> evaluate -> register."""
    import numpy as np

    _check(steps, batch_size, checkpoint_every, seq_len)
    config = model_config(seq_len=seq_len)
    blocks = tokenize_corpus(corpus or str(CORPUS), seq_len)
    if not all(Path(blocks[split]).is_file() for split in ("train", "heldout")):  # cached, files since deleted
        blocks = tokenize_corpus.with_options(refresh_cache=True)(corpus or str(CORPUS), seq_len)
    with np.load(blocks["train"]) as data:
        train_tokens = data["tokens"]
    trained = train.with_options(gpus=gpus, nodes=nodes, gpu_type=gpu_type, remote=remote)(
        train_tokens, config, steps=steps, batch_size=batch_size, lr=lr, checkpoint_every=checkpoint_every,
        fault_file=fault_file, fault_step=fault_step)
    heldout_ppl = evaluate(config, trained, blocks["heldout"])
    params = {"trainer": "transformers.Trainer", "gpus": gpus, "nodes": nodes, "steps": steps,
              "batch_size": batch_size, "lr": lr, "train_blocks": blocks["train_blocks"]}
    version = register(config, trained, heldout_ppl, model_name, params)
    get_run_logger().info("%s v%s: held-out perplexity %.3f (train loss %.4f)%s", model_name, version["version"],
                          heldout_ppl, trained["train_loss"], "; new champion" if version["champion"] else "")
    return {"model_name": model_name, "version": version["version"], "champion": version["champion"],
            "perplexity": heldout_ppl, "train_loss": trained["train_loss"], "start_step": trained["start_step"],
            "global_step": trained["global_step"], "heldout": blocks["heldout"], "model_uri": trained["model_uri"],
            "run_id": version["run_id"]}


def main() -> None:
    from prefect_sgpu.cli import add_gpu_arguments, gpu_options

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=4, help="total ranks (one per GPU; CPU ranks without GPUs)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--checkpoint-every", type=int, default=6)
    parser.add_argument("--model-name", default="finetune-hf")
    add_gpu_arguments(parser)
    args = parser.parse_args()
    out = finetune_hf(gpus=args.gpus, nodes=args.nodes, steps=args.steps, batch_size=args.batch_size,
                      checkpoint_every=args.checkpoint_every, model_name=args.model_name, **gpu_options(args))
    print(f"{out['model_name']} v{out['version']}: held-out perplexity {out['perplexity']:.3f}, "
          f"train loss {out['train_loss']:.4f}" + (" -> champion" if out["champion"] else " (champion unchanged)"))


if __name__ == "__main__":
    main()
