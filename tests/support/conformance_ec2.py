"""The EC2 compute in the conformance suite, and the offline EC2 environment its tests share.

``EC2Env`` is one test's AWS: a store (in the bucket its worker's EC2 tests share), moto (through the fault proxy,
which records every request as it crossed the wire), a VPC whose private IPs are
loopback addresses, and the :class:`~ec2_simulator.EC2Simulator` that boots each
instance's real user-data as local processes. ``EC2Case`` adapts it to the
``ComputeCase`` protocol of :mod:`support.conformance`.
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.aws_fault_proxy import AWSFaultProxy
from support.aws_fixtures import MotoAWS, Network, free_port, live_instances
from support.ec2_simulator import EC2Simulator

from prefect_sgpu.protocol import jobfolder
from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute
from prefect_sgpu.compute.ec2.request import RUN_ID_TAG
from prefect_sgpu.environment import ENVIRONMENT_ENV, EnvironmentOptions
from prefect_sgpu.store.s3 import S3Store

#: the driver-heartbeat TTL of tests that wait for nodes to outlive a dead driver (they ask for it)
HEARTBEAT_TTL_S = 10.0
#: every other job's: long enough that a driver thread starved on a loaded machine (moto, the simulator
#: and the driver share one test process) is not taken for a dead driver by its nodes
JOB_HEARTBEAT_TTL_S = 30.0


@dataclass
class EC2Env:
    aws: MotoAWS
    settings: dict[str, Any]
    simulator: EC2Simulator
    bucket: str
    proxy: AWSFaultProxy | None = None

    def compute(self, **overrides: Any) -> EC2InstanceCompute:
        """A compute of this cloud. Its block-level environment leaves the driver's own modules out: a test
        worker's set of them grows with every test module it imports, and each new set would be a new
        environment for the shared env_root to build. A call's ``environment=`` wins, and
        ``compute.sgpu_environment = None`` gives a user's default (tests/compute/test_ec2_environment.py)."""
        compute = EC2InstanceCompute.from_settings({**self.settings, **overrides}, session=self.aws.session())
        mode = "image" if os.environ.get(ENVIRONMENT_ENV) == "image" else "driver"
        compute.sgpu_environment = EnvironmentOptions(mode=mode, auto_modules=False)
        return compute

    def store(self) -> S3Store:
        return S3Store(f"s3://{self.bucket}/jobs", session=self.aws.session(), endpoint_url=self.aws.endpoint_url)

    def instances(self, run_id: str, live: bool = False) -> list[dict[str, Any]]:
        flt = [{"Name": f"tag:{RUN_ID_TAG}", "Values": [run_id]}]
        if live:
            return live_instances(self.aws.client("ec2"), flt)
        found = []
        for page in self.aws.client("ec2").get_paginator("describe_instances").paginate(Filters=flt):
            for reservation in page["Reservations"]:
                found += reservation["Instances"]
        return found

    def objects(self, run_id: str) -> dict[str, bytes]:
        """Every object the job left in the store, by full key; a log a node is still appending to
        (pieces under ``<key>.parts/``) also under its own key, read as one object as readers do."""
        from prefect_sgpu.store.s3 import PARTS

        store = self.store()
        out = {}
        for page in store.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                            Prefix=f"jobs/{run_id}/"):
            for obj in page.get("Contents", []):
                key = obj["Key"]
                out[key] = store.get(run_id, key[len(f"jobs/{run_id}/"):]) or b""
                if f"{PARTS}/" in key:
                    whole = key.split(f"{PARTS}/", 1)[0]
                    if whole not in out:
                        out[whole] = store.get(run_id, whole[len(f"jobs/{run_id}/"):]) or b""
        return out

    def leftovers(self, run_id: str) -> list[str]:
        """What of job ``run_id`` still exists on (simulated) AWS and in its job folder."""
        ec2 = self.aws.client("ec2")
        run_filter = [{"Name": f"tag:{RUN_ID_TAG}", "Values": [run_id]}]
        left = [f"instance {i['InstanceId']} ({i['State']['Name']})" for i in self.instances(run_id, live=True)]
        left += [f"security group {g['GroupId']}"
                 for g in ec2.describe_security_groups(Filters=run_filter)["SecurityGroups"]]
        left += [f"placement group {g['GroupName']}"
                 for g in ec2.describe_placement_groups(Filters=run_filter)["PlacementGroups"]]
        ssm = self.aws.client("ssm")
        try:
            ssm.get_parameter(Name=jobfolder.ssm_key_parameter(run_id, self.store().scope))
            left.append(f"SSM parameter {jobfolder.ssm_key_parameter(run_id, self.store().scope)}")
        except ssm.exceptions.ParameterNotFound:
            pass
        prefix = f"jobs/{run_id}/"
        for key in self.objects(run_id):
            name = key[len(prefix):]
            if any(name == c or name.startswith(c + "/") for c in jobfolder.CONTROL):
                left.append(f"s3://{self.bucket}/{key}")
        return left

    def gated_driver(self) -> tuple[Any, Any, str]:
        """A driver user under the shipped driver policy and job roles under the shipped boundary, each
        call of either judged by an :class:`~support.iam_gate.IAMGate` on the proxy: (the driver's
        boto3 session, the gate, the boundary's ARN). The caller clears ``proxy.iam_gate`` when done."""
        import json

        import boto3

        from prefect_sgpu.compute.ec2 import roles
        from support.iam_gate import ACCOUNT, IAMGate

        assert self.proxy is not None
        iam = self.aws.client("iam")
        store_uri = self.settings["store_uri"]
        tag = uuid.uuid4().hex[:8]
        boundary = iam.create_policy(PolicyName=f"sgpu-node-boundary-{tag}", PolicyDocument=json.dumps(
            roles.node_boundary(store_uri, self.aws.region, ACCOUNT)))["Policy"]["Arn"]
        user = f"sgpu-driver-{tag}"
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName="prefect-sgpu-driver", PolicyDocument=json.dumps(
            roles.driver_policy(store_uri, self.aws.region, ACCOUNT, boundary)))
        keys = iam.create_access_key(UserName=user)["AccessKey"]
        gate = IAMGate(self.aws.region)
        gate.watch_user(user)
        gate.watch_roles_matching("sgpu-*")
        driver = boto3.Session(aws_access_key_id=keys["AccessKeyId"], aws_secret_access_key=keys["SecretAccessKey"],
                               region_name=self.aws.region)
        self.proxy.iam_gate = gate
        return driver, gate, boundary

    def sent_run_instances(self) -> list[dict[str, str]]:
        """RunInstances requests as they crossed the wire (query parameters)."""
        assert self.proxy is not None
        return [c.params for c in self.proxy.calls("RunInstances")]


def shared_env_root() -> Path:
    """The bare nodes' environments folder shared by every test on this machine (the stage's lock
    makes one node build while the others wait)."""
    import tempfile

    return Path(tempfile.gettempdir()) / f"sgpu-node-envs-{os.getuid()}"


#: moto endpoint -> the bucket its EC2 tests share as their store (:func:`ec2_environment`)
_SHARED_BUCKETS: dict[str, str] = {}


def _store_bucket(aws_env: MotoAWS, own: bool) -> str:
    """The bucket of a test's store: the one this moto server's tests share, or a new one (``own``)."""
    s3 = aws_env.client("s3")
    bucket = None if own else _SHARED_BUCKETS.get(aws_env.endpoint_url)
    if bucket is not None:
        try:
            s3.head_bucket(Bucket=bucket)
            return bucket
        except Exception:  # noqa: BLE001 - moto was reset: a new one
            pass
    bucket = f"sgpu-e2e-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    if not own:
        _SHARED_BUCKETS[aws_env.endpoint_url] = bucket
    return bucket


@contextmanager
def ec2_environment(aws_env: MotoAWS, aws_network: Network, workdir: Path,
                    proxy: AWSFaultProxy | None = None, bare: bool = True,
                    env_root: Path | None = None, own_bucket: bool = False) -> Iterator[EC2Env]:
    """A bucket, settings and a running simulator; checks nothing was leaked when it ends.

    The nodes boot a bare image (Python and pip: no uv, no prefect-sgpu, no checkout) and the
    environment stage of their user-data builds the driver's environment from what the job shipped
    to the store, as for users by default. ``env_root`` is where they keep built environments; by
    default one folder per machine (:func:`shared_env_root`), as if every instance of the suite had
    a disk that kept them, so an environment is built once (a test's own ``env_root`` builds it
    again: ``tests/compute/test_ec2_environment.py``). ``bare=False`` gives an image that has
    everything (the driver's venv, this checkout), with ``PREFECT_SGPU_ENVIRONMENT=image`` set for
    the test's duration. Either way its computes leave the driver's own modules out (:meth:`EC2Env.compute`).

    The store is one bucket for every test of this moto server (a worker's), as a team's store holds many
    jobs: each job's folder is its own run id's, and the environment's content-addressed files, shipped by
    the first job, are found in place by the next (shipping them to a new bucket is about 400 uploads,
    3-4 s of the test process's CPU). ``own_bucket=True`` gives the test a new, empty bucket of its own.
    """
    bucket = _store_bucket(aws_env, own_bucket)
    settings = {
        "region": aws_env.region,
        "subnet_ids": aws_network.subnet_ids,
        "instance_profile": aws_env.instance_profile_with_role(),  # each node signs with the role's keys
        "ami_id": aws_env.image_id(),
        "store_uri": f"s3://{bucket}/jobs",
        "endpoint_url": aws_env.endpoint_url,
        "heartbeat_ttl_s": JOB_HEARTBEAT_TTL_S,
        "agent_timeout_s": 90.0,
        "rendezvous_port": free_port(),
        "running_timeout_s": 60.0,
        "waiter_delay_s": 0.5,
        # the simulated g5 nodes get the run's cluster placement group (auto would give them none): the
        # end-to-end tests keep the group's life (created, swept, removed) in view
        "placement_group": "cluster",
        # the jobs' environment is this checkout's venv (6.6 GB with CUDA torch): node 0 of a cold build
        # would pack all of it into moto. tests/compute/test_ec2_environment.py packs a small one, and
        # bench/env.py measures the full size
        "pack_environments": False,
    }
    # the keys of the simulator's own reads, and of a node launched without a profile; every node of a
    # launch with a profile signs with the profile's role's keys only; the user-data itself carries no key
    node_env = {k: v for k, v in aws_env.env.items() if k != "AWS_ENDPOINT_URL"}
    node_env.pop("AWS_SECURITY_TOKEN", None)
    node_env.pop("AWS_SESSION_TOKEN", None)
    if bare and env_root is None:
        env_root = shared_env_root()
    # the worker's moto server runs in this process (support.aws_fixtures.moto_server)
    simulator = EC2Simulator(aws_env.client("ec2"), node_env, workdir, bare=bare, env_root=env_root,
                             moto_in_process=True)
    if proxy is not None:  # the simulator's IAM and STS reads are EC2's own: past the proxy, to moto
        simulator.control_plane_url = f"http://{proxy.upstream_host}:{proxy.upstream_port}"
    simulator.start()
    saved = os.environ.pop(ENVIRONMENT_ENV, None)
    if not bare:
        os.environ[ENVIRONMENT_ENV] = "image"
    env = EC2Env(aws_env, settings, simulator, bucket, proxy)
    if proxy is not None:  # "terminated" means powered off, as on EC2: no node writes after it
        proxy.on_terminate = lambda ids: simulator.wait_powered_off(ids, timeout=30)
    try:
        yield env
        leaked = [i["InstanceId"] for i in live_instances(aws_env.client("ec2"))]
        assert not leaked, f"instances left running: {leaked}"
        assert simulator.wait_powered_off(list(simulator.nodes), timeout=20), simulator.describe()
        assert not simulator.errors, simulator.errors
    finally:
        os.environ.pop(ENVIRONMENT_ENV, None)
        if saved is not None:
            os.environ[ENVIRONMENT_ENV] = saved
        if proxy is not None:
            proxy.on_terminate = None
        simulator.close()


class EC2Case:
    """EC2 instances on moto, booted by the simulator."""

    name = "ec2"

    def __init__(self, env: EC2Env) -> None:
        self.env = env

    def options(self, **overrides: Any) -> dict[str, Any]:
        return {"gpus": 2, "gpu_type": "A10", "remote": True, "mlflow": False, "compute": self.env.compute(),
                **overrides}

    def leftovers(self, run_id: str) -> list[str]:
        return self.env.leftovers(run_id)

    @contextmanager
    def stalled_acquire(self) -> Iterator[None]:
        """Instances launch, but no node ever boots: acquire waits for agents that never come."""
        boot = self.env.simulator.boot
        self.env.simulator.boot = lambda _inst: False
        try:
            yield
        finally:
            self.env.simulator.boot = boot

    def launched_for(self, job: Any) -> str:
        """The run id the instances were launched (tagged, grouped) for."""
        return str(job.run_id)

    def leave_behind(self, run_id: str, dead: bool) -> None:
        """An instance in the run's groups that never boots, the run's key parameter, a job folder;
        a dead run's resources tagged with a heartbeat TTL of 1 s, returned once its heartbeat is
        older than that and its grace on S3's clock (S3 dates objects itself)."""
        import time

        from prefect_sgpu.protocol.jobfolder import HEARTBEAT, JobFolder, new_key
        from prefect_sgpu.spec import JobSpec

        compute = self.env.compute(heartbeat_ttl_s=1.0 if dead else JOB_HEARTBEAT_TTL_S)
        request = compute.plan(JobSpec(gpus=1, gpu_type="A10", remote=True), run_id)
        boot = self.env.simulator.boot  # the run's instances never boot, whenever the simulator sees them
        self.env.simulator.boot = lambda inst: (
            {"Key": RUN_ID_TAG, "Value": run_id} not in inst.get("Tags", []) and boot(inst))
        compute.provisioner.provision(run_id, request.plan, request.user_data, attempts=request.run_instances)
        compute.provisioner.put_secret(request.key_parameter, new_key(), "a job's key")
        folder = JobFolder(compute.store, run_id, new_key())
        folder.put_payload(b"payload")
        folder.beat()
        deadline = time.monotonic() + 60
        while dead and compute.store.clock() - compute.store.top(run_id)[0][HEARTBEAT] < 3.0:
            assert time.monotonic() < deadline, "S3's clock did not move on"
            time.sleep(0.5)

    def check_sent(self, job: Any, shown: dict[str, Any]) -> None:
        """The request dry_run showed is the one launched: field by field, and on the wire."""
        allocation = job.allocation
        expected = dict(shown["run_instances"])
        sent = allocation.sent[-1]
        groups = sent.get("SecurityGroupIds")
        assert groups and all(g.startswith("sg-") for g in groups)
        assert expected.pop("SecurityGroupIds") == [f"<created: sgpu-{self.launched_for(job)}>"]
        # filled in at launch, and only these: the created group and the AMI's own root device
        root = self.env.aws.client("ec2").describe_images(ImageIds=[sent["ImageId"]])["Images"][0]["RootDeviceName"]
        assert [m["DeviceName"] for m in sent["BlockDeviceMappings"]] == [root]
        expected["BlockDeviceMappings"] = [{**m, "DeviceName": root} for m in expected["BlockDeviceMappings"]]
        differ = {k for k in {*sent, *expected} - {"SecurityGroupIds"} if sent.get(k) != expected.get(k)}
        assert not differ, {k: (expected.get(k), sent.get(k)) for k in differ}
        wire = [p for p in self.env.sent_run_instances() if p.get("ClientToken") == expected["ClientToken"]]
        assert wire, "RunInstances with the shown ClientToken reached EC2"
        params = wire[-1]
        assert base64.b64decode(params["UserData"]).decode() == expected["UserData"]
        assert (params["InstanceType"], params["MinCount"], params["MaxCount"], params["ImageId"]) == (
            expected["InstanceType"], str(expected["MinCount"]), str(expected["MaxCount"]), expected["ImageId"])
        assert params["SubnetId"] == expected["SubnetId"] and params["SecurityGroupId.1"] == groups[0]


class EC2WarmCase(EC2Case):
    """EC2 instances kept as a warm lease between jobs: each job leaves nothing of its own (key,
    control files); the lease itself ends when the case closes its compute."""

    name = "ec2_warm"

    def __init__(self, env: EC2Env) -> None:
        super().__init__(env)
        self.compute = env.compute(keep_warm=60)

    def options(self, **overrides: Any) -> dict[str, Any]:
        return super().options(compute=self.compute, **overrides)

    def launched_for(self, job: Any) -> str:
        from prefect_sgpu.compute.remote.lease import lease_id

        return lease_id(job.run_id)

    def check_sent(self, job: Any, shown: dict[str, Any]) -> None:
        assert "--lease" in shown["run_instances"]["UserData"] and shown["keep_warm"]
        super().check_sent(job, shown)

    def close(self) -> None:
        """End every lease of the case: nothing of any is left (instances, groups, key, control files)."""
        from prefect_sgpu.compute.ec2.request import STORE_TAG

        self.compute.close()
        store = f"s3://{self.env.bucket}/jobs"
        leases = set()
        for page in self.env.aws.client("ec2").get_paginator("describe_instances").paginate(
                Filters=[{"Name": f"tag:{STORE_TAG}", "Values": [store]}]):
            for reservation in page["Reservations"]:
                for inst in reservation["Instances"]:
                    leases |= {t["Value"] for t in inst.get("Tags", []) if t["Key"] == RUN_ID_TAG}
        left = {lease: self.env.leftovers(lease) for lease in sorted(leases)}
        assert not any(left.values()), f"what the case's leases left: {left}"
