"""A bare image has no uv: the environment stage fetches the one uv wheel it pins, checked by sha256.

The indexes are :class:`support.wheel_index.WheelIndex` servers on 127.0.0.1 serving the real wheel
(PyPI's file, downloaded by ``./dev``) or a tampered file of the same name.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from support.wheel_index import WheelIndex, pinned_uv, uv_wheel

from prefect_sgpu.launch import node_env, stage_uv


@pytest.fixture
def bare_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No uv on PATH, no uv index of the image's own, its own environments' root."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    for name in (node_env.UV_INDEX_ENV, "UV_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(node_env.ENV_ROOT_ENV, str(tmp_path / "envs"))
    monkeypatch.setattr(stage_uv, "PYPI_SIMPLE", "http://127.0.0.1:9/simple")  # never the real PyPI here
    return tmp_path / "envs"


def _with_credentials(url: str) -> str:
    return url.replace("http://", "http://builder:tok-3f9a1c77e2@", 1)


def test_the_pinned_uv_is_fetched_once_from_the_environments_index_and_a_tampered_copy_is_passed_over(
        bare_node: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name, sha = pinned_uv()
    real = uv_wheel().read_bytes()
    with WheelIndex({name: b"#!/bin/sh\necho pwned\n"}, auth=("builder", "tok-3f9a1c77e2")) as bad, \
            WheelIndex({name: real}) as good:
        index = {"index_url": _with_credentials(bad.url), "extra_index_urls": [good.url]}
        node_env.hide(index["index_url"])
        tool = node_env.uv(index)
        assert Path(tool).parent.parent == bare_node / "tools" and Path(tool).name == "uv"
        version = subprocess.run([tool, "--version"], capture_output=True, text=True, check=True).stdout
        assert version.split()[:2] == ["uv", stage_uv.UV_VERSION]
        # the private index's credentials went with both requests (the file's link is relative to the page)
        assert bad.requests == ["/simple/uv/", f"/files/{name}"], "the tampered copy was downloaded and refused"
        said = capsys.readouterr().out
        assert f"fetched uv {stage_uv.UV_VERSION} ({name}) from {good.url.removesuffix('/simple')}/files/{name}" in said
        assert "tok-3f9a1c77e2" not in said

        asked = len(good.requests) + len(bad.requests)
        assert node_env.uv(index) == tool, "a second boot of this node reuses it"
        assert len(good.requests) + len(bad.requests) == asked, "nothing fetched again"
    assert list((bare_node / "tools").rglob(".uv-*")) == [], "no partial file left"


def test_an_image_setting_names_the_only_index_and_the_error_names_every_source_and_the_pin(
        bare_node: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name, sha = pinned_uv()
    with WheelIndex({name: b"not uv at all"}) as bad, WheelIndex({name: uv_wheel().read_bytes()}) as good:
        monkeypatch.setenv(node_env.UV_INDEX_ENV, _with_credentials(bad.url))
        node_env.hide(_with_credentials(bad.url))
        with pytest.raises(node_env.SetupError) as caught:
            node_env.uv({"index_url": good.url})  # the image's setting wins: the environment's is not tried
        assert good.requests == []
        text = str(caught.value)
        assert "environment setup failed at fetching uv" in text
        assert re.search(rf"its sha256 is [0-9a-f]{{64}}, not the pinned {sha}", text), text
        assert name in text and node_env.UV_INDEX_ENV in text and "environment='image'" in text
        assert "tok-3f9a1c77e2" not in text and "***@127.0.0.1" in text
        assert not (bare_node / "tools").exists() or not any((bare_node / "tools").rglob("uv")), "nothing kept"

        monkeypatch.delenv(node_env.UV_INDEX_ENV)
        with pytest.raises(node_env.SetupError, match=r"(?s)127\.0\.0\.1:9/simple/uv/: .*install uv in the image"):
            node_env.uv({})  # no index settings: PyPI (here an address nothing listens on)


def test_an_index_s_credentials_do_not_follow_its_redirect_to_another_host(bare_node: Path) -> None:
    name, _sha = pinned_uv()
    with WheelIndex({name: uv_wheel().read_bytes()}) as cdn:
        cdn_base = cdn.url.removesuffix("/simple")
        with WheelIndex({}, auth=("builder", "tok-3f9a1c77e2"), redirect=cdn_base) as private:
            tool = node_env.uv({"index_url": _with_credentials(private.url)})
        assert Path(tool).exists()
        assert private.requests == ["/simple/uv/"] and private.authorizations[0], "asked with its credentials"
        assert cdn.requests == ["/simple/uv/", f"/files/{name}"]
        assert cdn.authorizations == [None, None], "the credentials went to the redirect's host"


def test_the_image_s_uv_comes_first(bare_node: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    own = tmp_path / "bin" / "uv"
    own.parent.mkdir()
    own.write_text("#!/bin/sh\n")
    own.chmod(0o755)
    monkeypatch.setenv("PATH", f"{own.parent}:/usr/bin:/bin")
    assert node_env.uv({"index_url": "http://127.0.0.1:9/simple"}) == str(own)


def test_the_pinned_uv_is_the_one_the_project_pins() -> None:
    """node_env's pin follows constraints.txt's, so the drivers' uv and the nodes' are one version."""
    pins = (Path(__file__).parents[2] / "constraints.txt").read_text()
    assert f"uv=={stage_uv.UV_VERSION}\n" in pins
    assert all(wheel.startswith(f"uv-{stage_uv.UV_VERSION}-py3-none-") for wheel, _ in stage_uv.UV_WHEELS.values())
