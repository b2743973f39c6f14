"""A checkpoint counts only with a manifest sealed under its location's key, checked before any read.

Whoever can write the location (a shared folder, the store's bucket) can change a weight file,
forge a ``COMPLETE`` marker or its manifest, or move a genuine marker to a newer step: each is
refused with a log line, and the restore falls back to the newest verified step (or starts
fresh). A Prefect retry is a new job with a new job key; it verifies its task's checkpoints
because the key is derived per location from the driver's secret.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from support.aws_fixtures import MotoAWS
from prefect_sgpu.checkpoints.manifest import (KEY_ENV, SECRET_ENV, driver_secret, hash_folder, location_key,
                                              secret_path, seal_marker)
from prefect_sgpu.checkpoints import ENDPOINT_ENV, MARKER, URI_ENV, Location
from prefect_sgpu.errors import CheckpointRefused, SGPUConfigError
from prefect_sgpu.pipeline.checkpoint import Checkpointer, complete_steps, load_model, save_model
from prefect_sgpu.pipeline.strategies import Wrapped


def _wrapped(seed: int = 0) -> Wrapped:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    return Wrapped("ddp", model, model, torch.optim.AdamW(model.parameters(), lr=0.1), torch.device("cpu"),
                   torch.float32)


def _two_steps(folder: str | Path | None) -> dict[int, dict[str, torch.Tensor]]:
    """Steps 1 and 2 saved at ``folder``; the weights each holds."""
    w = _wrapped()
    ckpt = Checkpointer(w, folder, every=1, keep=3)
    weights = {}
    for step in (1, 2):
        with torch.no_grad():
            w.module.weight.add_(1.0)
        ckpt.save(step, {"at": step})
        weights[step] = {k: v.clone() for k, v in w.module.state_dict().items()}
    return weights


def _restored(folder: str | Path | None) -> tuple[int, dict[str, Any], dict[str, torch.Tensor]]:
    fresh = _wrapped(seed=7)
    step, extra = Checkpointer(fresh, folder, every=1).restore()
    return step, extra, fresh.module.state_dict()


def test_a_changed_weight_file_falls_back_to_the_newest_verified_step(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    weights = _two_steps(tmp_path)
    saved = torch.load(tmp_path / "step-00000002" / "model.pt", weights_only=True)
    chosen = {"model": {k: torch.full_like(v, 42.0) for k, v in weights[2].items()},
              "optimizer": saved["optimizer"]}
    torch.save(chosen, tmp_path / "step-00000002" / "model.pt")  # plain tensors: only the hash tells

    step, extra, state = _restored(tmp_path)
    assert (step, extra) == (1, {"at": 1}), "the changed step was skipped for the older verified one"
    assert all(torch.equal(state[k], weights[1][k]) for k in state), "the writer's weights were not loaded"
    assert "step-00000002: model.pt differs from its sealed manifest" in caplog.text
    assert "restoring an older checkpoint" in caplog.text

    shutil.rmtree(tmp_path / "step-00000001")
    assert _restored(tmp_path)[:2] == (0, {}), "no verified step: a fresh start"


def _copy_of_step_one_as(tmp_path: Path, step: int) -> Path:
    forged = tmp_path / f"step-{step:08d}"
    shutil.copytree(tmp_path / "step-00000001", forged)
    return forged


@pytest.mark.parametrize("forgery", ["unsigned", "another key", "moved", "extra file", "manifest edited"])
def test_a_forged_marker_or_manifest_is_refused(forgery: str, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    _two_steps(tmp_path)
    forged = _copy_of_step_one_as(tmp_path, 9)
    marker = forged / MARKER
    if forgery == "unsigned":  # what a marker looked like before: plain JSON
        marker.write_text(json.dumps({"step": 9, "strategy": "ddp", "world_size": 1}))
    elif forgery == "another key":  # hashes right, sealed by someone without this location's key
        marker.write_bytes(seal_marker(os.urandom(32).hex(), forged.name, {"step": 9}, hash_folder(forged)))
    elif forgery == "moved":  # step 1's genuine marker copied to a newer step: bound to its folder
        pass
    elif forgery == "extra file":  # a file the manifest does not name, beside genuine ones
        Location(tmp_path).put_marker(forged.name, {"step": 9})
        (forged / "zz_extra.pt").write_bytes(b"planted")
    else:  # the readable copy says one thing; only the sealed manifest counts
        Location(tmp_path).put_marker(forged.name, {"step": 9})
        doc = json.loads(marker.read_text())
        doc["files"] = 0
        doc["step"] = 9
        marker.write_text(json.dumps(doc))
        (forged / "model.pt").write_bytes(b"changed")

    step, extra, _ = _restored(tmp_path)
    assert (step, extra) == (2, {"at": 2}), f"{forgery}: the newest verified step is restored"
    if forgery == "extra file":
        assert complete_steps(tmp_path) == [1, 2, 9], "its marker is genuine: the files are what fails"
        assert "not in it: ['zz_extra.pt']" in caplog.text
    elif forgery == "manifest edited":
        assert "model.pt differs from its sealed manifest" in caplog.text
    else:
        assert complete_steps(tmp_path) == [1, 2], f"{forgery}: the forged step does not count"
        assert "step-00000009" in caplog.text and "refused" in caplog.text


def test_a_changed_file_on_s3_is_refused_and_nothing_of_it_stays_staged(
        aws_env: MotoAWS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    bucket = f"sgpu-ckpt-{uuid.uuid4().hex[:12]}"
    s3 = aws_env.client("s3")
    s3.create_bucket(Bucket=bucket)
    monkeypatch.setenv(URI_ENV, f"s3://{bucket}/ckpt")
    monkeypatch.setenv(ENDPOINT_ENV, aws_env.endpoint_url)
    monkeypatch.setenv("SGPU_JOB_DIR", str(tmp_path / "writer"))
    weights = _two_steps(None)
    buf = torch.load(Location().local / "step-00000002" / "model.pt", weights_only=True)
    buf["model"] = {k: torch.full_like(v, 42.0) for k, v in buf["model"].items()}
    local = tmp_path / "planted.pt"
    torch.save(buf, local)
    s3.upload_file(str(local), bucket, "ckpt/step-00000002/model.pt")

    monkeypatch.setenv("SGPU_JOB_DIR", str(tmp_path / "reader"))  # a new node: nothing staged
    step, extra, state = _restored(None)
    assert (step, extra) == (1, {"at": 1})
    assert all(torch.equal(state[k], weights[1][k]) for k in state)
    assert "step-00000002: model.pt differs from its sealed manifest" in caplog.text
    stage = Location().local
    assert sorted(p.name for p in stage.iterdir()) == ["step-00000001"], "no half-fetched step stays"


def test_load_model_checks_the_sealed_manifest_on_s3_and_in_a_folder(
        aws_env: MotoAWS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = f"sgpu-ckpt-{uuid.uuid4().hex[:12]}"
    s3 = aws_env.client("s3")
    s3.create_bucket(Bucket=bucket)
    monkeypatch.setenv(ENDPOINT_ENV, aws_env.endpoint_url)
    weights = {"w": torch.arange(6.0)}
    for location in (f"s3://{bucket}/ckpt", str(tmp_path / "ckpt")):
        monkeypatch.setenv(URI_ENV, location)
        monkeypatch.setenv("SGPU_JOB_DIR", str(tmp_path / "node"))
        uri = save_model(weights)
        monkeypatch.setenv("SGPU_JOB_DIR", str(tmp_path / "driver"))
        assert torch.equal(load_model(uri)["w"], weights["w"])
        planted = tmp_path / "planted.pt"
        torch.save({"w": torch.zeros(6)}, planted)
        if location.startswith("s3://"):
            s3.upload_file(str(planted), bucket, "ckpt/final/model.pt")
            shutil.rmtree(tmp_path / "driver")  # the driver fetches again
        else:
            shutil.copy(planted, tmp_path / "ckpt" / "final" / "model.pt")
        with pytest.raises(CheckpointRefused, match="model.pt differs from its sealed manifest"):
            load_model(uri)


def test_the_checkpoint_secret_is_private_and_concurrent_first_uses_agree(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_SGPU_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(SECRET_ENV, raising=False)
    found: list[str] = []
    threads = [threading.Thread(target=lambda: found.append(driver_secret())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(found)) == 1 and len(found) == 8
    assert stat.S_IMODE(os.lstat(secret_path()).st_mode) == 0o600
    assert [p.name for p in secret_path().parent.iterdir()] == [secret_path().name], "no temporary file stays"
    assert location_key("s3://b/x/") == location_key("s3://b/x") != location_key("s3://b/y")

    os.chmod(secret_path(), 0o644)
    with pytest.raises(SGPUConfigError, match="mode 644"):
        driver_secret()
    secret_path().unlink()
    secret_path().symlink_to(tmp_path / "someone-elses")
    with pytest.raises(SGPUConfigError, match="link"):
        driver_secret()
    monkeypatch.setenv(SECRET_ENV, "ab" * 32)  # workers that must agree share it this way
    assert driver_secret() == "ab" * 32


def test_the_driver_hands_ranks_their_locations_key_as_a_secret_never_in_the_environment() -> None:
    from prefect_sgpu import distributed

    job = distributed(gpus=1, mlflow=False)(_saves_and_restores).job(0)
    request, _, _ = job.prepare()
    launch = job.launch(request, ["127.0.0.1"], "127.0.0.1:1")
    assert KEY_ENV not in launch.env
    assert launch.secrets[KEY_ENV] == location_key(launch.env[URI_ENV])
    from prefect_sgpu.checkpoints.manifest import FOLDERS_KEY_ENV, folders_key

    assert FOLDERS_KEY_ENV not in launch.env
    assert launch.secrets[FOLDERS_KEY_ENV] == folders_key(job.store.root_uri), "explicit folders' key: per store"


def _saves_and_restores(step: int, other: str | None = None) -> dict[str, Any]:
    """In a rank that cannot read the user's secret (as on a remote node): restore, save ``step``,
    and say which steps it can verify at ``other`` (a location that is not its own)."""
    from prefect_sgpu.checkpoints.manifest import read_secret

    assert read_secret() is None and os.environ.get(KEY_ENV), "the rank has its location's key only"
    w = _wrapped()
    ckpt = Checkpointer(w, every=1)
    start, extra = ckpt.restore()
    if step:
        ckpt.save(step, {"by": os.environ["SGPU_RUN_ID"]})
    return {"start": start, "extra": extra, "other": complete_steps(other) if other else None}


def test_a_retry_is_a_new_job_with_a_new_key_and_still_verifies_its_tasks_checkpoints(tmp_path: Path) -> None:
    """Two attempts of one task share its location (as ``gpu_task`` keys it): the second, a new job
    with a new job key, restores what the first sealed. A rank of another task holds another
    location's key and verifies none of them."""
    from prefect_sgpu import distributed

    ours, theirs = str(tmp_path / "task-a"), str(tmp_path / "task-b")
    rank_env = {"PREFECT_SGPU_HOME": str(tmp_path / "rank-home")}  # no secret there: the rank's key only

    def attempt(location: str, step: int, other: str | None = None) -> dict[str, Any]:
        job = distributed(gpus=1, mlflow=False, env={**rank_env, URI_ENV: location})(_saves_and_restores)
        [got] = job.distributed(step, other)
        return got

    first = attempt(ours, 3)
    second = attempt(ours, 0)
    assert first["start"] == 0 and second["start"] == 3, "the retry restored the first attempt's step"
    assert second["extra"]["by"] != "", "sealed by the first attempt's job"
    assert complete_steps(ours) == [3], "the driver verifies it too"
    assert attempt(theirs, 0, other=ours)["other"] == [], "another task's rank cannot verify our steps"
