"""What the recovery tests on the simulated EC2 check: a checkpoint reached, a node's instance,
one recovery that replaced the lost node alone."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from support.conformance_ec2 import EC2Env
from support.training import STEPS


def when(condition: Callable[[], bool], timeout: float, what: str, while_alive: threading.Thread,
          outcome: dict[str, Any] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and while_alive.is_alive():
        if condition():
            return
        time.sleep(0.5)
    if not while_alive.is_alive():
        raise AssertionError(f"the job ended before {what}: {outcome!r}")
    raise AssertionError(f"{what} did not happen within {timeout:g}s")


def has_checkpoint(ec2: EC2Env, run_id: str, step: int) -> bool:
    key = f"jobs/{run_id}/checkpoints/step-{step:08d}/COMPLETE"
    return ec2.aws.client("s3").list_objects_v2(Bucket=ec2.bucket, Prefix=key).get("KeyCount", 0) > 0


def node_instance(ec2: EC2Env, run_id: str, index: int) -> str:
    live = [i for i in ec2.instances(run_id, live=True) if i["AmiLaunchIndex"] == index]
    return live[0]["InstanceId"]


def recovered_exactly_once(ec2: EC2Env, job: Any, outcome: dict[str, Any], lost: str, kept: str) -> Any:
    """One recovery that replaced the lost node 1 alone: node 0 ran both gangs on the same instance."""
    assert "error" not in outcome, repr(outcome.get("error"))
    result = outcome["result"]
    rank0 = result.values[0]
    assert rank0["optimizer_steps"] == STEPS, "the model saw exactly 60 optimizer steps over both gangs"
    assert rank0["start"] >= 20 and rank0["start"] + rank0["ran"] == STEPS, rank0
    (recovery,) = result.recoveries
    assert recovery.gang == 1 and recovery.nodes == {1: lost}, recovery
    assert recovery.replaced == "nodes" and recovery.kept == {0: kept}, recovery
    assert recovery.resumed_from_step == rank0["start"], "the second gang resumed from the newest checkpoint"
    assert recovery.reprovision_s > 0
    instances = ec2.instances(job.run_id)
    assert len(instances) == 3 and all(i["State"]["Name"] == "terminated" for i in instances), \
        "exactly one new instance was launched, and every instance is gone"
    tokens = {c.params["ClientToken"] for c in ec2.proxy.calls("RunInstances")} if ec2.proxy else set()
    assert len(tokens) == 2 or not ec2.proxy, "exactly one replacement provisioning"
    ran_on = [v["instance"] for v in result.values]
    assert ran_on[0] == kept, "node 0 ran the second gang on the instance it ran the first"
    assert ran_on[1] not in (None, lost, kept), "node 1 ran the second gang on the new instance"
    assert lost in result.released and ran_on[1] in result.released
    assert ec2.leftovers(job.run_id) == []
    return result
