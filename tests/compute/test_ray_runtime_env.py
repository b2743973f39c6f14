"""``environment=`` on Ray: mapped onto Ray's own ``runtime_env`` (``prefect_sgpu.ray.runtime_env``).

The unit tests check the mapping, the merge with a user's ``runtime_env`` and the refusals, all
before anything is started. The end-to-end test runs a RayCompute job on a real two-node cluster
on loopback whose workers import a module of the project (``working_dir``) and a wheel that only
Ray's pip installs (``requirements`` with ``find_links``, no index: nothing leaves the machine).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from prefect_sgpu import SGPUConfigError, distributed
from prefect_sgpu.environment import capture
from prefect_sgpu.ray import RayCompute
from prefect_sgpu.ray.runtime_env import from_environment, merged
from support.ray_image import image_python, tiny_wheel

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    (root / "data").mkdir(parents=True)
    (root / "features.py").write_text('TAG = "from-the-project"\n')
    (root / "data" / "big.bin").write_bytes(b"x" * 100)
    (root / "notes.txt").write_text("kept out by .gitignore\n")
    (root / ".gitignore").write_text("notes.txt\n")
    return root


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    folder = tmp_path / "wheels"
    tiny_wheel(folder, "sgpu_tiny", "1.0", "VALUE = 42\n")
    return folder


def _probe() -> dict:
    import features  # noqa: I001 - the working_dir's
    import sgpu_tiny  # Ray's pip's

    return {"tag": features.TAG, "value": sgpu_tiny.VALUE}


# -- the mapping --------------------------------------------------------------------------------


def test_working_dir_py_modules_and_requirements_map_onto_ray_keys(project: Path, wheels: Path,
                                                                   tmp_path: Path) -> None:
    pkg = tmp_path / "shared" / "helpers"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("X = 1\n")
    env = capture(working_dir=project, excludes=["data/"], py_modules=[str(pkg)], requirements=["sgpu-tiny==1.0"],
                  index_url="https://mirror.example/simple", find_links=[str(wheels)], auto_modules=False)
    mapped = from_environment(env)
    assert mapped["working_dir"] == str(project)
    assert mapped["py_modules"] == [str(pkg)]
    assert "/data/" in mapped["excludes"] and "__pycache__/" in mapped["excludes"], \
        "Ray uploads what the capture kept: excludes= and the defaults"
    assert mapped["pip"] == {"packages": ["sgpu-tiny==1.0"], "pip_install_options": [
        "--disable-pip-version-check", "--no-cache-dir", "--index-url", "https://mirror.example/simple",
        "--find-links", str(wheels)]}


def test_the_driver_default_sends_no_pinned_distributions() -> None:
    env = capture()
    assert env.mode == "driver" and len(env.distributions) > 50
    mapped = from_environment(env)
    assert not {"pip", "uv", "conda", "working_dir"} & set(mapped), "an existing cluster keeps its own image"
    # only the driver's own modules go up (this test module among them), as files: nothing is installed
    assert str(Path(__file__).resolve()) in mapped["py_modules"], mapped
    assert mapped["py_modules"] == [t.source for t in env.py_modules]
    assert from_environment(capture(auto_modules=False)) == {}, "without them: nothing to install or upload"


def test_image_mode_uploads_files_and_installs_nothing(project: Path) -> None:
    mapped = from_environment(capture(working_dir=project, mode="image"))
    assert mapped["working_dir"] == str(project) and "pip" not in mapped


def test_a_user_runtime_env_combines_with_environment(project: Path, tmp_path: Path) -> None:
    env = capture(working_dir=project, requirements=["sgpu-tiny==1.0"], auto_modules=False)
    out = merged({"env_vars": {"A": "1"}, "py_modules": ["gcs://_ray_pkg_abc.zip"]}, env)
    assert out["env_vars"] == {"A": "1"} and out["working_dir"] == str(project)
    assert out["py_modules"] == ["gcs://_ray_pkg_abc.zip"] and out["pip"]["packages"] == ["sgpu-tiny==1.0"]


@pytest.mark.parametrize("given, field", [
    ({"working_dir": "/srv/other"}, "runtime_env.working_dir"),
    ({"pip": ["einops"]}, "runtime_env.pip"),
    ({"uv": {"packages": ["einops"]}}, "runtime_env.uv"),
    ({"conda": "my-env"}, "runtime_env.conda"),
])
def test_a_key_both_set_is_refused_before_anything_starts(project: Path, given: dict, field: str) -> None:
    compute = RayCompute(address="127.0.0.1:1", runtime_env=given,
                         environment={"working_dir": str(project), "requirements": ["sgpu-tiny==1.0"]})
    with pytest.raises(SGPUConfigError) as err:
        distributed(gpus=1, compute=compute, mlflow=False)(_probe).dry_run()
    assert err.value.field == field
    assert "environment" in err.value.allowed, "says what it clashes with and what is allowed"


@pytest.mark.parametrize("url", ["https://user:s3cret@pypi.example.com/simple",
                                 "https://pypi.example.com/simple?token=s3cret",
                                 "https://__token__:${PYPI_TOKEN}@pypi.example.com/simple"])
def test_index_credentials_are_never_written_into_a_runtime_env(url: str) -> None:
    compute = RayCompute(address="127.0.0.1:1", environment={"requirements": ["einops==0.8.0"], "index_url": url})
    with pytest.raises(SGPUConfigError) as err:
        distributed(gpus=1, compute=compute, mlflow=False)(_probe).dry_run()
    assert err.value.field == "environment.index_url"
    assert "s3cret" not in str(err.value) and "PIP_INDEX_URL" in str(err.value)


def test_the_dry_run_shows_the_runtime_env_a_job_would_get(project: Path, wheels: Path) -> None:
    compute = RayCompute(address="127.0.0.1:1", runtime_env={"env_vars": {"A": "1"}},
                         environment={"working_dir": str(project), "requirements": ["sgpu-tiny==1.0"],
                                      "find_links": [str(wheels)]})
    shown = distributed(gpus=1, compute=compute, mlflow=False)(_probe).dry_run()["runtime_env"]
    assert shown["working_dir"] == str(project) and shown["env_vars"] == {"A": "1"}
    assert shown["pip"]["pip_install_options"][-2:] == ["--find-links", str(wheels)]


# -- a real cluster --------------------------------------------------------------------------------


def run_on_ray(kind: str, project: Path, wheels: Path, image: Path, *extra: str) -> list[dict]:
    """``support/ray_env_job.py`` with the image Python (a cluster's Python with Ray in its own
    site-packages: Ray's pip would copy this checkout's whole virtualenv for every environment)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([str(image_python(image)), str(TESTS / "support" / "ray_env_job.py"), str(project),
                           str(wheels), kind, *extra], env=env, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
@pytest.mark.own_modules
def test_a_working_dir_module_and_an_extra_requirement_reach_ray_train_and_warm_workers_and_own_modules_travel(
        project: Path, wheels: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    sibling = tmp_path_factory.mktemp("sibling-project")
    values = run_on_ray("compute", project, wheels, tmp_path_factory.getbasetemp() / "ray-image", str(sibling))
    # two ranks with no environment= whose function's module imports a package beside it on the driver only
    values, auto = values[:4], values[4:]
    assert [v["auto"] for v in auto] == [42, 42], auto
    assert all(not Path(v["lib"]).is_relative_to(sibling) for v in auto), "the package came through Ray"
    # two ranks of a Ray Train run, then two of a warm worker group (keep_warm)
    assert [v["tag"] for v in values] == ["from-the-project"] * 4, "the project's module on every worker"
    assert [v["value"] for v in values] == [42] * 4, "the wheel installed by Ray's pip on both nodes"
    assert all("/runtime_resources/pip/" in v["python"] for v in values), "in Ray's pip virtualenv"
