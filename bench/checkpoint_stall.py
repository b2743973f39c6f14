"""Checkpoint stall as the training loop sees it: ``Checkpointer`` inline vs ``async_save=True``.

The fine-tune flow's model (GPT-2 built from ``flows/finetune_llm.py``'s ``model_config``, grown by
``--n-layer``/``--n-embd``; AdamW, so the optimizer state is twice the weights) trains on random
byte tokens in this one process (the DDP strategy's saving path: rank 0 writes the whole state).
The checkpoint location is ``s3://`` on a moto server started as a separate process on 127.0.0.1
(so its work does not share this process's interpreter), with the node stage in a temporary folder.

Rounds alternate (inline, async, inline, ...). Each round builds a new Checkpointer on a new S3
prefix and runs ``--steps`` training steps, saving every ``--every``; "stall" is the wall time of
each ``save()`` call (inline: write, upload, seal; async: wait for the previous save, copy to CPU,
start the thread), "sealed" is the time from ``save()`` to the checkpoint being complete (the
async side's ``wait()`` after its last save included). The last line is a markdown row for
BENCHMARKS.md with the median stall of each side and their ratio (goal: async <= 0.2 x inline).

    ./dev bench checkpoint_stall [--rounds 3] [--steps 12] [--every 3] [--n-layer 6] [--n-embd 512] [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _moto(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the moto server did not start within 60 s")


def _model(n_layer: int, n_embd: int) -> Any:
    import torch

    sys.path.insert(0, str(ROOT / "flows"))
    import finetune_llm

    from prefect_sgpu.pipeline.strategies import Wrapped

    torch.manual_seed(0)
    model = finetune_llm.build_model(finetune_llm.model_config(seq_len=64, n_layer=n_layer, n_embd=n_embd))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Wrapped("ddp", model, model, optimizer, torch.device("cpu"), torch.float32)


def _step(w: Any) -> None:
    import torch

    tokens = torch.randint(0, 256, (8, 64))
    loss = w.model(input_ids=tokens, labels=tokens).loss
    w.zero_grad()
    w.backward(loss)
    w.step()


def _round(w: Any, uri: str, steps: int, every: int, async_save: bool) -> dict[str, Any]:
    from prefect_sgpu.pipeline.checkpoint import Checkpointer, complete_steps

    ckpt = Checkpointer(w, uri, every=every, keep=2, async_save=async_save)
    stalls: list[float] = []
    started = time.perf_counter()
    for step in range(1, steps + 1):
        _step(w)
        if ckpt.due(step):
            t0 = time.perf_counter()
            ckpt.save(step)
            stalls.append(time.perf_counter() - t0)
    loop_s = time.perf_counter() - started
    t0 = time.perf_counter()
    ckpt.wait()
    tail_s = time.perf_counter() - t0
    assert complete_steps(uri)[-1] == steps - steps % every, complete_steps(uri)
    return {"stalls": stalls, "loop_s": loop_s, "tail_s": tail_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 6 steps, a checkpoint every 2, "
                        "a 4-layer 256-wide model")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.every, args.n_layer, args.n_embd = 2, 6, 2, 4, 256

    work = Path(tempfile.mkdtemp(prefix="sgpu-ckpt-bench-"))
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "PREFECT_SGPU_HOME": str(work / "home"),
                       "SGPU_JOB_DIR": str(work / "node")})
    from prefect_sgpu.checkpoints import ENDPOINT_ENV

    os.environ[ENDPOINT_ENV] = endpoint
    moto = _moto(port)
    try:
        import boto3

        bucket = f"sgpu-bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        w = _model(args.n_layer, args.n_embd)
        state_mb = sum(t.numel() * t.element_size() for t in w.module.state_dict().values()) / 2**20
        _step(w)  # the optimizer's state exists from here on
        optim_mb = sum(v.numel() * v.element_size() for s in w.optimizer.state.values()
                       for v in s.values() if hasattr(v, "numel")) / 2**20
        sides: dict[str, dict[str, list[float]]] = {"inline": {"stalls": [], "loop": [], "tail": []},
                                                    "async": {"stalls": [], "loop": [], "tail": []}}
        for r in range(args.rounds):
            for side in ("inline", "async"):
                got = _round(w, f"s3://{bucket}/{side}-{r}", args.steps, args.every, side == "async")
                sides[side]["stalls"] += got["stalls"]
                sides[side]["loop"].append(got["loop_s"])
                sides[side]["tail"].append(got["tail_s"])
                print(f"round {r} {side:6s}: stalls {', '.join(f'{s:.2f}' for s in got['stalls'])} s; "
                      f"loop {got['loop_s']:.1f} s; wait after the loop {got['tail_s']:.2f} s", flush=True)
    finally:
        moto.kill()
        moto.wait()
        shutil.rmtree(work, ignore_errors=True)

    inline = statistics.median(sides["inline"]["stalls"])
    asynch = statistics.median(sides["async"]["stalls"])
    loops = {k: statistics.median(v["loop"]) for k, v in sides.items()}
    print(f"\nmodel state {state_mb:.0f} MB + optimizer state {optim_mb:.0f} MB per checkpoint; "
          f"{args.rounds} round(s) x {args.steps} steps, a checkpoint every {args.every}")
    print(f"median stall per save: inline {inline:.3f} s, async {asynch:.3f} s, ratio {asynch / inline:.3f} "
          f"(goal <= 0.2); median loop: inline {loops['inline']:.1f} s, async {loops['async']:.1f} s")
    print(f"\n| {time.strftime('%Y-%m-%d')}, {platform.node()} ({os.cpu_count()} cores) | "
          f"{state_mb + optim_mb:.0f} MB, s3 (moto) | {inline:.3f} | {asynch:.3f} | {asynch / inline:.3f} | "
          f"{loops['inline']:.1f} | {loops['async']:.1f} |")


if __name__ == "__main__":
    main()
