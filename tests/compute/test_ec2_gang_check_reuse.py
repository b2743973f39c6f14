"""The gang check on warm EC2 leases: a lease that passed it and is unchanged is not checked again at
its next job (within ``PREFECT_SGPU_GANG_CHECK_REUSE_S``); after a failed job on it, it is checked
again (the local compute's test covers the failure; the rules are the driver's, whatever the compute).
The local compute's warm sets: ``tests/test_launch_latency.py``. (Ray computes run Ray's own
setup, not the gang check.)"""

from __future__ import annotations

import pytest

from support.conformance_ec2 import EC2Env
from prefect_sgpu import distributed, runtime
from prefect_sgpu.driver.job import GANG_CHECK_REUSE_ENV

pytestmark = pytest.mark.e2e


def _rank() -> int:
    return runtime.rank()


def test_a_warm_lease_is_gang_checked_once_while_unchanged(ec2: EC2Env, monkeypatch: pytest.MonkeyPatch) -> None:
    compute = ec2.compute(keep_warm=300)
    try:
        fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=compute, mlflow=False, timeout=300)(_rank)
        first = fn.run()
        assert first.values == [0, 1]
        assert first.gang_check is not None and first.gang_check_reused_s is None, "a new lease: checked"
        assert first.gang_check["links"], "two nodes: the links between them measured"
        second = fn.run()
        assert second.values == [0, 1] and len(ec2.sent_run_instances()) == 1, "the same lease"
        assert second.gang_check is None and second.gang_check_reused_s is not None, "unchanged: not again"
        monkeypatch.setenv(GANG_CHECK_REUSE_ENV, "0")  # the pass is now older than the reuse window
        third = fn.run()
        assert len(ec2.sent_run_instances()) == 1
        assert third.gang_check is not None and third.gang_check_reused_s is None, "too old: checked again"
    finally:
        compute.close()
