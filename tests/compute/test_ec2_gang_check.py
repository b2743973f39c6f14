"""The gang check on EC2 (moto server, simulated bare nodes, real gloo ranks): a node whose network
device cannot be opened is named with its instance id before the function runs, and the job ends
at once instead of at the collective timeout. A sound gang's link table, by instance, is checked in
``test_ec2_stragglers.py`` (the same two nodes, one job fewer)."""

from __future__ import annotations

import pytest

from support.conformance_ec2 import EC2Env
from prefect_sgpu import distributed, runtime
from prefect_sgpu.errors import GangCheckFailed

pytestmark = pytest.mark.e2e


def _ran(path: str) -> int:
    from pathlib import Path

    Path(path, f"rank-{runtime.rank()}").write_text("ran")
    return runtime.rank()


def test_a_node_with_a_broken_network_device_is_named_with_its_instance(ec2: EC2Env, tmp_path) -> None:
    # instance 1's image names a network interface it does not have: gloo cannot open it there
    ec2.simulator.image_env = lambda inst: {"GLOO_SOCKET_IFNAME": "sgpu-missing0"} if inst["AmiLaunchIndex"] == 1 else {}
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(), mlflow=False, timeout=600,
                     env={"SGPU_GANG_CHECK_TIMEOUT_S": "300"})(_ran)
    ran = tmp_path / "ran"
    ran.mkdir()
    job = fn.job(str(ran))
    with pytest.raises(GangCheckFailed) as raised:
        job.run()
    broken = next(i for i in ec2.instances(job.run_id) if i["AmiLaunchIndex"] == 1)
    exc = raised.value
    assert exc.nodes == [1], str(exc)
    culprits = {r: v for r, v in exc.failed.items() if not v["collateral"]}
    assert [v["instance"] for v in culprits.values()] == [broken["InstanceId"]], str(exc)
    assert "sgpu-missing0" in str(exc) and broken["InstanceId"] in str(exc)
    assert "did not finish within" not in str(exc)  # named at once, not after the 300 s step timeout
    assert list(ran.iterdir()) == []  # the function ran nowhere

