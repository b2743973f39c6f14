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


def test_the_recorded_bytes_install_and_a_malformed_record_is_refused(node: Path) -> None:
    real = _wheel("the driver's")
    with WheelIndex({WHEEL: real}) as good:
        venv = node / "venv-b"
        node_env.install(venv, _manifest(good.url, real))
        says = subprocess.run([str(venv / "bin" / "python"), "-c", "import tinypin; print(tinypin.SAYS)"],
                              capture_output=True, text=True, check=True).stdout.strip()
        assert says == "the driver's"
        assert "--hash=sha256:" + hashlib.sha256(real).hexdigest() in (venv / "sgpu" / "pins-hashed.txt").read_text()

        malformed = {**_manifest(good.url, real), "hashes": {"tinypin==1.0": ["not-a-sha256"]}}
        with pytest.raises(node_env.SetupError, match=r"the sha256s of tinypin==1\.0"):
            node_env.install(node / "venv-c", malformed)
        assert _installed(node / "venv-c") == []


def test_the_packages_digest_names_the_hashes_only_when_recorded() -> None:
    base = {"format": 1, "implementation": "cpython", "python": PYTHON, "pins": ["tinypin==1.0"],
            "requirements": [], "index": {"index_url": None}}
    before = node_env.packages_digest(base)
    assert node_env.packages_digest({**base, "hashes": {}}) == before
    one = node_env.packages_digest({**base, "hashes": {"tinypin==1.0": ["a" * 64]}})
    other = node_env.packages_digest({**base, "hashes": {"tinypin==1.0": ["b" * 64]}})
    assert len({before, one, other}) == 3, "a pack of other bytes is another pack"


# --- the driver: https only, and each pin's sha256 from the indexes the environment names -------------


def _with_pin(env, name: str = "tinypin", version: str = "1.0"):
    from prefect_sgpu.environment import Distribution

    return env.model_copy(update={"distributions": (Distribution(name=name, version=version),)})


@pytest.mark.parametrize("given,field", [({"index_url": "http://mirror.example/simple"}, "environment.index_url"),
                                         ({"extra_index_urls": ["https://a.example/simple", "http://b.example/simple"]},
                                          "environment.extra_index_urls[1]"),
                                         ({"find_links": ["http://c.example/wheels/"]}, "environment.find_links[0]")])
def test_an_http_index_is_refused_at_capture_naming_the_field_unless_allowed(given: dict, field: str) -> None:
    from prefect_sgpu.environment import capture
    from prefect_sgpu.errors import SGPUConfigError

    with pytest.raises(SGPUConfigError) as caught:
        capture(auto_modules=False, **given)
    assert caught.value.field == field, caught.value
    assert "https://" in str(caught.value) and "allow_http_index=True" in str(caught.value)
    with pytest.raises(SGPUConfigError, match="environment.allow_http_index"):
        capture(auto_modules=False, allow_http_index="sometimes", **given)
    assert capture(auto_modules=False, allow_http_index=True, **given).mode == "driver"


def test_the_manifest_records_each_pin_s_sha256_from_the_named_index_and_the_node_refuses_other_bytes(
        node: Path) -> None:
    from prefect_sgpu.environment import capture
    from prefect_sgpu.environment import ship as environment_ship

    real = _wheel("the driver's")
    sha = hashlib.sha256(real).hexdigest()
    with WheelIndex({WHEEL: real, "tinypin-0.9-py3-none-any.whl": b"another version"}) as index:
        env = _with_pin(capture(index_url=index.url, allow_http_index=True, auto_modules=False))
        manifest = environment_ship.manifest(env)
        assert manifest["pins"] == ["tinypin==1.0"] and manifest["hashes"] == {"tinypin==1.0": [sha]}
        assert "/simple/tinypin/" in index.requests and not any(r.startswith("/files/") for r in index.requests)

        # whoever controls the index later serves other bytes under the same name and version
        index.files[WHEEL] = _wheel("someone else's")
        with pytest.raises(node_env.SetupError, match=r"tinypin==1\.0 did not install as the driver recorded it"):
            node_env.install(node / "venv-d", manifest)
        assert _installed(node / "venv-d") == []
        index.files[WHEEL] = real
        node_env.install(node / "venv-e", manifest)
        assert [p for p in _installed(node / "venv-e") if p.startswith("tinypin-1.0")]

    plain = _with_pin(capture(auto_modules=False))
    assert "hashes" not in environment_ship.manifest(plain), "no index named: nothing looked up"


def test_an_index_the_driver_cannot_read_is_a_warning_naming_its_field_and_its_pins_install_by_version(
        caplog: pytest.LogCaptureFixture) -> None:
    from prefect_sgpu.environment import capture
    from prefect_sgpu.environment import ship as environment_ship

    env = _with_pin(capture(extra_index_urls=["http://tok-4b1e9@127.0.0.1:9/simple"], allow_http_index=True,
                            auto_modules=False))
    with caplog.at_level("WARNING", logger="prefect_sgpu.environment.hashes"):
        assert "hashes" not in environment_ship.manifest(env)
    said = caplog.text
    assert "environment.extra_index_urls[0]" in said and "***@127.0.0.1:9" in said and "by version" in said
    assert "tok-4b1e9" not in said


def test_the_stage_as_the_user_data_runs_it_loads_the_hashed_install_from_the_shipped_files(node: Path) -> None:
    """On a node the stage is a plain script (no package): the hashed install comes from the environment's
    own shipped ``stage_uv.py``, as uv does."""
    import types

    from prefect_sgpu.launch import stage_uv

    script = types.ModuleType("prefect_sgpu_node_env")
    exec(compile(Path(node_env.__file__).read_text(), "prefect_sgpu_node_env.py", "exec"), script.__dict__)  # noqa: S102
    asked: list[str] = []

    def shipped(path: str):
        asked.append(path)
        return stage_uv

    real = _wheel("the driver's")
    with WheelIndex({WHEEL: _wheel("someone else's")}) as other:
        with pytest.raises(script.SetupError, match=r"tinypin==1\.0 did not install as the driver recorded it"):
            script.install(node / "venv-f", _manifest(other.url, real), None, shipped)
    assert script.UV_MODULE in asked and _installed(node / "venv-f") == []
