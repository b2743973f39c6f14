"""A job's nodes' S3 requests in ``result.cost``, end to end: every node-side client counted, checked against
what the fault proxy saw each node's keys sign (moto server, real boto3 clients, the EC2 simulator booting
bare images whose first stage fetches the environment from the store)."""

from __future__ import annotations

import json
import uuid
from typing import Any
from urllib.parse import unquote

import pytest

from prefect_sgpu import distributed
from prefect_sgpu.protocol.jobfolder import status_key
from support.aws_fixtures import FAKE_CREDENTIALS
from support.conformance_ec2 import EC2Env

pytestmark = pytest.mark.e2e


def _checkpoint_objects(tag: str) -> int:
    """Each rank writes, reads and lists an object of the job's checkpoint location (``s3://`` on the job
    store) through its own store client, as a ``Checkpointer`` does."""
    from prefect_sgpu import runtime
    from prefect_sgpu.checkpoints import Location

    objects = Location().objects
    name = f"{tag}/rank-{runtime.rank()}"
    objects.put(name, b"state")
    assert objects.get(name) == b"state" and name in objects.keys(tag)
    return runtime.rank()


def _profile_with_role(ec2: EC2Env) -> str:
    """An instance profile with a role: each instance's keys (STS, served by its IMDS) are its own, so the
    proxy's record tells whose each request was."""
    iam = ec2.aws.client("iam")
    name = f"sgpu-node-meter-{uuid.uuid4().hex[:8]}"
    trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"},
                                                      "Action": "sts:AssumeRole"}]}
    iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust))
    iam.create_instance_profile(InstanceProfileName=name)
    iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)
    return name


def _kind(record: Any) -> str:
    """A recorded request's kind as the nodes count it (S3's billing: a listing GET is a LIST, a batch delete
    a DELETE)."""
    query = record.path.partition("?")[2]
    if record.method == "GET" and any(q in query for q in ("list-type", "delimiter=", "prefix=")):
        return "LIST"
    if record.method == "POST" and "delete" in query.split("&"):
        return "DELETE"
    return record.method


def test_the_nodes_s3_requests_are_what_their_keys_signed_up_to_their_status(ec2: EC2Env) -> None:
    """The cost's node requests add up the bootstrap's own client, the first stage's fetch of the environment
    (manifest, files: before the bootstrap existed) and each rank's own store client (here its checkpoint
    objects). On the wire, each node's requests are those its instance profile's keys signed (two nodes
    booted at once, each with role keys of its own); the node's
    part ends with its status, and what it reads after (the driver's heartbeat until its instance is gone)
    belongs to no figure."""
    assert ec2.proxy is not None
    result = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(
        instance_profile=_profile_with_role(ec2)), mlflow=False, timeout=600)(_checkpoint_objects).run("probe")
    assert result.values == [0, 1]
    nodes = result.cost["storage"]["nodes"]
    assert nodes["counted"] == "measured" and nodes["reported"] == 2, nodes

    records = [r for r in list(ec2.proxy.requests) if r.service == "rest" and r.method]
    driver_key = FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"]
    on_wire: dict[str, int] = {}
    stage_gets = rank_puts = 0
    signers: set[str] = set()
    for node in (0, 1):
        status = next(r for r in records if r.method == "PUT" and r.access_key != driver_key
                      and unquote(r.path).partition("?")[0].endswith(f"/{result.run_id}/{status_key(node)}"))
        signers.add(status.access_key)
        mine = [r for r in records if r.access_key == status.access_key]
        for r in mine[:mine.index(status) + 1]:
            on_wire[_kind(r)] = on_wire.get(_kind(r), 0) + 1
            path = unquote(r.path)
            stage_gets += r.method == "GET" and "/.environments/" in path
            rank_puts += r.method == "PUT" and "/checkpoints/" in path and "/probe/rank-" in path
    assert len(signers) == 2, f"each node signs with role keys of its own: {signers}"
    assert stage_gets >= 1 and rank_puts == 2, (stage_gets, rank_puts)  # both clients are on the wire ...
    assert nodes["requests"] == on_wire, (nodes["requests"], on_wire)  # ... and in the nodes' figure
