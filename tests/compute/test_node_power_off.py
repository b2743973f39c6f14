"""A node whose bootstrap dies after its driver is gone still ends: the user-data powers it off.

moto server and the EC2 simulator, which runs the instance's real user-data (and in it the real
bootstrap) as local processes, with a ``shutdown`` that does what instance-initiated shutdown with
behaviour "terminate" does on EC2.
"""

from __future__ import annotations

import signal
import time
import uuid

import psutil
import pytest

from support.conformance_ec2 import EC2Env
from prefect_sgpu.protocol.jobfolder import JobFolder, alive_key, new_key, ssm_key_parameter
from prefect_sgpu.spec import JobSpec

pytestmark = pytest.mark.e2e


def _bootstrap(ec2: EC2Env, instance_id: str) -> psutil.Process | None:
    """The node's bootstrap process, once it runs."""
    node = ec2.simulator.nodes.get(instance_id)
    if node is None:
        return None
    try:
        tree = psutil.Process(node.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for proc in tree:
        try:
            if "prefect_sgpu.launch.bootstrap" in " ".join(proc.cmdline()):
                return proc
        except psutil.NoSuchProcess:
            continue
    return None


def test_a_node_whose_bootstrap_is_killed_after_its_driver_is_gone_powers_itself_off(ec2_image: EC2Env) -> None:
    """The driver wrote the key and a heartbeat, launched one node and died. The node's bootstrap
    takes over (its alive document is in the store), then is SIGKILLed long before the heartbeat
    TTL would have it end the instance: nothing of the bootstrap runs any more, and the instance
    still ends terminated, by its own shutdown. (Launched through the compute's own calls, with no
    job to ship an environment: the image has everything.)"""
    ec2 = ec2_image
    compute = ec2.compute(heartbeat_ttl_s=900.0, agent_timeout_s=900.0)
    run_id = f"orphan-{uuid.uuid4().hex[:8]}"
    request = compute.plan(JobSpec(gpus=1, gpu_type="A10", remote=True), run_id)
    key = new_key()
    folder = JobFolder(ec2.store(), run_id, key)
    folder.beat()  # the driver's last heartbeat
    compute.provisioner.put_secret(ssm_key_parameter(run_id, ec2.store().scope), key, "the job key of a driver that died")
    try:
        (iid,) = [i.id for i in compute.provisioner.provision(run_id, request.plan, request.user_data,
                                                              attempts=request.run_instances)]
        deadline = time.monotonic() + 180
        while alive_key(0) not in folder.node_documents():  # the bootstrap took over and announced itself
            assert time.monotonic() < deadline, "the bootstrap never announced itself\n" + \
                ec2.simulator.console(iid)
            time.sleep(0.5)
        bootstrap = _bootstrap(ec2, iid)
        assert bootstrap is not None, ec2.simulator.describe()
        bootstrap.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 120
        while ec2.instances(run_id, live=True):
            assert time.monotonic() < deadline, "the instance outlived its bootstrap\n" + ec2.simulator.console(iid)
            time.sleep(0.5)
        assert "-h now" in ec2.simulator.shutdowns(iid), "terminated by its own shutdown"
        assert ec2.simulator.wait_powered_off([iid], timeout=30), ec2.simulator.describe()
    finally:
        compute.provisioner.terminate(run_id)  # a failed assertion above must not leak the instance
        compute.provisioner.delete_secret(ssm_key_parameter(run_id, ec2.store().scope))
