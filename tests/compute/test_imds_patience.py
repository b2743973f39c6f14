"""A node's instance-profile credentials when its metadata service answers late (a machine whose CPUs a
job keeps busy): botocore's defaults (1 s, one attempt) find none, and a client made then has none for
good (boto/botocore#1791, #2117). prefect-sgpu's clients wait longer, and a node passes the same patience
to its ranks and to the user's own boto3 clients, unless the user set their own.

Real boto3 clients against the worker's moto server; the metadata service is the simulator's IMDSv2
(``support.ec2_simulator.FakeIMDS``) with its credentials answered 1.5 s late. The end-to-end proof is
``tests/compute/test_recovery.py``'s rebalance test, whose nodes' IMDS answers credentials 1.5 s late."""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest

from prefect_sgpu import aws
from support.aws_fixtures import FAKE_CREDENTIALS
from support.ec2_simulator import FakeIMDS

#: later than botocore's default metadata timeout (1 s), well inside prefect-sgpu's (5 s)
LATE_S = 1.5


@pytest.fixture
def late_imds(aws_env: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeIMDS]:
    """A process whose only credentials are an instance profile's, served by an IMDS that answers them
    :data:`LATE_S` late (the environment's own keys and botocore's IMDS settings removed)."""
    keys = (FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"], FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"], "node-session")
    imds = FakeIMDS({"instance-id": "i-0123456789abcdef0", **FakeIMDS.role_entries("node-role", keys, 3600)},
                    credentials_answer_s=LATE_S)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SECURITY_TOKEN", "AWS_SESSION_TOKEN",
                 "AWS_METADATA_SERVICE_TIMEOUT", "AWS_METADATA_SERVICE_NUM_ATTEMPTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.url)
    try:
        yield imds
    finally:
        imds.close()


def _boto3_s3() -> Any:
    """An S3 client as a user's own code makes one (botocore's settings from the environment only)."""
    import boto3

    return boto3.session.Session().client("s3")


def test_botocores_defaults_find_no_credentials_when_imds_answers_late(late_imds: FakeIMDS) -> None:
    """The simulator's late IMDS bites: without patience, a plain client has no credentials."""
    from botocore.exceptions import NoCredentialsError

    with pytest.raises(NoCredentialsError):
        _boto3_s3().list_buckets()


def test_prefect_sgpus_clients_wait_for_credentials_imds_answers_late(late_imds: FakeIMDS) -> None:
    assert "Buckets" in aws.client("s3").list_buckets()


def test_a_node_passes_its_patience_to_the_users_own_clients_unless_the_user_set_theirs(
        late_imds: FakeIMDS, monkeypatch: pytest.MonkeyPatch) -> None:
    """The EC2 node host sets botocore's IMDS settings in the node's environment (which its agent and
    ranks inherit) where they are unset; a value the user set stays, in the environment and in what
    prefect-sgpu's own clients do."""
    from botocore.exceptions import NoCredentialsError

    from prefect_sgpu.launch.ec2_host import EC2NodeHost

    # late_imds removed both settings through monkeypatch: what the host sets is undone after the test
    monkeypatch.setenv("AWS_METADATA_SERVICE_NUM_ATTEMPTS", "2")
    EC2NodeHost(region="us-east-1")
    assert os.environ["AWS_METADATA_SERVICE_TIMEOUT"] == "5", "the node's patience is in its environment"
    assert os.environ["AWS_METADATA_SERVICE_NUM_ATTEMPTS"] == "2", "the user's own setting stays"
    assert "Buckets" in _boto3_s3().list_buckets()

    monkeypatch.setenv("AWS_METADATA_SERVICE_TIMEOUT", "1")  # the user asks for botocore's 1 s
    with pytest.raises(NoCredentialsError):
        aws.client("s3").list_buckets()
