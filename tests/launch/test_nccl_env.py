"""NCCL's environment on EFA nodes: what a rank sets, what it leaves to the job, how it names the plugin."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from prefect_sgpu.launch import nccl_env

NEW_DIR, OLD_DIR = "/opt/amazon/ofi-nccl/lib", "/opt/aws-ofi-nccl/lib"
EFA_NODE = {"SGPU_EFA": "1", "SGPU_EFA_RDMA": "1"}


def files(*paths: str):
    present = set(paths)
    return lambda path: path in present


def test_a_node_without_efa_sets_nothing() -> None:
    assert nccl_env.rank_env({}, (2, 21, 5), files(f"{NEW_DIR}/libnccl-net-ofi.so")) == {}
    assert nccl_env.agent_env({}, files(f"{NEW_DIR}/libnccl-net-ofi.so")) == {}


def test_newer_nccl_gets_the_plugins_absolute_path() -> None:
    """NCCL >= 2.19 opens NCCL_NET_PLUGIN as given: a path needs no loader path."""
    env = nccl_env.rank_env(EFA_NODE, (2, 21, 5), files(f"{NEW_DIR}/libnccl-net-ofi.so", f"{NEW_DIR}/libnccl-net.so"))
    assert env == {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1",
                   "NCCL_NET_PLUGIN": f"{NEW_DIR}/libnccl-net-ofi.so"}
    only_default = nccl_env.rank_env(EFA_NODE, (2, 19, 3), files(f"{OLD_DIR}/libnccl-net.so"))
    assert only_default["NCCL_NET_PLUGIN"] == f"{OLD_DIR}/libnccl-net.so"


def test_older_nccl_gets_a_suffix_or_its_default_name() -> None:
    """NCCL < 2.19 only opens libnccl-net-<value>.so, or libnccl-net.so without the variable."""
    named_only = nccl_env.rank_env(EFA_NODE, (2, 18, 3), files(f"{NEW_DIR}/libnccl-net-ofi.so"))
    assert named_only["NCCL_NET_PLUGIN"] == "ofi"
    both = nccl_env.rank_env(EFA_NODE, (2, 18, 3), files(f"{NEW_DIR}/libnccl-net-ofi.so", f"{NEW_DIR}/libnccl-net.so"))
    assert "NCCL_NET_PLUGIN" not in both
    unknown = nccl_env.rank_env(EFA_NODE, None, files(f"{OLD_DIR}/libnccl-net.so"))
    assert "NCCL_NET_PLUGIN" not in unknown


def test_no_rdma_and_no_plugin_leave_those_unset() -> None:
    env = nccl_env.rank_env({"SGPU_EFA": "1", "SGPU_EFA_RDMA": "0"}, (2, 21, 5), files())
    assert env == {"FI_PROVIDER": "efa"}  # the gang check then sees NCCL on sockets and says why


def test_what_the_job_or_image_set_wins() -> None:
    mine = {**EFA_NODE, "FI_PROVIDER": "efa;ofi_rxm", "NCCL_NET_PLUGIN": "none"}
    env = nccl_env.rank_env(mine, (2, 21, 5), files(f"{NEW_DIR}/libnccl-net-ofi.so"))
    assert env == {"FI_EFA_USE_DEVICE_RDMA": "1"}


def test_the_agent_gets_the_plugin_folder_first_on_the_loader_path() -> None:
    exists = files(f"{OLD_DIR}/libnccl-net.so")
    assert nccl_env.agent_env({**EFA_NODE, "LD_LIBRARY_PATH": "/usr/local/cuda/lib64"}, exists) == {
        "LD_LIBRARY_PATH": f"{OLD_DIR}:/usr/local/cuda/lib64"}
    assert nccl_env.agent_env(EFA_NODE, exists) == {"LD_LIBRARY_PATH": OLD_DIR}
    assert nccl_env.agent_env({**EFA_NODE, "LD_LIBRARY_PATH": f"/x:{OLD_DIR}"}, exists) == {}


def test_apply_sets_the_rank_environment_from_real_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin_dir = tmp_path / "ofi-nccl" / "lib"
    plugin_dir.mkdir(parents=True)
    (plugin_dir / "libnccl-net-ofi.so").write_bytes(b"")
    monkeypatch.setattr(nccl_env, "PLUGIN_DIRS", (str(tmp_path / "missing"), str(plugin_dir)))
    monkeypatch.setattr(nccl_env, "nccl_version", lambda: (2, 21, 5))
    environ = {**EFA_NODE, "NCCL_DEBUG": "WARN"}
    set_now = nccl_env.rank_env(environ, nccl_env.nccl_version(), os.path.exists, nccl_env.PLUGIN_DIRS)
    assert set_now["NCCL_NET_PLUGIN"] == str(plugin_dir / "libnccl-net-ofi.so")
    applied = nccl_env.apply(environ)
    assert applied == set_now and environ["FI_PROVIDER"] == "efa" and environ["NCCL_DEBUG"] == "WARN"


def test_the_nccl_version_reads_both_of_torchs_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: 21805)  # torch before 1.13: one number
    assert nccl_env.nccl_version() == (2, 18, 5)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    assert nccl_env.nccl_version() == (2, 21, 5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert nccl_env.nccl_version() is None
