"""One bad write to an environment's manifest or ``files/<sha>`` no longer breaks every later job of it
(issue 49, part B).

Nodes check the manifest and every shipped file against their sha256 and fail the job on a mismatch. The
driver used to skip the whole upload once the manifest was in the store, and any file whose key was
listed, so a cut or changed object (a store writer's, an interrupted writer's) failed every later job of
the environment. Now the driver checks what it would skip (the manifest by its sha256, each file by its
size from one listing and then its sha256) and uploads a bad one again. Against moto's S3 through real
boto3 clients, read back by the node's own stage transport and checks."""

from __future__ import annotations

import hashlib
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from prefect_sgpu.environment import Distribution, Environment, PythonVersion
from prefect_sgpu.environment import ship as environment_ship
from prefect_sgpu.environment.files import scan
from prefect_sgpu.launch import ec2_stage, node_env
from prefect_sgpu.store.s3 import S3Store
from support.aws_fixtures import MotoAWS


def _node_reads_every_file(s3: Any, env: Environment, cache: Path) -> int:
    """What a booting node does before it builds: the manifest and every shipped file, checked by sha256."""
    sha = environment_ship.manifest_sha256(env)
    base = f"{environment_ship.STORE_FOLDER}/{env.digest}"
    manifest = node_env.check_manifest(s3.get(f"{base}/manifest-{sha}.json"), sha)
    cache.mkdir(parents=True, exist_ok=True)
    shas = {entry[2] for tree in manifest["trees"] for entry in tree.get("files", [])}
    for file_sha in shas:
        node_env.fetch_file(s3, f"{base}/files", cache, file_sha)
    return len(shas)


def test_a_cut_or_changed_stored_file_or_manifest_is_uploaded_again_and_the_next_node_reads_good_bytes(
        aws_env: MotoAWS, aws_faults: Any, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("def train():\n    return 'trained'\n")
    (project / "data.py").write_text("ROWS = [1, 2, 3]\n")
    (project / "util.py").write_text("def util():\n    return 0\n")  # stays good: skipped every time
    bucket = f"sgpu-env-repair-{uuid.uuid4().hex[:8]}"
    s3_client = aws_env.client("s3")
    s3_client.create_bucket(Bucket=bucket)
    store = S3Store(f"s3://{bucket}/jobs", session=aws_env.session(), endpoint_url=aws_env.endpoint_url)
    env = Environment(python=PythonVersion.here(),
                      distributions=(Distribution(name="six", version=metadata.version("six")),),
                      working_dir=scan("working_dir", project, "environment.working_dir"))
    first = environment_ship.ship(store, env)
    assert (first["uploaded"], first["repaired"]) == (3, 0)
    node = ec2_stage.S3StageTransport(f"s3://{bucket}/jobs", aws_env.region, aws_env.endpoint_url)
    assert _node_reads_every_file(node, env, tmp_path / "node-0") == first["uploaded"]

    # one bad write each: a file cut short, a file changed in place (same size), the manifest changed
    base = f"jobs/{environment_ship.STORE_FOLDER}/{env.digest}"
    train = hashlib.sha256((project / "train.py").read_bytes()).hexdigest()
    data = hashlib.sha256((project / "data.py").read_bytes()).hexdigest()
    s3_client.put_object(Bucket=bucket, Key=f"{base}/files/{train}", Body=b"def train():\n")
    s3_client.put_object(Bucket=bucket, Key=f"{base}/files/{data}", Body=b"ROWS = [6, 6, 6]\n")
    manifest_key = f"{base}/manifest-{environment_ship.manifest_sha256(env)}.json"
    stored = s3_client.get_object(Bucket=bucket, Key=manifest_key)["Body"].read()
    s3_client.put_object(Bucket=bucket, Key=manifest_key, Body=stored.replace(b'"format":1', b'"format":2'))
    with pytest.raises(node_env.SetupError):  # as every node of every later job would, until it is repaired
        _node_reads_every_file(node, env, tmp_path / "node-1")

    # the next job's ship finds all three and uploads them again; a fresh node then reads good bytes
    second = environment_ship.ship(store, env)
    assert (second["uploaded"], second["skipped"], second["repaired"]) == (2, 1, 3), second
    assert _node_reads_every_file(node, env, tmp_path / "node-2") == first["uploaded"]

    # later ships of this process read a file again only when it was written since it was checked or
    # uploaded by this process: the two it uploaded again are not read back, nor is anything after
    for _ in range(2):  # GETs: the manifest and the files' listing, no file
        before = len(aws_faults.requests)
        again = environment_ship.ship(store, env)
        assert (again["uploaded"], again["repaired"]) == (0, 0)
        reads = [r for r in aws_faults.requests[before:] if r.service == "rest" and r.method == "GET"]
        assert len(reads) == 2, [r.path for r in reads]

    # a file written by someone else after this process uploaded it is read (and repaired) again
    s3_client.put_object(Bucket=bucket, Key=f"{base}/files/{data}", Body=b"ROWS = [7, 7, 7]\n")
    repaired = environment_ship.ship(store, env)
    assert (repaired["uploaded"], repaired["repaired"]) == (1, 1), repaired
    assert _node_reads_every_file(node, env, tmp_path / "node-3") == first["uploaded"]
