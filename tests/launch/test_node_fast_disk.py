"""The node stage's fast disk (:func:`prefect_sgpu.launch.node_env.use_disk`): the environments' root, uv's
cache and the temp folder go to the instance store the Deep Learning AMIs mount at ``/opt/dlami/nvme``
when the mount table lists it; a temp folder stands in for it here (a fake mount table, or the folder
override a simulated node gets), and the root volume serves when there is none."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from prefect_sgpu.launch import ec2_stage, node_env

MOVED = (node_env.ENV_ROOT_ENV, "UV_CACHE_DIR", "TMPDIR")


@pytest.fixture(autouse=True)
def image_env() -> Iterator[None]:
    """A node whose image set none of what may move, and no override; the stage sets this process's own
    environment, which is put back afterwards. The tests set and delete variables here directly, not with
    ``monkeypatch``: the suite's own autouse fixtures take ``monkeypatch`` first, so its undo runs after this
    restore, and a ``delenv`` of what the stage set (``TMPDIR``) would put the stage's folder back into the
    test process's environment, where every later test's children took it as their temp folder."""
    saved = dict(os.environ)
    for name in (*MOVED, node_env.DISK_ENV):
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _table(tmp_path: Path, *mount_points: str) -> str:
    """A mount table as ``/proc/self/mounts`` writes it: the root volume, and ``mount_points`` on NVMe."""
    lines = ["/dev/nvme0n1p1 / ext4 rw,relatime,discard 0 0", "proc /proc proc rw,nosuid,nodev,noexec 0 0"]
    lines += [f"/dev/nvme1n1 {point} xfs rw,noatime,attr2,inode64 0 0" for point in mount_points]
    path = tmp_path / "mounts"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_an_instance_store_the_mount_table_lists_holds_the_environments_uvs_cache_and_the_temp_folder(
        tmp_path: Path) -> None:
    nvme = tmp_path / "opt-dlami-nvme"
    nvme.mkdir()
    node_env.use_disk((str(tmp_path / "elsewhere"), str(nvme)), _table(tmp_path, str(nvme)))
    assert {name: os.environ[name] for name in MOVED} == {
        node_env.ENV_ROOT_ENV: str(nvme / "prefect-sgpu" / "envs"), "UV_CACHE_DIR": str(nvme / "prefect-sgpu" / "uv-cache"),
        "TMPDIR": str(nvme / "prefect-sgpu" / "tmp")}
    assert all(Path(os.environ[name]).is_dir() for name in MOVED)
    assert node_env.env_root() == nvme / "prefect-sgpu" / "envs", "the stage builds its venvs there"


def test_a_folder_the_mount_table_does_not_list_is_not_taken_for_an_instance_store(tmp_path: Path) -> None:
    """On an instance type without instance store the DLAMI's folder may exist on the root volume."""
    plain = tmp_path / "opt-dlami-nvme"
    plain.mkdir()
    node_env.use_disk((str(plain),), _table(tmp_path))
    node_env.use_disk((str(plain),), str(tmp_path / "no-mount-table"))
    assert not [name for name in MOVED if name in os.environ] and list(plain.iterdir()) == []


def test_what_the_image_set_stays_and_the_override_names_the_disk_or_turns_the_search_off(
        tmp_path: Path) -> None:
    nvme, cache = tmp_path / "nvme", tmp_path / "image-cache"
    nvme.mkdir()
    os.environ["UV_CACHE_DIR"] = str(cache)
    os.environ[node_env.DISK_ENV] = ""  # off: even a listed mount is not used
    node_env.use_disk((str(nvme),), _table(tmp_path, str(nvme)))
    assert node_env.ENV_ROOT_ENV not in os.environ
    os.environ[node_env.DISK_ENV] = str(nvme)  # the folder as it is: no mount table asked
    node_env.use_disk((), str(tmp_path / "no-mount-table"))
    assert os.environ["UV_CACHE_DIR"] == str(cache), "the image's own setting wins"
    assert os.environ["TMPDIR"] == str(nvme / "prefect-sgpu" / "tmp")
    del os.environ["TMPDIR"]
    del os.environ[node_env.ENV_ROOT_ENV]
    os.environ[node_env.DISK_ENV] = str(tmp_path / "missing")  # not there: the root volume
    node_env.use_disk(())
    assert "TMPDIR" not in os.environ and node_env.ENV_ROOT_ENV not in os.environ


def test_the_stage_moves_its_environment_root_before_it_reads_anything(tmp_path: Path) -> None:
    """The stage as the user-data runs it, over the fake cloud's transport: the disk is chosen before the
    manifest is read (here it is missing, and the stage ends saying so)."""
    nvme, store = tmp_path / "nvme", tmp_path / "store"
    nvme.mkdir()
    store.mkdir()
    os.environ[node_env.DISK_ENV] = str(nvme)
    code = node_env.main([f"--store={store}", "--run-id=r1", f"--environment={'a' * 64}", f"--manifest={'b' * 64}",
                          "--transport=support.fake_stage", f"--secrets={tmp_path}", "--machine-id=m-1", "--index=0",
                          "--", "--run-id=r1"])
    assert code == 3 and (store / "r1" / "setup" / "m-1.log").exists()
    assert os.environ[node_env.ENV_ROOT_ENV] == str(nvme / "prefect-sgpu" / "envs")
    assert os.environ["TMPDIR"] == str(nvme / "prefect-sgpu" / "tmp")


def test_the_ec2_transport_names_the_deep_learning_amis_instance_store() -> None:
    assert ec2_stage.S3StageTransport.DISK_MOUNTS == ("/opt/dlami/nvme",)
