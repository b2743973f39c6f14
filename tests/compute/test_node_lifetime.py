"""A node in cloud-init's world: no HOME, LANG or USER, cwd ``/``; an absolute lifetime; a reboot powers it off.

The user-data's rendering is checked without AWS; the simulator runs its cloud-init lines under
cloud-init's environment on moto instances (a mount namespace keeps ``/root`` and ``/var/lib`` in the
node's folder), where a scheduled shutdown comes due with no process of the node alive, and a reboot
runs the per-boot script, not the user-data. The whole job under cloud-init's environment, with a
reboot mid-training, is ``tests/compute/test_recovery.py::test_a_rebooted_instance_powers_off_...``.
"""

from __future__ import annotations

import base64
import time
from pathlib import Path

import pytest

from support.aws_fixtures import MotoAWS, Network
from support.ec2_simulator import EC2Simulator, pid_namespaces
from prefect_sgpu.compute.ec2 import request as rq
from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.spec import JobSpec


def test_the_user_data_sets_home_schedules_the_lifetime_and_installs_a_per_boot_power_off() -> None:
    script = rq.render_user_data("s3://bucket/jobs", "run-1", "eu-west-1", 900, lifetime_s=3 * 3600 + 600)
    lines = script.splitlines()
    first = 'export HOME=${HOME:-~} USER=${USER:-$(id -un)} LANG=${LANG:-C.UTF-8};cd "$HOME"||cd /tmp'
    assert lines.index(first) < next(i for i, x in enumerate(lines) if "bootstrap" in x)
    (schedule,) = [x for x in lines if x.startswith("shutdown -h +")]
    assert schedule == "shutdown -h +190||echo no lifetime>&2", schedule  # 3 h 10 min, in whole minutes
    assert lines.index(schedule) < lines.index("set -euo pipefail"), "a failed schedule does not stop the boot"
    assert f"b=${{PREFECT_SGPU_PER_BOOT_DIR:-{rq.PER_BOOT_DIR}}}/{rq.PER_BOOT_SCRIPT}" in lines
    assert "exec shutdown -h now" in script
    assert "shutdown -h +" not in rq.render_user_data("s3://bucket/jobs", "lease-1", "eu-west-1", 900, lease=True)
    assert rq.lifetime_minutes(61) == 2 and rq.lifetime_minutes(60) == 1
    with pytest.raises(SGPUConfigError, match="timeout.*more than 0 seconds"):
        rq.lifetime_minutes(0)


def test_a_cold_jobs_instances_live_its_timeout_plus_a_margin_and_terminate_on_shutdown() -> None:
    compute = EC2InstanceCompute.from_settings({"store_uri": "s3://bucket/jobs", "region": "eu-west-1",
                                                "subnet_ids": ["subnet-0123456789abcdef0"], "ami_id": "ami-12345678"})
    request = compute.plan(JobSpec(gpus=1, gpu_type="A10", remote=True, timeout=1800), "run-1")
    assert "\nshutdown -h +40||" in request.user_data  # 1800 s + LIFETIME_MARGIN_S
    for attempt in request.run_instances:
        assert attempt.params["InstanceInitiatedShutdownBehavior"] == "terminate"
        assert base64.b64encode(attempt.params["UserData"].encode()) == base64.b64encode(request.user_data.encode())
    again = compute.replan(request, gang=1)
    assert "\nshutdown -h +40||" in again.user_data and "--gang=1" in again.user_data
    warm = EC2InstanceCompute.from_settings({"store_uri": "s3://bucket/jobs", "region": "eu-west-1",
                                             "subnet_ids": ["subnet-0123456789abcdef0"], "ami_id": "ami-12345678",
                                             "keep_warm": 300})
    leased = warm.plan(JobSpec(gpus=1, gpu_type="A10", remote=True, timeout=1800), "run-2")
    assert "shutdown -h +" not in leased.user_data, "a lease's instances serve job after job"


def _wait(what: "object", condition: "object", timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.2)


@pytest.mark.skipif(not pid_namespaces(), reason="cloud-init's world needs PID and mount namespaces (root)")
def test_under_cloud_init_a_node_outlives_no_lifetime_and_a_reboot_powers_it_off(
        aws_env: MotoAWS, aws_network: Network, tmp_path: Path) -> None:
    """Two instances whose user-data is the product's cloud-init lines, recording what they were given,
    then sleeping as a job would. One loses every process and still terminates when its lifetime comes
    due; the other is rebooted: the per-boot script powers it off, and the user-data does not run again."""
    ec2 = aws_env.client("ec2")
    user_data = "\n".join([
        "#!/bin/bash",
        'root_home="$(getent passwd 0 | cut -d: -f6)"; env > "$root_home/given-env"; pwd > "$root_home/given-cwd"',
        *rq.cloud_init_lines(lifetime_s=4200),
        'echo "home=$HOME pwd=$(pwd) lang=$LANG user=$USER" > "$HOME/set"',
        'echo booted >> "$root_home/boots"',
        "exec sleep 600",
    ]) + "\n"
    node_env = {k: v for k, v in aws_env.env.items() if k != "AWS_ENDPOINT_URL"}
    simulator = EC2Simulator(ec2, node_env, tmp_path / "nodes", bare=True, interval=0.2).start()
    ids: list[str] = []
    try:
        assert simulator.cloud_init, "the default for a bare image where namespaces are available"
        ids = [i["InstanceId"] for i in ec2.run_instances(
            ImageId=aws_env.image_id(), InstanceType="g5.xlarge", MinCount=2, MaxCount=2,
            SubnetId=aws_network.subnet_ids[0], UserData=user_data,
            InstanceInitiatedShutdownBehavior="terminate")["Instances"]]
        roots = {iid: tmp_path / "nodes" / iid / "root" for iid in ids}
        _wait("both nodes ran their user-data", lambda: all((roots[i] / "set").exists() for i in ids))
        for iid in ids:
            given = dict(line.split("=", 1) for line in (roots[iid] / "given-env").read_text().splitlines()
                         if "=" in line)
            assert not {"HOME", "LANG", "USER", "LOGNAME"} & set(given), sorted(given)
            assert given["PATH"].endswith(":/usr/sbin:/usr/bin:/sbin:/bin"), given["PATH"]
            assert (roots[iid] / "given-cwd").read_text().strip() == "/"
            assert (roots[iid] / "set").read_text().strip() == \
                f"home={roots[iid]} pwd={roots[iid]} lang=C.UTF-8 user=root", "root's home, from /etc/passwd"
            assert simulator.scheduled_shutdown(iid) == "+70", simulator.scheduled_shutdowns(iid)
            assert (simulator.per_boot_dir(iid) / rq.PER_BOOT_SCRIPT).stat().st_mode & 0o111
            assert not simulator.shutdowns(iid), "scheduling powers nothing off"
        assert not Path("/var/lib/cloud/scripts/per-boot", rq.PER_BOOT_SCRIPT).exists(), "nothing in this /var"

        def state(iid: str) -> str:
            return ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]["State"]["Name"]

        lost, rebooted = ids
        simulator.freeze(lost)  # every process of the product stopped for good: nothing of it runs
        assert state(lost) == "running"
        assert simulator.end_lifetime(lost), "the lifetime was scheduled at boot"
        _wait(lambda: "the lifetime's end did not terminate the instance\n" + simulator.console(lost), lambda: state(lost) in ("shutting-down", "terminated"))

        simulator.reboot(rebooted)
        assert simulator.scheduled_shutdown(rebooted) is None, "a reboot drops the schedule"
        _wait(lambda: "the per-boot script did not power the rebooted node off:\n" + simulator.console(rebooted),
              lambda: state(rebooted) in ("shutting-down", "terminated"))
        assert "shutdown -h now" in simulator.shutdowns(rebooted)
        assert (roots[rebooted] / "boots").read_text() == "booted\n", "the user-data ran once"
        assert simulator.wait_powered_off(ids, timeout=30), simulator.describe()
        assert not simulator.errors, simulator.errors
    finally:
        if ids:
            ec2.terminate_instances(InstanceIds=ids)
        simulator.close()
