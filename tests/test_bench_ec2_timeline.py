"""``bench/ec2_timeline.py``'s calls ask for the layout its rows name: one rank on each of N machines."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from prefect_sgpu import spec as spec_mod
from prefect_sgpu.catalog import plan_nodes

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> object:
    spec = importlib.util.spec_from_file_location("bench_ec2_timeline", ROOT / "bench" / "ec2_timeline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


@pytest.mark.parametrize("nodes", [2, 8])
def test_each_call_runs_one_rank_on_each_of_n_g5_xlarge_nodes(nodes: int) -> None:
    """8 A10 GPUs without ``nodes`` plan as one g5.48xlarge (the fewest machines): an "8-node" row measured
    so ran 8 ranks on one node, and its timeline had one node's first step, never eight."""
    args = _bench().job_args(nodes)  # type: ignore[attr-defined]
    built = spec_mod.build(spec_mod.layer("call", **args))
    count, instance = plan_nodes(built.gpu_type, built.gpus, built.nodes)
    assert (count, instance.name) == (nodes, "g5.xlarge")
