"""``@ray_launch`` clusters run with Ray's token auth: a Ray without it (before 2.52.0) is refused.

An older Ray ignores ``RAY_AUTH_MODE=token`` and serves the cluster with no authentication;
``pyproject.toml`` must not allow one, the caller refuses one before anything is spent, and a
node refuses one before it starts any Ray process. No Ray cluster starts in this module.
"""

from __future__ import annotations

import tempfile
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.ray import ray_launch, token_auth

ROOT = Path(__file__).resolve().parents[2]


def test_the_ray_extra_and_the_checked_pin_have_token_auth() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    [ray] = [Requirement(r) for r in extras["ray"] if Requirement(r).name == "ray"]
    assert not ray.specifier.contains("2.51.1"), f"pyproject allows a Ray without token auth: {ray}"
    assert ray.specifier.contains(token_auth.TOKEN_AUTH_RAY)
    pins = [Requirement(line) for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line.startswith("ray==")]
    assert pins and all(ray.specifier.contains(next(iter(p.specifier)).version) for p in pins)


@pytest.mark.parametrize("version", ["2.40.0", "2.51.2", "2.52.0rc1", "not-a-version", None])
def test_a_ray_without_token_auth_is_refused(version: str | None) -> None:
    with pytest.raises(SGPUConfigError, match=r"ray=.*Ray >= 2\.52\.0") as err:
        token_auth.require_token_auth(version)
    assert err.value.field == "ray"


@pytest.mark.parametrize("version", ["2.52.0", "2.60.0", "3.0.0.dev0"])
def test_a_ray_with_token_auth_is_allowed(version: str) -> None:
    token_auth.require_token_auth(version)


def _driver() -> int:
    return 1


def test_the_caller_refuses_before_anything_is_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_auth, "installed_ray_version", lambda: "2.51.1")
    fn = ray_launch(gpus=2, nodes=2, mlflow=False)(_driver)
    with pytest.raises(SGPUConfigError, match=r"ray='2\.51\.1'.*Ray >= 2\.52\.0"):
        fn.job()
    monkeypatch.setattr(token_auth, "installed_ray_version", lambda: None)  # a driver of remote nodes
    assert fn.job().launcher.name == "ray", "no Ray here: the nodes check their own"


def test_a_node_whose_ray_lacks_token_auth_starts_no_ray_process(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    from prefect_sgpu.protocol.jobfolder import JobFolder, new_key
    from prefect_sgpu.ray import node

    started: list[str] = []

    class NoRay(node.RayNodeProcess):
        def start(self, *args: object, **kwargs: object) -> None:
            started.append("ray")
            raise RuntimeError("a Ray process was started")

    key = new_key()
    monkeypatch.setenv("SGPU_PAYLOAD_KEY", key)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(node, "RayNodeProcess", NoRay)
    monkeypatch.setattr(node, "installed_ray_version", lambda: "2.48.0")
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(var, raising=False)  # run() sets them in this process
    job_dir = tmp_path / "job"
    args = node.parse_args(["--run-id=run-1", f"--job-dir={job_dir}", "--node-index=0", "--nnodes=1",
                            "--gcs-endpoint=127.0.0.1:1", "--node-ip=127.0.0.1"])
    assert node.run(args) == 2
    assert started == []
    status = JobFolder.local(job_dir, key).status(0)
    assert status is not None and status.exit_code == 2
    assert "ray='2.48.0'" in (status.error or "") and "2.52.0" in (status.error or "")
