"""``@ray_launch`` with ``environment=``: the Ray job the function drives gets it as its ``runtime_env``."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefect_sgpu.ray import ray_launch
from prefect_sgpu.ray.runtime_env import JOB_CONFIG_ENV

TESTS = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.xdist_group("ray-launch")  # clusters on the local compute's node addresses


def _driver() -> None:
    return None


def test_the_runtime_env_goes_to_the_driver_node_only(tmp_path: Path) -> None:
    (tmp_path / "features.py").write_text("TAG = 1\n")
    fn = ray_launch(gpus=2, nodes=2, mlflow=False, environment={"working_dir": str(tmp_path),
                                                                "requirements": ["sgpu-tiny==1.0"]})(_driver)
    argv = [n["command"] for n in fn.dry_run()["nodes"]]
    assert "--runtime-env=" in argv[0] and str(tmp_path) in argv[0] and "sgpu-tiny==1.0" in argv[0]
    assert "--runtime-env=" not in argv[1]
    assert JOB_CONFIG_ENV  # ray.init() on node 0 reads it from there


def test_without_environment_nothing_is_added() -> None:
    nodes = ray_launch(gpus=1, mlflow=False)(_driver).dry_run()["nodes"]
    assert all("--runtime-env=" not in n["command"] for n in nodes)


@pytest.mark.e2e
def test_a_working_dir_module_and_an_extra_requirement_reach_the_ray_job_s_tasks(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    from compute.test_ray_runtime_env import run_on_ray  # noqa: PLC0415 - one helper for both paths
    from support.ray_image import tiny_wheel

    project = tmp_path / "proj"
    project.mkdir()
    (project / "features.py").write_text('TAG = "from-the-project"\n')
    tiny_wheel(tmp_path / "wheels", "sgpu_tiny", "1.0", "VALUE = 42\n")
    [value] = run_on_ray("launch", project, tmp_path / "wheels", tmp_path_factory.getbasetemp() / "ray-image")
    assert value["tag"] == "from-the-project" and value["value"] == 42
    assert "/runtime_resources/pip/" in value["python"], "the task ran in Ray's pip virtualenv"
