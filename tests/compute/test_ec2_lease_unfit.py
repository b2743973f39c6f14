"""A warm lease whose job's cgroup could not be emptied serves no later job: the node says so in its
status and takes no more assignments, the driver does not give the lease back to the pool, its
instance is terminated, and the next job launches machines of its own.

moto's instances booted by :mod:`ec2_simulator` (each one's real user-data as local processes), as
in ``test_ec2_warm.py``; the node's bootstrap runs as root on this host's cgroup v2 hierarchy.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from support.conformance_ec2 import EC2Env
from prefect_sgpu import distributed
from prefect_sgpu.compute.remote.lease import lease_id
from prefect_sgpu.launch.job_cgroup import JobCgroup, cgroup2_root, own_cgroup

pytestmark = pytest.mark.e2e


def _in_its_cgroup(hold: bool) -> dict[str, Any]:
    """The rank's instance and cgroup; with ``hold``, a cgroup made below the job's own, which keeps
    the job's cgroup from being removed when the job ends (a job's processes run as root)."""
    import os
    from pathlib import Path

    from prefect_sgpu.launch.job_cgroup import cgroup2_root

    own = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
    if hold:
        root = cgroup2_root()
        assert root is not None
        (root / own.lstrip("/") / "held-by-the-job").mkdir()
    return {"instance": os.environ["SGPU_INSTANCE_ID"], "cgroup": own}


def test_a_lease_whose_jobs_cgroup_could_not_be_emptied_is_not_offered_to_the_next_job(ec2: EC2Env) -> None:
    if os.geteuid() != 0 or cgroup2_root() is None or own_cgroup() is None:
        pytest.skip("the node's bootstrap makes job cgroups as root on a cgroup v2 hierarchy only")
    compute = ec2.compute(keep_warm=300)
    fn = distributed(gpus=1, gpu_type="A10", remote=True, compute=compute, mlflow=False, timeout=300)(_in_its_cgroup)
    left: Path | None = None
    try:
        first = fn.job(True)
        one = first.run().values[0]
        root = cgroup2_root()
        assert root is not None
        left = root / one["cgroup"].lstrip("/")
        assert left.exists(), "the job's cgroup stays: it holds a cgroup of the job's making"
        lease = lease_id(first.run_id)

        second = fn.job(False)
        two = second.run().values[0]
        assert two["instance"] != one["instance"], "the next job ran on a machine of its own"
        assert len(ec2.sent_run_instances()) == 2, "the unfit lease was not offered: a second RunInstances"
        console = ec2.simulator.console(one["instance"])
        # said before the node's status, which tells the driver
        assert "could not be emptied and removed" in console and "serves no later job" in console, console[-3000:]
        deadline = time.monotonic() + 60
        while ec2.instances(lease, live=True) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ec2.instances(lease, live=True) == [], "the unfit lease's instance was terminated"
    finally:
        compute.close()
        if left is not None and left.exists():  # on a VM it goes with the machine; here it is this host's
            (left / "held-by-the-job").rmdir()
            JobCgroup(left).kill(timeout=5)
