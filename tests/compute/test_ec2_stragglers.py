"""A straggler on EC2 (moto server, simulated nodes, real gloo ranks): each node ships its ranks'
progress with its logs, and the driver names the slow rank with the instance it runs on."""

from __future__ import annotations

import pytest

from support.conformance_ec2 import EC2Env
from prefect_sgpu import distributed, runtime

pytestmark = pytest.mark.e2e


def _rank_1_sleeps_each_step() -> int:
    import time as t

    import torch.distributed as dist

    runtime.init_process_group()
    dist.barrier()  # both ranks start their steps together
    period, count = (0.5, 20) if runtime.rank() == 1 else (0.05, 200)
    for step in range(1, count + 1):
        t.sleep(period)
        runtime.progress(step, total=count, force=True)
    dist.barrier()
    return runtime.rank()


def test_a_straggling_rank_on_ec2_is_named_with_its_node_and_instance(ec2: EC2Env) -> None:
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(), mlflow=False, timeout=300,
                     straggler_factor=2.0, straggler_steps=3)(_rank_1_sleeps_each_step)
    result = fn.job().run()
    assert result.values == [0, 1]
    node1 = next(i for i in ec2.instances(result.run_id) if i["AmiLaunchIndex"] == 1)
    assert [(s.rank, s.node, s.instance_id) for s in result.stragglers] == [(1, 1, node1["InstanceId"])]
    named = result.stragglers[0]
    assert 0 < named.rate * 2.0 < named.median_rate, named
    assert set(result.step_rates) == {0, 1} and result.step_rates[1] * 2 < result.step_rates[0], result.step_rates
    # the gang check before the function: each node link, named by instance
    ids = {i["AmiLaunchIndex"]: i["InstanceId"] for i in ec2.instances(result.run_id)}
    assert {(link["from"], link["to"]) for link in result.gang_check["links"]} == {(ids[0], ids[1]), (ids[1], ids[0])}
