"""``environment=`` on every layer that sets a job, in the spec's merge order, checked before anything
is spent; remote computes capture the driver's environment by default, local ones need nothing."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from prefect import flow

from prefect_sgpu import GPUTaskRunner, SGPUConfigError, distributed, gpu_task, runtime
from prefect_sgpu import spec as spec_mod
from prefect_sgpu.adapters import pool_variables as pv
from prefect_sgpu.blocks import EC2Compute, RayCompute
from prefect_sgpu.environment import ENVIRONMENT_ENV, Environment, EnvironmentOptions

SECRET = "hunter2-s3cret"


def _rank() -> int:
    return runtime.rank()


def _opt(tag: str) -> dict[str, list[str]]:
    """Options told apart by their requirement (parsing one reads nothing)."""
    return {"requirements": [f"{tag}==1.0"]}


def _tag(option: EnvironmentOptions | None) -> str | None:
    return None if option is None else option.requirements[0].split("==")[0]


def test_every_layer_sets_it_and_the_merge_order_holds() -> None:
    call = distributed(environment=_opt("call"))(_rank).layer
    task = gpu_task(environment=_opt("task"))(_rank).sgpu
    runner = GPUTaskRunner(environment=_opt("runner")).layer
    block = RayCompute(address="ray://head:10001", environment=_opt("block")).get_compute()
    environ = {ENVIRONMENT_ENV: json.dumps(_opt("variable"))}
    order = [("call", call), ("task", task), ("runner", runner)]
    for i, (name, _) in enumerate(order):
        layers = [layer for _, layer in order[i:]]
        assert _tag(spec_mod.build(*layers, spec_mod.compute_layer(block), environ=environ).environment) == name
    assert _tag(spec_mod.build(spec_mod.compute_layer(block), environ=environ).environment) == "block"
    assert _tag(spec_mod.build(spec_mod.layer("call"), environ=environ).environment) == "variable"
    assert spec_mod.build(environ={}).environment is None, "built-in: not given (the compute decides)"

    assert _tag(distributed(_rank).with_options(environment=_opt("with")).spec.environment) == "with"
    assert _tag(gpu_task(_rank).with_options(environment=_opt("with")).sgpu.environment) == "with"
    assert GPUTaskRunner(environment="image").duplicate().layer.environment == EnvironmentOptions(mode="image")
    ec2 = EC2Compute(store_uri="s3://bucket/jobs", environment="image").get_compute()
    assert ec2.sgpu_environment == EnvironmentOptions(mode="image")
    assert RayCompute(address="ray://head:10001").get_compute().__dict__.get("sgpu_environment") is None


def test_remote_computes_capture_the_driver_by_default_local_computes_need_nothing(tmp_path: Path) -> None:
    from prefect_sgpu.compute.local import LocalProcessCompute

    ray = RayCompute(address="ray://head:10001").get_compute()
    env = spec_mod.for_compute(ray, spec_mod.layer("call"), environ={}).environment
    assert isinstance(env, Environment) and env.mode == "driver"
    assert any(d.name == "prefect-sgpu" and d.source == "editable" for d in env.distributions)
    (tmp_path / "job.py").write_text("X = 1\n")
    image = spec_mod.for_compute(ray, spec_mod.layer("task", environment={"mode": "image", "working_dir": str(tmp_path)}),
                                 environ={}).environment
    assert isinstance(image, Environment) and image.mode == "image" and image.working_dir is not None
    captured = spec_mod.for_compute(ray, spec_mod.layer("call", environment=env), environ={}).environment
    assert captured is env, "a captured environment is used as given"

    local = LocalProcessCompute()
    assert spec_mod.for_compute(local, spec_mod.layer("call"), environ={}).environment is None
    given = spec_mod.for_compute(local, spec_mod.layer("call", environment="image"), environ={}).environment
    assert given == EnvironmentOptions(mode="image"), "checked, never captured: local nodes run in this environment"


def test_dry_run_shows_the_environment_without_secrets(tmp_path: Path) -> None:
    url = f"https://__token__:{SECRET}@pypi.example.com/simple"
    block = RayCompute(address="ray://head:10001")
    fn = distributed(gpus=2, compute=block, mlflow=False,
                     environment={"index_url": url, "requirements": ["einops==0.8.0"]})(_rank)
    assert SECRET not in repr(fn) and SECRET.encode() not in pickle.dumps(fn.layer)
    with pytest.raises(SGPUConfigError) as refused:  # Ray shows a runtime_env to anyone who asks
        fn.dry_run()
    assert SECRET not in str(refused.value) and "https://***@pypi.example.com/simple" in str(refused.value)
    clean = distributed(gpus=2, compute=block, mlflow=False,
                        environment={"index_url": "https://pypi.example.com/simple",
                                     "requirements": ["einops==0.8.0"]})(_rank)
    shown = clean.dry_run()
    env = shown["environment"]
    assert env["mode"] == "driver" and len(env["digest"]) == 64 and env["python"].startswith("cpython 3.")
    assert env["distributions"] > 50 and env["requirements"] == ["einops==0.8.0"]
    assert env["index_url"] == "https://pypi.example.com/simple"
    assert {p["name"] for p in env["local_packages"]} >= {"prefect-sgpu"}
    runner = GPUTaskRunner(environment={"index_url": url})
    assert SECRET.encode() not in pickle.dumps(runner)
    assert distributed(gpus=2, mlflow=False)(_rank).dry_run()["environment"]["mode"] == "local"


def test_bad_environment_fails_before_anything_is_spent(tmp_path: Path) -> None:
    with pytest.raises(SGPUConfigError, match="'driver', 'image'"):
        distributed(environment="bogus")(_rank)
    with pytest.raises(SGPUConfigError) as info:
        gpu_task(environment={"working_dir": str(tmp_path / "nope")})(_rank)
    assert info.value.field == "environment.working_dir"
    with pytest.raises(SGPUConfigError, match="environment.requirements"):
        GPUTaskRunner(environment={"mode": "image", "requirements": ["einops"]})
    with pytest.raises(SGPUConfigError) as info:
        spec_mod.environment_layer({ENVIRONMENT_ENV: "nonsense"})
    assert info.value.field == ENVIRONMENT_ENV
    with pytest.raises(SGPUConfigError, match=f"set by {ENVIRONMENT_ENV}"):
        spec_mod.environment_layer({ENVIRONMENT_ENV: json.dumps({"working_dir": str(tmp_path / "nope")})})
    with pytest.raises(Exception, match="'driver', 'image'"):
        EC2Compute(environment="bogus")

    (tmp_path / "big.bin").write_bytes(b"\0" * 4096)
    fn = distributed(gpus=2, compute=RayCompute(address="ray://head:10001"), mlflow=False,
                     environment={"working_dir": str(tmp_path), "max_bytes": 1024})(_rank)
    with pytest.raises(SGPUConfigError) as info:
        fn.job()
    assert info.value.field == "environment.working_dir" and "environment.max_bytes=1024" in str(info.value)


def test_the_pool_job_variable_reaches_the_flow_run_as_the_environment_variable(tmp_path: Path) -> None:
    from prefect_sgpu.adapters.worker import SGPUWorker

    variables = SGPUWorker.get_default_base_job_template()["variables"]["properties"]
    assert "environment" in variables
    given = {"working_dir": str(tmp_path), "index_url": "https://u:${TOKEN}@mirror.example/simple",
             "requirements": ["einops==0.8.0"]}
    defaults = pv.gpu_defaults({"environment": given, "gpus": 2})
    env = pv.gpu_defaults_env(defaults)
    assert env["PREFECT_SGPU_GPUS"] == "2"
    assert spec_mod.environment_layer(env).environment == defaults["environment"] == EnvironmentOptions(**given)
    assert pv.gpu_defaults_env(pv.gpu_defaults({"environment": "image"}))[ENVIRONMENT_ENV] == "image"
    with pytest.raises(SGPUConfigError) as info:
        pv.gpu_defaults({"environment": {"working_dir": str(tmp_path / "nope")}})
    assert info.value.field == "job variable environment.working_dir"


@pytest.mark.e2e
def test_a_gpu_task_with_an_environment_runs_on_local_nodes(prefect_server: None) -> None:
    @gpu_task(gpus=2, mlflow=False, return_all=True, environment="image")
    def ranks() -> int:
        return runtime.rank()

    @flow(task_runner=GPUTaskRunner(environment={"requirements": ["einops==0.8.0"]}))
    def pipeline() -> list[int]:
        return ranks()

    assert pipeline() == [0, 1]
