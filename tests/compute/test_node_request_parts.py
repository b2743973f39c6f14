"""The parts of a node's S3 request count besides its bootstrap's own client: the first stage's transport
(each attempt, handed on in an environment variable) and the ranks' files in the node's job folder."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from prefect_sgpu.launch import ec2_stage
from prefect_sgpu.protocol import node_requests


def test_the_stage_counts_each_attempt_of_its_s3_requests_for_the_bootstrap(
        aws_env: Any, aws_faults: Any, virtual_clock: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """S3 bills each attempt: a GET answered 503 SlowDown once and then served is two GETs, on the proxy's
    record and in what the stage hands the bootstrap it execs."""
    monkeypatch.delenv(node_requests.STAGE_ENV, raising=False)
    monkeypatch.setattr(ec2_stage, "SENT", {})
    bucket = f"sgpu-stage-meter-{uuid.uuid4().hex[:8]}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    s3 = ec2_stage.S3StageTransport(f"s3://{bucket}/jobs", aws_env.region, aws_env.endpoint_url)
    aws_faults.reset()
    s3.put("env/manifest.json", b"{}")
    aws_faults.fail_http(r"/env/manifest\.json$", "SlowDown", status=503, method="GET", times=1)
    assert s3.get("env/manifest.json") == b"{}"
    assert aws_faults.s3_requests() == {"PUT": 1, "GET": 2}
    # urllib's agent: what tells the stage's requests from botocore's on the proxy's record (test_ec2_e2e)
    assert {r.agent.split("/")[0] for r in aws_faults.requests if r.service == "rest"} == {"Python-urllib"}
    # the stage's literal name is the bootstrap's; set only for the bootstrap the stage execs, not in this process
    assert node_requests.parse_counts(s3.exec_env()[node_requests.STAGE_ENV]) == {"PUT": 1, "GET": 2}
    assert node_requests.STAGE_ENV not in os.environ


def test_a_node_adds_its_ranks_files_and_refuses_what_is_not_counts(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    node_requests.write_rank(tmp_path, 0, {"PUT": 2, "GET": 3, "HEAD": 0, "BOGUS": 9})
    node_requests.write_rank(tmp_path, 1, {"LIST": 1})
    folder = tmp_path / node_requests.RANKS_DIR
    (folder / "rank-2-1.json").write_text(json.dumps({"GET": -5}))  # a count out of range
    (folder / "rank-3-1.json").write_text("[1, 2]")  # not an object
    (folder / "rank-4-1.json").write_text(json.dumps({"GET": 1, "pad": "x" * node_requests.MAX_BYTES}))
    assert node_requests.read_ranks(tmp_path) == {"PUT": 2, "GET": 3, "LIST": 1}
    assert {"rank-2-1.json", "rank-3-1.json", "rank-4-1.json"} <= {
        name for name in (r.getMessage().split()[0] for r in caplog.records)}
    assert node_requests.parse_counts("GET=12, LIST=1,BOGUS=3,PUT=x,HEAD=") == {"GET": 12, "LIST": 1}
