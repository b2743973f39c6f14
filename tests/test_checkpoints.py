"""A checkpoint location's names never become paths outside its private stage.

The probe's scenario on a moto S3 server: whoever can write the store plants an object whose key
climbs out of the step folder (``step-99999999/../../…/x``) and an unsigned ``COMPLETE`` beside it.
The next restore (and ``load_model`` on the driver) must write nothing outside the stage and must
not pick that step. The stage itself is this user's alone and never a symlink.
"""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from support.aws_fixtures import MotoAWS
from prefect_sgpu.checkpoints.manifest import inside, name_problem
from prefect_sgpu.checkpoints import ENDPOINT_ENV, MARKER, URI_ENV, Location, private_dir
from prefect_sgpu.errors import CheckpointRefused
from prefect_sgpu.pipeline.checkpoint import Checkpointer, load_model
from prefect_sgpu.pipeline.strategies import Wrapped


def _wrapped(seed: int = 0) -> Wrapped:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    return Wrapped("ddp", model, model, torch.optim.AdamW(model.parameters(), lr=0.1), torch.device("cpu"),
                   torch.float32)


@pytest.fixture
def s3_location(aws_env: MotoAWS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, str, str]:
    """An S3 checkpoint location (the rank's own), a node stage under ``tmp_path/node``; returns the
    S3 client, the bucket and the location's key prefix."""
    bucket = f"sgpu-ckpt-{uuid.uuid4().hex[:12]}"
    s3 = aws_env.client("s3")
    s3.create_bucket(Bucket=bucket)
    prefix = "checkpoints/flow/train"
    monkeypatch.setenv(URI_ENV, f"s3://{bucket}/{prefix}")
    monkeypatch.setenv(ENDPOINT_ENV, aws_env.endpoint_url)
    monkeypatch.setenv("SGPU_JOB_DIR", str(tmp_path / "node"))
    return s3, bucket, prefix


def _files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_a_store_writers_climbing_key_and_unsigned_marker_write_nothing_outside_the_stage(
        s3_location: tuple[Any, str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    s3, bucket, prefix = s3_location
    w = _wrapped()
    Checkpointer(w, every=1).save(2, {"note": "ours"})
    outside = tmp_path / "outside"
    outside.mkdir()
    before = _files_under(tmp_path)
    climb = "../" * 40 + str(outside / "x").lstrip("/")
    s3.put_object(Bucket=bucket, Key=f"{prefix}/step-99999999/{climb}", Body=b"* * * * * root evil\n")
    s3.put_object(Bucket=bucket, Key=f"{prefix}/step-99999999/{MARKER}", Body=b'{"step": 99999999}')
    listed = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]
    assert any("/../" in k for k in listed), "the store keeps the climbing key as written"

    step, extra = Checkpointer(_wrapped(seed=1), every=1).restore()  # a new node: another stage
    assert (step, extra) == (2, {"note": "ours"}), "the planted step was not picked"
    assert not (outside / "x").exists(), "a store key wrote outside the stage"
    stage = tmp_path / "node" / "checkpoint-stage"
    new = _files_under(tmp_path) - before
    assert all(p.startswith(str(stage.relative_to(tmp_path))) for p in new), new
    assert not [p for p in new if "99999999" in p], "nothing of the planted step was staged"
    assert "step-99999999" in caplog.text and "no sealed manifest" in caplog.text

    with pytest.raises(CheckpointRefused, match="step-99999999"):  # the driver's load_model refuses it too
        load_model(f"s3://{bucket}/{prefix}/step-99999999/{climb}")
    assert not (outside / "x").exists()


def test_a_climbing_name_in_a_manifest_is_refused_by_name(s3_location: tuple[Any, str, str]) -> None:
    """Even a key holder cannot seal a manifest naming a path outside its folder."""
    from prefect_sgpu.checkpoints.manifest import FileEntry

    location = Location()
    with pytest.raises(CheckpointRefused, match=r"'\.\./\.\./x'.*'\.\.' part"):
        location.put_marker("step-00000001", {}, {"../../x": FileEntry(size=0, sha256="0" * 64)})


@pytest.mark.parametrize(("name", "problem"), [("a/b.pt", None), ("/etc/x", "absolute"), ("", "empty"),
                                               ("a//b", "part"), ("./a", "part"), ("a/../../b", "part"),
                                               ("a\\..\\b", "backslash"), ("a\x00b", "NUL"), (3, "string")])
def test_names_from_the_store_are_plain_and_relative(name: Any, problem: str | None) -> None:
    found = name_problem(name)
    assert (found is None) if problem is None else (problem in (found or "")), found


def test_a_name_that_resolves_outside_through_a_symlink_is_refused(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "link").symlink_to(tmp_path)
    assert inside(tmp_path / "root", "a/b.pt", "t") == tmp_path / "root" / "a" / "b.pt"
    with pytest.raises(CheckpointRefused, match="resolves outside"):
        inside(tmp_path / "root", "link/x", "t")


def test_the_stage_is_private_and_a_symlinked_stage_is_refused(s3_location: tuple[Any, str, str],
                                                               tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "node").mkdir()
    (tmp_path / "node" / "checkpoint-stage").symlink_to(elsewhere)  # planted before the job ran
    with pytest.raises(CheckpointRefused, match="symlink"):
        Checkpointer(_wrapped(), every=1)
    assert list(elsewhere.iterdir()) == [], "nothing was written through the link"

    (tmp_path / "node" / "checkpoint-stage").unlink()
    (tmp_path / "node" / "checkpoint-stage").mkdir(mode=0o777)
    os.chmod(tmp_path / "node" / "checkpoint-stage", 0o777)
    ckpt = Checkpointer(_wrapped(), every=1)
    for folder in (ckpt.folder, ckpt.folder.parent):
        assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700, folder


def test_a_symlinked_step_folder_in_the_stage_does_not_redirect_a_fetch(s3_location: tuple[Any, str, str],
                                                                        tmp_path: Path) -> None:
    Checkpointer(_wrapped(), every=1).save(1, {"note": "ours"})
    ckpt = Checkpointer(_wrapped(seed=1), every=1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    staged = ckpt.folder / "step-00000001"
    if staged.exists():
        import shutil

        shutil.rmtree(staged)
    staged.symlink_to(elsewhere)
    assert ckpt.restore() == (1, {"note": "ours"})
    assert list(elsewhere.iterdir()) == [], "the fetch wrote through the link"
    assert staged.is_dir() and not staged.is_symlink()


def test_without_a_job_folder_the_stage_is_in_this_users_home(aws_env: MotoAWS, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGPU_JOB_DIR", raising=False)
    monkeypatch.setenv("PREFECT_SGPU_HOME", str(tmp_path / "home"))
    location = Location("s3://bucket/checkpoints/x")
    stage = location.ensure_local()
    assert stage.parent == tmp_path / "home" / "checkpoint-stage"
    assert not str(stage).startswith("/tmp/sgpu-checkpoint-stage")
    assert stat.S_IMODE(os.lstat(stage.parent).st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder another user's takes root")
def test_a_stage_another_user_made_first_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / "stage"
    planted.mkdir(mode=0o700)
    os.chown(planted, 54321, 54321)
    with pytest.raises(CheckpointRefused, match="belongs to uid 54321"):
        private_dir(planted)


def test_a_checkpoint_saved_in_the_background_reaches_s3_sealed_and_restores_on_another_node(
        s3_location: tuple[Any, str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s3, bucket, prefix = s3_location
    w = _wrapped()
    ckpt = Checkpointer(w, every=1, async_save=True)
    ckpt.save(1, {"note": "first"})
    ckpt.save(2, {"note": "second"})  # waits for step 1's upload first
    ckpt.wait()
    listed = {o["Key"].removeprefix(prefix + "/") for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]}
    assert {f"step-00000002/{MARKER}", "step-00000002/model.pt", "step-00000002/extra-rank-00000.pt"} <= listed, listed
    monkeypatch.setenv("SGPU_JOB_DIR", str(tmp_path / "other-node"))  # another node: an empty stage
    fresh = _wrapped(seed=1)
    assert Checkpointer(fresh, every=1).restore() == (2, {"note": "second"})
    for key, value in fresh.module.state_dict().items():
        assert torch.equal(value, w.module.state_dict()[key]), key
