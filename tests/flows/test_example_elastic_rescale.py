"""examples/elastic_rescale.py, quickly: its recipe per world, and its rank function resumed in a world
of another size (one process, a real gloo group of 1, told the previous round had 2 ranks)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def test_the_recipe_keeps_the_global_batch_or_scales_the_rate_with_warmup() -> None:
    import elastic_rescale as ex

    for world, per_rank, accumulation in ((1, 8, 3), (2, 6, 2), (3, 8, 1), (4, 6, 1)):
        r = ex.recipe(world, None, 0, keep_global_batch=True)
        assert (r["per_rank"], r["accumulation"], r["lr"]) == (per_rank, accumulation, ex.BASE_LR)
        assert r["per_rank"] * r["accumulation"] * world == r["global_batch"] == ex.GLOBAL_BATCH
    # the global batch follows the world: the rate goes 2 -> 4 ranks from 0.05 to 0.1 over 4 steps
    ramp = [ex.recipe(4, 2, s, keep_global_batch=False)["lr"] for s in range(6)]
    assert ramp == pytest.approx([0.0625, 0.075, 0.0875, 0.1, 0.1, 0.1])
    assert ex.recipe(1, None, 0, keep_global_batch=False)["lr"] == pytest.approx(0.025)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_example_resumes_from_its_checkpoint_and_rescales_in_a_smaller_world(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    import elastic_rescale as ex

    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                        "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1",
                        "SGPU_DEVICE": "cpu", "SGPU_MEMBERSHIP_ROUND": "0", "SGPU_PREVIOUS_NODES": ""}.items():
        monkeypatch.setenv(name, value)
    try:
        first = ex.train.func(folder=str(tmp_path), steps=4)
        assert (first["start"], first["previous"]) == (0, None)
        # the next round: one rank where the last had 2 (as torch elastic's restart tells the ranks)
        monkeypatch.setenv("SGPU_MEMBERSHIP_ROUND", "1")
        monkeypatch.setenv("SGPU_PREVIOUS_NODES", "2")
        second = ex.train.func(folder=str(tmp_path), steps=8)
        assert (second["start"], second["world"], second["previous"]) == (4, 1, 2)
        assert second["recipe"] == {"per_rank": 8, "accumulation": 3, "global_batch": 24, "lr": ex.BASE_LR}
        assert len(second["losses"]) == 4 * 3, "4 steps of 3 micro-steps each"
        assert sum(second["losses"][-3:]) < sum(first["losses"][:3]), (first["losses"], second["losses"])
        scaled = ex.train.func(folder=str(tmp_path), steps=10, keep_global_batch=False)
        assert scaled["recipe"]["lr"] == pytest.approx(0.025 + (0.05 - 0.025) * 2 / 4), \
            "half-way from the 2-rank rate to the 1-rank rate, 2 steps after the change"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
