"""The node installs each pinned distribution only as the file whose sha256 the driver recorded.

The index is a :class:`support.wheel_index.WheelIndex` on 127.0.0.1 serving a small real wheel, or other
bytes under the same name for the same version; the installer is the real uv (the stage's pinned wheel).
"""

from __future__ import annotations

import base64
import hashlib
import io
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support.wheel_index import WheelIndex, uv_index

from prefect_sgpu.launch import node_env

PYTHON = "%d.%d" % sys.version_info[:2]
WHEEL = "tinypin-1.0-py3-none-any.whl"


def _wheel(says: str) -> bytes:
    """A valid wheel of ``tinypin`` 1.0 whose module returns ``says``."""
    files = {"tinypin/__init__.py": f"SAYS = {says!r}\n".encode(),
             "tinypin-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypin\nVersion: 1.0\n",
             "tinypin-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("tinypin-1.0.dist-info/RECORD,,")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
        whl.writestr("tinypin-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return out.getvalue()


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An environments' root of its own, an empty uv cache, uv from the stage's pinned wheel."""
    monkeypatch.setenv(node_env.ENV_ROOT_ENV, str(tmp_path / "envs"))
    monkeypatch.setenv(node_env.UV_INDEX_ENV, uv_index().url)
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    for name in ("UV_OFFLINE", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_FIND_LINKS"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "envs").mkdir()
    return tmp_path / "envs"


def _manifest(index_url: str, recorded: bytes) -> dict:
    return {"python": PYTHON, "pins": ["tinypin==1.0"], "requirements": [],
            "hashes": {"tinypin==1.0": [hashlib.sha256(recorded).hexdigest()]},
            "index": {"index_url": index_url, "extra_index_urls": [], "find_links": []}}


def _installed(venv: Path) -> list[str]:
    return sorted(p.name for p in venv.glob("lib/python*/site-packages/tinypin*"))


def test_an_index_serving_other_bytes_for_a_pinned_version_fails_the_stage_naming_it_and_installs_nothing(
        node: Path) -> None:
    real = _wheel("the driver's")
    with WheelIndex({WHEEL: _wheel("someone else's")}) as other:
        venv = node / "venv-a"
        with pytest.raises(node_env.SetupError) as caught:
            node_env.install(venv, _manifest(other.url, real))
        text = str(caught.value)
        assert "tinypin==1.0 did not install as the driver recorded it" in text, text
        assert hashlib.sha256(real).hexdigest() in text or "hash" in text.lower(), text
        assert f"/files/{WHEEL}" in other.requests, "the file was fetched and refused"
        assert _installed(venv) == [], "nothing installed"


def test_the_recorded_bytes_install_and_a_pin_without_a_recorded_hash_is_refused(node: Path) -> None:
    real = _wheel("the driver's")
    with WheelIndex({WHEEL: real}) as good:
        venv = node / "venv-b"
        node_env.install(venv, _manifest(good.url, real))
        says = subprocess.run([str(venv / "bin" / "python"), "-c", "import tinypin; print(tinypin.SAYS)"],
                              capture_output=True, text=True, check=True).stdout.strip()
        assert says == "the driver's"

        unrecorded = {**_manifest(good.url, real), "hashes": {"other==2.0": ["0" * 64]}}
        with pytest.raises(node_env.SetupError, match=r"records no sha256 for tinypin==1\.0"):
            node_env.install(node / "venv-c", unrecorded)
        assert _installed(node / "venv-c") == []


def test_the_packages_digest_names_the_hashes_only_when_recorded() -> None:
    base = {"format": 1, "implementation": "cpython", "python": PYTHON, "pins": ["tinypin==1.0"],
            "requirements": [], "index": {"index_url": None}}
    before = node_env.packages_digest(base)
    assert node_env.packages_digest({**base, "hashes": {}}) == before
    one = node_env.packages_digest({**base, "hashes": {"tinypin==1.0": ["a" * 64]}})
    other = node_env.packages_digest({**base, "hashes": {"tinypin==1.0": ["b" * 64]}})
    assert len({before, one, other}) == 3, "a pack of other bytes is another pack"
