"""A job held to its ``max_cost_usd`` on (simulated) EC2: at the cap the ranks save a final checkpoint,
as on a reclaim notice, and the job stops with ``CostCapReached``, leaving nothing behind.

Two g5.xlarge nodes cost $2.012 an hour at the catalog's list price: a cap of $0.0005 is passed
by the projection at the driver's first check once the gang started (a tenth of a cent by the next
check, ten seconds ahead), so the cap is reached in seconds without changing any price.
"""

from __future__ import annotations

import pytest

from support.conformance_ec2 import EC2Env
from support.recovery import has_checkpoint
from support.training import STEPS, train_with_checkpoints as _train
from prefect_sgpu import distributed
from prefect_sgpu.errors import CostCapReached


def test_the_driver_lists_the_checkpoints_in_its_store_under_the_shipped_driver_policy(ec2: EC2Env) -> None:
    """At the cap the driver waits for the final checkpoint by listing the job's checkpoint folder: the
    shipped driver policy (``ListStore``: ``s3:ListBucket`` with an ``s3:prefix`` in the store) allows
    it, judged by the IAM gate on every request."""
    from prefect_sgpu.driver.cost_cap import marker_steps
    from prefect_sgpu.store.s3 import S3Store

    ec2.store().put("run-1", "checkpoints/step-00000002/COMPLETE", b"marker")
    ec2.store().put("run-1", "checkpoints/step-00000003/model.pt", b"half a save")
    driver, gate, _ = ec2.gated_driver()
    try:
        store = S3Store(ec2.settings["store_uri"], session=driver, endpoint_url=ec2.aws.endpoint_url)
        assert marker_steps(store, store.uri("run-1", "checkpoints")) == [2]
    finally:
        assert ec2.proxy is not None
        ec2.proxy.iam_gate = None
    assert gate.denied == [] and any(action == "s3:ListBucket" for _, action in gate.allowed), gate.allowed


@pytest.mark.e2e
def test_a_job_past_its_cost_cap_saves_a_final_checkpoint_and_stops_leaving_nothing(ec2: EC2Env) -> None:
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(), mlflow=False, timeout=600,
                     max_cost_usd=0.0005)(_train)
    job = fn.job(step_s=0.5)  # 30 s of steps: the stop comes long before the last one
    with pytest.raises(CostCapReached) as caught:
        job.run()
    err = caught.value
    assert err.run_id == job.run_id and err.cap_usd == 0.0005
    assert err.projected_usd > 0.0005 and err.spent_usd <= err.projected_usd
    assert "max_cost_usd=0.0005" in str(err) and "final checkpoint was saved at step" in str(err), str(err)
    assert err.checkpoint_step is not None and 0 < err.checkpoint_step < STEPS, "stopped early, with a checkpoint"
    assert has_checkpoint(ec2, job.run_id, err.checkpoint_step), "the final checkpoint is complete on S3"
    logs = b"".join(v for k, v in ec2.objects(job.run_id).items() if "/logs/" in k)
    assert b"the driver asked for a final checkpoint: saving at step" in logs, logs[-3000:]
    assert ec2.leftovers(job.run_id) == []
