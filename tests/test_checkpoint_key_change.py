"""Checkpoints are never lost to a key change, and a reclaim notice's save is complete when it returns.

A checkpoint sealed under a key this job does not hold (a retry on a host with another checkpoint
secret, an earlier run of an explicit folder) is left in place, never pruned; an explicit folder
has one key per job store, so a later run resumes from it; with ``async_save=True`` the save a
reclaim notice asks for is awaited before ``save`` returns.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from support.aws_fixtures import MotoAWS
from prefect_sgpu.checkpoints import ENDPOINT_ENV, URI_ENV, Location
from prefect_sgpu.checkpoints.manifest import (FOLDERS_KEY_ENV, KEY_ENV, SECRET_ENV, folders_key,
                                              seal_marker)
from prefect_sgpu.pipeline.checkpoint import Checkpointer, complete_steps
from prefect_sgpu.pipeline.strategies import Wrapped


def _wrapped(seed: int = 0) -> Wrapped:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    return Wrapped("ddp", model, model, torch.optim.AdamW(model.parameters(), lr=0.1), torch.device("cpu"),
                   torch.float32)


def _resumes_and_saves(step: int) -> dict[str, Any]:
    """In a rank (keep=1): restore, save ``step``, and list the step folders left at the location."""
    w = _wrapped()
    ckpt = Checkpointer(w, every=1, keep=1)
    start, _ = ckpt.restore()
    ckpt.save(step)
    return {"start": start, "folders": sorted(p.name for p in ckpt.folder.iterdir() if p.name.startswith("step-"))}


def test_a_retry_on_a_host_with_another_secret_never_deletes_the_last_good_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempt 1 (secret A) seals step 3; attempt 2 on another host (secret B) cannot verify it and
    saves step 5 with keep=1: step 3 stays. Back on a host with secret A, attempt 3 resumes from step 3."""
    from prefect_sgpu import distributed

    location = str(tmp_path / "task")
    rank_env = {"PREFECT_SGPU_HOME": str(tmp_path / "rank-home"), URI_ENV: location}

    def attempt(secret: str, step: int) -> dict[str, Any]:
        monkeypatch.setenv(SECRET_ENV, secret)
        [got] = distributed(gpus=1, mlflow=False, env=rank_env)(_resumes_and_saves).distributed(step)
        return got

    first = attempt("a1" * 32, 3)
    assert first["folders"] == ["step-00000003"]
    second = attempt("b2" * 32, 5)
    assert second["start"] == 0, "another secret verifies nothing"
    assert second["folders"] == ["step-00000003", "step-00000005"], "the unverifiable step was deleted"
    monkeypatch.setenv(SECRET_ENV, "a1" * 32)
    assert complete_steps(location) == [3]
    third = attempt("a1" * 32, 7)
    assert third["start"] == 3, "the last good checkpoint of secret A was lost"


def test_an_explicit_s3_folder_keeps_its_key_across_runs_and_nothing_unverifiable_is_deleted(
        aws_env: MotoAWS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Two runs on EC2-like ranks (no user secret, each its own job location key) write one explicit
    ``s3://`` folder: the second resumes from the first's step; a step sealed under a key neither holds
    stays, with a warning naming the folder."""
    bucket = f"sgpu-ckpt-{uuid.uuid4().hex[:12]}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    folder = f"s3://{bucket}/explicit"
    monkeypatch.setenv("PREFECT_SGPU_HOME", str(tmp_path / "driver-home"))
    monkeypatch.delenv(SECRET_ENV, raising=False)
    shared = folders_key(f"s3://{bucket}/store")  # what the driver hands every job of that store
    monkeypatch.setenv("PREFECT_SGPU_HOME", str(tmp_path / "rank-home"))  # the rank cannot read the secret
    monkeypatch.setenv(ENDPOINT_ENV, aws_env.endpoint_url)

    def run(name: str, step: int) -> tuple[int, Any]:
        monkeypatch.setenv(URI_ENV, f"s3://{bucket}/store/{name}/checkpoints")  # each run's own location
        monkeypatch.setenv(KEY_ENV, os.urandom(32).hex())  # ... and its own key
        monkeypatch.setenv(FOLDERS_KEY_ENV, shared)
        monkeypatch.setenv("SGPU_JOB_DIR", str(tmp_path / name))  # a fresh node: nothing staged
        w = _wrapped(seed=step)
        ckpt = Checkpointer(w, folder, every=1, keep=1)
        start, extra = ckpt.restore()
        ckpt.save(step, {"by": name})
        return start, extra

    assert run("run-1", 2) == (0, {})
    foreign = Location(folder, stage=tmp_path / "foreign")  # a step sealed under a key no run holds
    (foreign.ensure_local() / "step-00000001").mkdir()
    torch.save({"x": torch.zeros(1)}, foreign.local / "step-00000001" / "model.pt")
    foreign._key = os.urandom(32).hex()
    files = foreign.upload("step-00000001")
    foreign.objects.put("step-00000001/COMPLETE", seal_marker(foreign._key, "step-00000001", {"step": 1}, files))

    with caplog.at_level(logging.WARNING, logger="prefect_sgpu.checkpoints"):
        start, extra = run("run-2", 4)
    assert (start, extra) == (2, {"by": "run-1"}), "the second run did not resume from the first's step"
    left = sorted({k.split("/")[0] for k in Location(folder).objects.keys()})
    assert left == ["step-00000001", "step-00000004"], "keep=1 pruned run 1's verified step, never the foreign one"
    assert f"checkpoint folder {folder}: step(s) 1 carry a marker this job's key cannot verify" in caplog.text


def test_a_reclaim_notices_async_save_is_complete_when_save_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``async_save=True`` and a slow store, the save a reclaim notice asks for is sealed and
    verifiable when ``save`` returns (the node may be gone a moment later); a regular one is not awaited."""
    from prefect_sgpu.pipeline import checkpoint as checkpoint_mod

    real = checkpoint_mod._atomic_torch_save

    def slow_write(obj: object, path: Path) -> None:  # a store whose writes take a while
        time.sleep(0.5)
        real(obj, path)

    monkeypatch.setattr(checkpoint_mod, "_atomic_torch_save", slow_write)
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    monkeypatch.setenv("SGPU_JOB_DIR", str(job_dir))
    folder = tmp_path / "ckpt"
    w = _wrapped()
    ckpt = Checkpointer(w, folder, every=2, async_save=True)
    assert ckpt.due(2)
    ckpt.save(2)
    assert complete_steps(folder) == [], "a regular async save returns before it is sealed"
    (job_dir / "preempt").write_text("spot interruption: terminate at 12:00:02Z")
    assert ckpt.due(3), "the notice makes the step due"
    threads_before = threading.active_count()
    ckpt.save(3)
    assert complete_steps(folder) == [2, 3], "the notice's save was not complete when save returned"
    assert threading.active_count() <= threads_before
    fresh = _wrapped(seed=1)
    assert Checkpointer(fresh, folder).restore()[0] == 3
