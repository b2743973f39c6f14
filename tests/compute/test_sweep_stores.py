"""The sweeper on S3 stores, SSM and EC2 (moto server, real boto3): it judges ages on the store's
clock only, and never reaches another store's SSM parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest

from support.aws_fixtures import MotoAWS
from support.ec2_simulator import REPO_ROOT
from prefect_sgpu.protocol import jobfolder
from prefect_sgpu.compute.ec2 import request as rq
from prefect_sgpu.compute.ec2.instances import EC2Provisioner
from prefect_sgpu.compute.ec2.settings import EC2Settings
from prefect_sgpu.compute.remote.sweep import Sweeper
from prefect_sgpu.errors import SGPUError
from prefect_sgpu.protocol.jobfolder import HEARTBEAT, JobFolder, new_key, ssm_key_parameter, ssm_secrets_parameter
from prefect_sgpu.store.s3 import S3Store, http_date

#: how far the sweeper's own clock runs ahead of S3's in the clock test
AHEAD_S = 7200.0


def _bucket(aws: MotoAWS) -> str:
    name = f"sgpu-sweep-{uuid.uuid4().hex[:12]}"
    aws.client("s3").create_bucket(Bucket=name)
    return name


def _store(aws: MotoAWS, uri: str) -> S3Store:
    return S3Store(uri, session=aws.session(), endpoint_url=aws.endpoint_url)


def _provisioner(aws: MotoAWS, store: S3Store | None = None) -> EC2Provisioner:
    """EC2 as a driver of ``store`` (its tags on everything it writes), or as a sweeper (no tags)."""
    settings = EC2Settings(region=aws.region, endpoint_url=aws.endpoint_url)
    tags = rq.run_tags(store.root_uri, 60.0) if store is not None else None
    return EC2Provisioner(settings, session=aws.session(), run_tags=tags)


def _running(store: S3Store, run_id: str) -> JobFolder:
    """A job folder as a live driver keeps it: payload and a fresh heartbeat."""
    folder = JobFolder(store, run_id, new_key())
    folder.put_payload(b"payload")
    folder.beat()
    return folder


def _security_group(aws: MotoAWS, store: S3Store, run_id: str, ttl_s: int) -> str:
    """The run's security group, tagged as a driver tags it (run, store, heartbeat TTL)."""
    tags = [{"Key": rq.RUN_ID_TAG, "Value": run_id}, *({"Key": k, "Value": v} for k, v in
                                                       rq.run_tags(store.root_uri, ttl_s).items())]
    return str(aws.client("ec2").create_security_group(
        GroupName=f"sgpu-{run_id}", Description="a run's group",
        TagSpecifications=[{"ResourceType": "security-group", "Tags": tags}])["GroupId"])


def _age(store: S3Store, run_id: str) -> float:
    """How old the run's heartbeat is, both ends on S3's clock."""
    return store.clock() - store.top(run_id)[0][HEARTBEAT]


def test_a_sweeper_whose_clock_runs_hours_ahead_keeps_the_live_run_and_still_sweeps_the_dead_one(
        aws_env: MotoAWS) -> None:
    bucket = _bucket(aws_env)
    store = _store(aws_env, f"s3://{bucket}/jobs")
    live, dead = f"live-{uuid.uuid4().hex[:8]}", f"dead-{uuid.uuid4().hex[:8]}"
    _running(store, dead)
    groups = {run: _security_group(aws_env, store, run, ttl) for run, ttl in ((live, 3600), (dead, 1))}
    deadline = time.monotonic() + 60  # the dead run's heartbeat passes its TTL (1 s) and grace (0.5 s)
    while _age(store, dead) < 3.0:
        assert time.monotonic() < deadline, "S3's clock did not move on"
        time.sleep(0.5)
    _running(store, live)

    env = {**os.environ, **aws_env.env, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])}
    argv = [sys.executable, "-m", "support.shifted_clock", str(AHEAD_S), "prefect_sgpu.cli", "gc",
            "--store", store.root_uri, "--region", aws_env.region, "--endpoint-url", aws_env.endpoint_url,
            "--no-mlflow", "--json"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert not report["errors"], report
    assert live in report["live"], report
    assert not [x for x in report["found"] if x["run_id"] == live], "a live run is left whole"
    removed = {(x["kind"], x["name"]) for x in report["removed"] if x["run_id"] == dead}
    assert {("security group", groups[dead]), ("store files", "heartbeat, payload.bin")} <= removed, report
    files = store.top(live)[0]
    assert HEARTBEAT in files and jobfolder.PAYLOAD in files
    left = aws_env.client("ec2").describe_security_groups(
        Filters=[{"Name": "group-id", "Values": list(groups.values())}])["SecurityGroups"]
    assert [g["GroupId"] for g in left] == [groups[live]]
    _provisioner(aws_env).terminate(live)


def test_the_clock_of_an_s3_store_is_its_date_header() -> None:
    assert http_date("Thu, 26 Nov 2026 19:20:05 GMT", "s3") == 1795720805.0
    # a proxy on the way adds its own: the earliest counts (ages can only come out shorter)
    assert http_date("Thu, 26 Nov 2026 19:20:05 GMT, Thu, 26 Nov 2026 19:20:04 GMT", "s3") == 1795720804.0
    with pytest.raises(SGPUError, match="without a Date header"):
        http_date("", "the store s3://b/jobs")


def _parameters(run_id: str, store: Any) -> list[str]:
    return [ssm_key_parameter(run_id, store.scope), ssm_secrets_parameter(run_id, store.scope)]


def _exists(ssm: Any, name: str) -> bool:
    try:
        ssm.get_parameter(Name=name)
        return True
    except ssm.exceptions.ParameterNotFound:
        return False


def test_sweeping_one_store_leaves_every_ssm_parameter_of_another_stores_runs(aws_env: MotoAWS) -> None:
    bucket = _bucket(aws_env)
    mine, theirs = _store(aws_env, f"s3://{bucket}/team-a"), _store(aws_env, f"s3://{bucket}/team-b")
    ssm = aws_env.client("ssm")
    tag = uuid.uuid4().hex[:8]
    runs = {"a-live": f"a-live-{tag}", "a-ended": f"a-ended-{tag}",
            "b-live": f"b-live-{tag}", "b-ended": f"b-ended-{tag}"}
    for who, store in (("a", mine), ("b", theirs)):
        writer = _provisioner(aws_env, store)  # the driver's own write path: tagged with its store
        for state in ("live", "ended"):
            run_id = runs[f"{who}-{state}"]
            for name in _parameters(run_id, store):
                writer.put_secret(name, new_key(), "a job's parameter")
            if state == "live":
                _running(store, run_id)
            else:  # an ended job: its logs stay, its control files are gone
                store.put(run_id, jobfolder.log_key(0), b"done\n")
    # a retried write overwrites the parameter and keeps it tagged
    _provisioner(aws_env, theirs).put_secret(ssm_key_parameter(runs["b-live"], theirs.scope), new_key(),
                                             "written again")
    tags = ssm.list_tags_for_resource(ResourceType="Parameter",
                                      ResourceId=ssm_key_parameter(runs["b-live"], theirs.scope))
    assert {t["Key"]: t["Value"] for t in tags["TagList"]}[rq.STORE_TAG] == theirs.root_uri
    # whoever writes store A makes folders there named like store B's runs (a live one and an ended one)
    for run_id in (runs["b-live"], runs["b-ended"]):
        mine.put(run_id, jobfolder.log_key(0), b"not this store's run\n")
    theirs_before = {name: ssm.get_parameter(Name=name, WithDecryption=True)["Parameter"]["Value"]
                     for run in ("b-live", "b-ended") for name in _parameters(runs[run], theirs)}

    sweeper = Sweeper(mine, ttl_s=60.0, cloud=_provisioner(aws_env))
    dry = sweeper.sweep(dry_run=True)
    assert not [x for x in dry.found if x.kind == "SSM parameter" and x.run_id.startswith("b-")], dry.found
    for report in (sweeper.sweep(scan_store=False, wait=False), sweeper.sweep()):  # a job's start, then gc
        assert not report.errors, report.errors
        assert not [x for x in report.removed if x.kind == "SSM parameter" and not x.run_id.startswith("a-")]

    after = {name: ssm.get_parameter(Name=name, WithDecryption=True)["Parameter"]["Value"]
             for name in theirs_before}
    assert after == theirs_before, "every parameter of store B's runs is untouched"
    assert all(_exists(ssm, name) for name in _parameters(runs["a-live"], mine)), "a live run of A keeps its own"
    assert not any(_exists(ssm, name) for name in _parameters(runs["a-ended"], mine)), "A's ended run's are swept"
    for run_id, store in ((runs["a-live"], mine), (runs["b-live"], theirs), (runs["b-ended"], theirs)):
        for name in _parameters(run_id, store):
            ssm.delete_parameter(Name=name)
