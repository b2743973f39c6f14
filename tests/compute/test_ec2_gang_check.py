"""The gang check on EC2 (moto server, simulated bare nodes, real gloo ranks): a node whose network
device cannot be opened is named with its instance id before the function runs, at once instead of
at the collective timeout; it is replaced alone and the job goes on. (Where nothing is replaced, the
job ends with the check's ``GangCheckFailed``: ``tests/test_gang_check.py``.) A sound gang's link
table, by instance, is checked in ``test_ec2_stragglers.py`` (the same two nodes, one job fewer)."""

from __future__ import annotations

import pytest

from support.conformance_ec2 import EC2Env
from prefect_sgpu import distributed, runtime

pytestmark = pytest.mark.e2e


def _ran(path: str) -> int:
    from pathlib import Path

    Path(path, f"rank-{runtime.rank()}").write_text("ran")
    return runtime.rank()


def test_a_node_with_a_broken_network_device_is_named_and_replaced_and_the_job_goes_on(ec2: EC2Env,
                                                                                       tmp_path) -> None:
    # the first instance at node 1 has an image that names a network interface it does not have: gloo
    # cannot open it there. The check names it with its instance id; it is replaced alone, node 0 is kept.
    broken: list[str] = []

    def image_env(inst: dict) -> dict:
        if inst["AmiLaunchIndex"] == 1 and not broken:
            broken.append(inst["InstanceId"])
        return {"GLOO_SOCKET_IFNAME": "sgpu-missing0"} if inst["InstanceId"] in broken else {}

    ec2.simulator.image_env = image_env
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(), mlflow=False, timeout=600,
                     env={"SGPU_GANG_CHECK_TIMEOUT_S": "300"})(_ran)
    ran = tmp_path / "ran"
    ran.mkdir()
    job = fn.job(str(ran))
    result = job.run()
    assert result.values == [0, 1]
    (recovery,) = result.recoveries
    assert list(recovery.nodes) == [1] and recovery.nodes[1] == broken[0], recovery
    assert "failed the gang check" in recovery.reason and "sgpu-missing0" in recovery.reason, recovery.reason
    assert "did not finish within" not in recovery.reason  # named at once, not after the 300 s step timeout
    assert recovery.replaced == "nodes" and list(recovery.kept) == [0], recovery
    assert len(ec2.instances(job.run_id)) == 3, "one instance launched in place of the broken one"
    assert sorted(p.name for p in ran.iterdir()) == ["rank-0", "rank-1"]  # once each, on the sound gang
