"""A bare node of an instance type with NVMe instance store (the simulator's ``instance_store_types``: a
folder of the node's own stands in for the Deep Learning AMIs' ``/opt/dlami/nvme``) builds the job's
environment there, caches there and gives the job its scratch there: nothing of it on the root volume."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefect_sgpu import distributed
from support.conformance_ec2 import EC2Env


def _where() -> dict[str, str]:
    import sys
    import tempfile

    return {"prefix": sys.prefix, "tmp": tempfile.gettempdir()}


@pytest.mark.e2e
def test_a_node_with_instance_store_builds_and_scratches_on_it(bare: EC2Env, tmp_path: Path) -> None:
    bare.simulator.instance_store_types = {"g5.xlarge"}
    fn = distributed(gpus=1, gpu_type="A10", remote=True, compute=bare.compute(agent_timeout_s=600.0), mlflow=False,
                     timeout=600)(_where)
    job = fn.job()
    (value,) = job.run().values
    (inst,) = bare.instances(job.run_id)
    disk = bare.simulator.workdir / inst["InstanceId"] / "opt-dlami-nvme" / "prefect-sgpu"
    assert Path(value["prefix"]).is_relative_to(disk / "envs"), value  # the venv the stage built
    assert Path(value["tmp"]).is_relative_to(disk / "tmp"), value      # the job's scratch (TMPDIR)
    assert not Path(value["prefix"]).is_relative_to(bare.simulator.env_root), "not the root volume's"
    console = bare.simulator.console(inst["InstanceId"])
    assert "built environment" in console and str(disk / "envs") in console, console
