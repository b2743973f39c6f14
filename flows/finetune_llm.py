"""Fine-tune a small causal language model: MDS -> DDP/FSDP/DeepSpeed -> perplexity -> MLflow registry.

The pipeline a team runs every night, at toy size so it finishes on a laptop:

1. **prepare** — the text corpus shipped in ``flows/data/`` is tokenized (UTF-8 bytes,
   so no tokenizer download), cut into fixed-length blocks and split into train and
   held-out sets; the train blocks become Mosaic Streaming (MDS) shards with
   ``prepare_mds``. Both steps are cached by content: a rerun converts nothing.
2. **train** — one GPU task (a gang-launched multi-node job). Every rank streams its
   share of the shards, the model is wrapped for the ``strategy`` (``ddp``, ``fsdp``
   or ``deepspeed``), and a checkpoint — sharded for FSDP2 and ZeRO, with the
   data-loader position and RNG state — is written every ``checkpoint_every`` steps.
   A failed attempt is retried by Prefect and resumes from the newest complete
   checkpoint, mid-epoch.
3. **evaluate** — perplexity of the trained model on the held-out blocks.
4. **register** — params, metrics and the model go to the training job's MLflow run (the
   one with the loss curve, so the version links to it); a new version gets the
   ``candidate`` alias and ``champion`` moves to it only if its perplexity is lower
   than the current champion's.

The model is a GPT-2 built from a config (2 layers, width 64, 256 byte tokens): no
weights are downloaded. Load the winner with
``mlflow.pytorch.load_model("models:/finetune-llm@champion")``.

CPU (default): 2 nodes x 2 ranks on this machine, gloo, fp32::

    python flows/finetune_llm.py                        # DDP, 2 nodes x 2 ranks, 60 steps
    python flows/finetune_llm.py --strategy fsdp        # FSDP2, sharded checkpoints
    python flows/finetune_llm.py --strategy deepspeed   # ZeRO-2 (first run compiles a comm op, ~1 min)

GPU: the same flow with ``gpus=8, nodes=1, gpu_type="H100", remote=True`` (an EC2
compute block: a deployment's ``compute_block``), or ``gpus=<GPUs on this box>``
locally. On GPUs each rank takes its own device, the process group uses nccl and
training runs in bf16 (autocast for DDP, FSDP2's mixed-precision policy, DeepSpeed's
``bf16`` section); grow ``n_layer``/``n_embd``/``seq_len``/``steps`` to make it real work.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task

from prefect_sgpu import GPUTaskRunner, gpu_task, runtime
from prefect_sgpu.errors import SGPUConfigError

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
VOCAB_SIZE = 256  # byte-level: a token is one UTF-8 byte
STRATEGIES = ("ddp", "fsdp", "deepspeed")


def _data_home() -> Path:
    return Path(os.environ.get("PREFECT_SGPU_HOME", Path.home() / ".prefect-sgpu")) / "data"


def model_config(seq_len: int = 64, n_layer: int = 2, n_embd: int = 64, n_head: int = 4) -> dict[str, Any]:
    """A small GPT-2 configuration (no dropout, so evaluation is deterministic)."""
    return {"vocab_size": VOCAB_SIZE, "n_positions": seq_len, "n_embd": n_embd, "n_layer": n_layer,
            "n_head": n_head, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def build_model(config: dict[str, Any]) -> Any:
    """A randomly initialised GPT-2 language model from ``config`` (nothing downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(**config))
    model.loss_type = "ForCausalLM"  # the loss it would pick anyway, without a warning per process
    return model


def encode(text: str) -> list[int]:
    """The byte-level tokenizer: UTF-8 bytes are the tokens."""
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


def _corpus_key(context: Any, parameters: dict[str, Any]) -> str:
    """Cache by the corpus's content, the split settings and where the blocks are written."""
    digest = hashlib.sha256(Path(parameters["corpus"]).read_bytes()).hexdigest()[:24]
    home = hashlib.sha256(str(_data_home().absolute()).encode()).hexdigest()[:12]
    return (f"finetune-llm-blocks-{digest}-{parameters['seq_len']}-{parameters.get('heldout_fraction', 0.1)}"
            f"-{home}")


@task(name="tokenize-corpus", cache_key_fn=_corpus_key, persist_result=True)
def tokenize_corpus(corpus: str, seq_len: int, heldout_fraction: float = 0.1) -> dict[str, Any]:
    """Cut the corpus into ``seq_len``-token blocks; the last ``heldout_fraction`` is held out.

    The held-out blocks come from the end of the text, so no sentence is split across
    train and held-out data.
    """
    import numpy as np

    tokens = np.frombuffer(Path(corpus).read_bytes(), dtype=np.uint8).astype(np.int32)
    blocks = tokens[: len(tokens) // seq_len * seq_len].reshape(-1, seq_len)
    n_heldout = max(1, int(round(len(blocks) * heldout_fraction)))
    if len(blocks) - n_heldout < 1:
        raise SGPUConfigError("corpus", corpus, f"a text of more than {seq_len * 2} bytes")
    digest = hashlib.sha256(blocks.tobytes()).hexdigest()[:16]
    folder = _data_home() / f"finetune-llm-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, part in (("train", blocks[:-n_heldout]), ("heldout", blocks[-n_heldout:])):
        path = folder / f"{split}.npz"
        tmp = folder / f"{split}.tmp.npz"
        np.savez(tmp, tokens=part)
        tmp.replace(path)
        paths[split] = str(path)
    return {**paths, "train_blocks": len(blocks) - n_heldout, "heldout_blocks": n_heldout, "digest": digest}


def train_lm(shards: Any, config: dict[str, Any], steps: int = 40, batch_size: int = 8, lr: float = 3e-3,
             seed: int = 0, checkpoint_every: int = 10, zero_stage: int = 2,
             fault_file: str | None = None, fault_step: int = -1) -> dict[str, Any]:
    """On every rank: stream this rank's blocks and train; return where rank 0 saved the full weights.

    Checkpoints go to ``runtime.checkpoint_dir()`` (kept across Prefect retries of this
    task); a new attempt starts from the newest complete one, mid-epoch. The strategy
    comes from ``SGPU_STRATEGY`` (the GPU task's ``strategy``). ``fault_file`` /
    ``fault_step`` are for failure drills: rank 0 fails once at ``fault_step`` if the
    file exists, and deletes it.
    """
    import numpy as np
    import torch
    import torch.distributed as dist

    from prefect_sgpu.pipeline.checkpoint import Checkpointer
    from prefect_sgpu.pipeline.streaming import streaming_loader
    from prefect_sgpu.pipeline.strategies import wrap

    runtime.init_process_group()
    torch.manual_seed(seed)  # the same initial weights on every rank
    wrapped = wrap(build_model(config), lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
                   micro_batch_size=batch_size, zero_stage=zero_stage)
    ckpt = Checkpointer(wrapped, every=checkpoint_every, keep=2)
    start, extra = ckpt.restore()
    if start:
        print(f"resuming from the checkpoint of step {start}")
    loader = streaming_loader(shards, batch_size, state=extra.get("loader"), seed=seed,
                              collate_fn=lambda rows: torch.from_numpy(np.stack([r["tokens"] for r in rows])))
    mlflow_run_id = os.environ.get("MLFLOW_RUN_ID")  # read now: MLflow removes it once the run is resumed
    tracking = runtime.is_rank_zero() and bool(mlflow_run_id)
    if tracking and start == 0:
        import mlflow

        mlflow.log_params({"strategy": wrapped.strategy, "world_size": runtime.world_size(), "steps": steps,
                           "batch_size": batch_size, "lr": lr, **{f"model_{k}": v for k, v in config.items()}})

    batches = iter(loader)
    runtime.progress(start, total=steps)  # the task's progress artifact follows step / steps
    wrapped.train()
    window = torch.zeros(2)
    last_loss = float(extra.get("train_loss", float("nan")))
    for step in range(start, steps):
        if (fault_file and step == fault_step and runtime.is_rank_zero() and Path(fault_file).exists()):
            Path(fault_file).unlink()
            raise RuntimeError(f"injected fault at step {step}")
        try:
            batch = next(batches)
        except StopIteration:  # next epoch
            batches = iter(loader)
            batch = next(batches)
        tokens = batch.long().to(wrapped.device)
        with wrapped.autocast():
            loss = wrapped.model(input_ids=tokens, labels=tokens).loss
        wrapped.zero_grad()
        wrapped.backward(loss)
        wrapped.step()
        window += torch.tensor([loss.item(), 1.0])
        if (step + 1) % 5 == 0 or step + 1 == steps:
            dist.all_reduce(window)
            last_loss = (window[0] / window[1]).item()
            window.zero_()
            if runtime.is_rank_zero():
                print(f"step {step + 1}: train loss {last_loss:.4f}")
                if tracking:
                    import mlflow

                    mlflow.log_metric("train_loss", last_loss, step=step + 1)
        if ckpt.due(step + 1):
            ckpt.save(step + 1, {"loader": loader.state_dict(), "train_loss": last_loss})
    from prefect_sgpu.pipeline.checkpoint import save_model

    model_uri = save_model(wrapped.full_state_dict())  # beside the checkpoints; tasks pass the URI, not weights
    return {"model_uri": model_uri, "train_loss": last_loss, "start_step": start, "strategy": wrapped.strategy,
            "mlflow_run_id": mlflow_run_id}


#: training as a Prefect task: one gang-launched job; a retry relaunches it and resumes
train = gpu_task(train_lm, gpus=4, nodes=2, strategy="ddp", retries=1, name="train-llm", persist_result=True)


def load_blocks(path: str) -> Any:
    import numpy as np

    with np.load(path) as data:
        return data["tokens"]


def perplexity(model: Any, blocks: Any, batch_size: int = 16) -> float:
    """exp(mean next-token loss) of ``model`` over every predicted token of ``blocks``."""
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(blocks), batch_size):
            tokens = torch.as_tensor(blocks[i:i + batch_size], dtype=torch.long)
            loss = model(input_ids=tokens, labels=tokens).loss
            predicted = tokens.shape[0] * (tokens.shape[1] - 1)
            total += loss.item() * predicted
            count += predicted
    return math.exp(total / count)


def _trained_model(config: dict[str, Any], model_uri: str) -> Any:
    from prefect_sgpu.pipeline.checkpoint import load_model

    weights = load_model(model_uri)
    model = build_model(config)
    model.load_state_dict(weights)
    return model


@task(name="evaluate-llm")
def evaluate(config: dict[str, Any], trained: dict[str, Any], heldout: str) -> float:
    """Held-out perplexity of the trained weights (lower is better; 256 = a uniform guess)."""
    value = perplexity(_trained_model(config, trained["model_uri"]), load_blocks(heldout))
    if not math.isfinite(value):
        raise ValueError(f"training produced a non-finite held-out perplexity: {value}")
    return value


@task(name="register-llm")
def register(config: dict[str, Any], trained: dict[str, Any], heldout_perplexity: float, model_name: str,
             params: dict[str, Any]) -> dict[str, Any]:
    """Log and register the model into the training job's MLflow run (which holds its loss curve), or a run of
    its own when training was not tracked; ``champion`` moves only on a lower perplexity."""
    from dataclasses import asdict

    from prefect_sgpu.pipeline.registry import register_model

    version = register_model(
        _trained_model(config, trained["model_uri"]), name=model_name, metric_name="perplexity",
        metric_value=heldout_perplexity, lower_is_better=True,
        params={**params, **{f"model_{k}": v for k, v in config.items()}},
        metrics={"train_loss": trained["train_loss"]}, run_name=f"{model_name}-{trained['strategy']}",
        run_id=trained.get("mlflow_run_id"),
    )
    return asdict(version)


def _check(strategy: str, steps: int, batch_size: int, checkpoint_every: int, seq_len: int) -> None:
    if strategy not in STRATEGIES:
        raise SGPUConfigError("strategy", strategy, "one of " + ", ".join(STRATEGIES))
    for field, value in (("steps", steps), ("batch_size", batch_size), ("checkpoint_every", checkpoint_every),
                         ("seq_len", seq_len)):
        if not isinstance(value, int) or value < 1:
            raise SGPUConfigError(field, value, "a positive integer")


@flow(name="finetune-llm", log_prints=True, task_runner=GPUTaskRunner())
def finetune_llm(strategy: str = "ddp", gpus: int = 4, nodes: int = 2, steps: int = 60, batch_size: int = 8,
                 lr: float = 3e-3, seq_len: int = 64, checkpoint_every: int = 10, zero_stage: int = 2,
                 model_name: str = "finetune-llm", gpu_type: str | None = None, remote: bool = False,
                 corpus: str | None = None, fault_file: str | None = None, fault_step: int = -1) -> dict[str, Any]:
    """Prepare (tokenize -> MDS) -> train (``gpus`` ranks over ``nodes`` nodes) -> evaluate -> register."""
    from prefect_sgpu.pipeline.mds import prepare_mds

    _check(strategy, steps, batch_size, checkpoint_every, seq_len)
    logger = get_run_logger()
    config = model_config(seq_len=seq_len)
    blocks = tokenize_corpus(corpus or str(CORPUS), seq_len)
    if not all(Path(blocks[split]).is_file() for split in ("train", "heldout")):  # cached, files since deleted
        blocks = tokenize_corpus.with_options(refresh_cache=True)(corpus or str(CORPUS), seq_len)
    shards = prepare_mds(blocks["train"], str(_data_home() / "mds" / f"finetune-llm-{blocks['digest']}"),
                         progress=False)
    trained = train.with_options(gpus=gpus, nodes=nodes, gpu_type=gpu_type, remote=remote, strategy=strategy)(
        shards, config, steps=steps, batch_size=batch_size, lr=lr, checkpoint_every=checkpoint_every,
        zero_stage=zero_stage, fault_file=fault_file, fault_step=fault_step)
    heldout_ppl = evaluate(config, trained, blocks["heldout"])
    params = {"strategy": strategy, "gpus": gpus, "nodes": nodes, "steps": steps, "batch_size": batch_size,
              "lr": lr, "train_blocks": blocks["train_blocks"], "mds_uri": shards.uri}
    version = register(config, trained, heldout_ppl, model_name, params)
    logger.info("%s v%s: held-out perplexity %.3f (train loss %.4f)%s", model_name, version["version"],
                heldout_ppl, trained["train_loss"], "; new champion" if version["champion"] else "")
    return {"model_name": model_name, "version": version["version"], "champion": version["champion"],
            "perplexity": heldout_ppl, "train_loss": trained["train_loss"], "start_step": trained["start_step"],
            "strategy": trained["strategy"], "heldout": blocks["heldout"], "mds_uri": shards.uri,
            "model_uri": trained["model_uri"],
            "run_id": version["run_id"]}


def main() -> None:
    from prefect_sgpu.cli import add_gpu_arguments, gpu_options

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    parser.add_argument("--gpus", type=int, default=4, help="total ranks (one per GPU; CPU ranks without GPUs)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--model-name", default="finetune-llm")
    add_gpu_arguments(parser)
    args = parser.parse_args()
    out = finetune_llm(strategy=args.strategy, gpus=args.gpus, nodes=args.nodes, steps=args.steps,
                       batch_size=args.batch_size, lr=args.lr, checkpoint_every=args.checkpoint_every,
                       model_name=args.model_name, **gpu_options(args))
    print(f"{out['model_name']} v{out['version']} ({out['strategy']}): held-out perplexity "
          f"{out['perplexity']:.3f}, train loss {out['train_loss']:.4f}"
          + (" -> champion" if out["champion"] else " (champion unchanged)"))


if __name__ == "__main__":
    main()
