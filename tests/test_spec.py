"""Bad input fails before launch, naming the field, the value and what is allowed."""

from __future__ import annotations

import pytest

from prefect_sgpu import SGPUConfigError, catalog, distributed, run_script
from prefect_sgpu import spec as spec_mod
from prefect_sgpu.spec import plan_local


def _noop() -> None:
    return None


@pytest.mark.parametrize(
    ("kwargs", "field", "needle"),
    [
        ({"gpus": 0}, "gpus", "greater than or equal to 1"),
        ({"gpus": -2}, "gpus", "greater than or equal to 1"),
        ({"gpu_type": "X100"}, "gpu_type", "H100"),
        ({"nodes": 0}, "nodes", "greater than or equal to 1"),
        ({"timeout": -5}, "timeout", "greater than 0"),
        ({"timeout": 0}, "timeout", "greater than 0"),
        ({"max_restarts": -1}, "max_restarts", "greater than or equal to 0"),
        ({"gpus": 12, "gpu_type": "H100", "remote": True}, "gpus", "multiple of 8"),
        ({"gpus": 8, "gpu_type": "H100", "nodes": 2, "remote": True}, "gpus", "GPUs per node"),
        ({"gpus": 2, "remote": True}, "gpu_type", "needs a gpu_type"),
    ],
)
def test_bad_input_is_rejected_at_decoration(kwargs: dict, field: str, needle: str) -> None:
    with pytest.raises(SGPUConfigError) as info:
        distributed(**kwargs)(_noop)
    err = info.value
    assert err.field == field
    assert repr(err.value) in str(err) or str(err.value) in str(err)
    assert needle in str(err)


def test_unknown_gpu_type_lists_the_known_ones() -> None:
    with pytest.raises(SGPUConfigError) as info:
        distributed(gpu_type="T4")(_noop)
    for name in catalog.known_gpu_types():
        assert name in str(info.value)


def test_gpus_must_split_evenly_over_nodes() -> None:
    with pytest.raises(SGPUConfigError, match=r"gpus=3 .*multiple of nodes=2"):
        spec_mod.layer("call", gpus=3, nodes=2)
    with pytest.raises(SGPUConfigError, match=r"gpus=3 .*multiple of nodes=2"):  # from two layers
        spec_mod.merge(spec_mod.layer("task", gpus=3), spec_mod.layer("runner", nodes=2))


def test_local_gpus_beyond_the_machine_are_rejected() -> None:
    with pytest.raises(SGPUConfigError, match="at most 2 on this machine"):
        plan_local(spec_mod.JobSpec(gpus=4), local_gpus=2)


@pytest.mark.parametrize(
    ("gpu_type", "gpus", "nodes", "expected"),
    [
        ("H100", 16, None, (2, "p5.48xlarge")),
        ("H100", 8, None, (1, "p5.48xlarge")),
        ("A10", 2, None, (2, "g5.xlarge")),
        ("A10G", 4, None, (1, "g5.12xlarge")),
        ("a10", 8, 2, (2, "g5.12xlarge")),
        ("L4", 24, None, (3, "g6.48xlarge")),
        ("H200", 16, None, (2, "p5en.48xlarge")),
    ],
)
def test_catalog_splits_gpus_into_whole_nodes(gpu_type: str, gpus: int, nodes: int | None,
                                              expected: tuple[int, str]) -> None:
    n, itype = catalog.plan_nodes(gpu_type, gpus, nodes)
    assert (n, itype.name) == expected
    assert n * itype.gpus == gpus


def test_remote_without_compute_says_how_to_configure_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFECT_SGPU_REMOTE_COMPUTE", raising=False)
    fn = distributed(gpus=8, gpu_type="H100", remote=True)(_noop)
    with pytest.raises(SGPUConfigError, match="PREFECT_SGPU_REMOTE_COMPUTE"):
        fn.distributed()


def test_run_script_needs_an_existing_python_file(tmp_path) -> None:
    with pytest.raises(SGPUConfigError, match="path=.*existing Python file"):
        run_script(tmp_path / "missing.py", gpus=2)


def test_timedelta_timeout_is_accepted() -> None:
    import datetime as dt

    fn = distributed(timeout=dt.timedelta(minutes=2))(_noop)
    assert fn.spec.timeout == 120.0


# --- one JobSpec, merged from layers ------------------------------------------------------


def test_layers_merge_call_over_task_over_runner_over_environment_over_defaults() -> None:
    call = spec_mod.layer("call", timeout=30)
    task = spec_mod.layer("task", gpus=2, timeout=60)
    runner = spec_mod.layer("runner", gpus=4, nodes=2, strategy="fsdp", timeout=90)
    environ = {"PREFECT_SGPU_GPU_TYPE": "A10", "PREFECT_SGPU_MAX_RESTARTS": "3", "PREFECT_SGPU_GPUS": "16"}
    spec = spec_mod.build(call, task, runner, environ=environ)
    assert (spec.timeout, spec.gpus, spec.nodes, spec.strategy) == (30, 2, 2, "fsdp")
    assert (spec.gpu_type, spec.max_restarts, spec.mlflow) == ("A10", 3, True)
    assert spec.rank_env() == {"SGPU_STRATEGY": "fsdp", "SGPU_GANG_CHECK": "1"}


def test_not_given_differs_from_given_the_default() -> None:
    runner = spec_mod.layer("runner", gpus=4, nodes=2, mlflow=False)
    bare = spec_mod.layer("task")
    assert spec_mod.build(bare, runner, environ={}).gpus == 4
    explicit = spec_mod.layer("task", gpus=1, nodes=None, mlflow=True)
    spec = spec_mod.build(explicit, runner, environ={})
    assert (spec.gpus, spec.nodes, spec.mlflow) == (1, None, True)


def test_environment_layer_is_validated_with_the_variable_named() -> None:
    with pytest.raises(SGPUConfigError, match="PREFECT_SGPU_GPUS"):
        spec_mod.build(environ={"PREFECT_SGPU_GPUS": "zero"})
    assert spec_mod.build(environ={"PREFECT_SGPU_ENV": '{"A": 1}'}).env == {"A": "1"}


def test_a_layer_checks_only_what_it_was_given() -> None:
    assert spec_mod.layer("runner", nodes=2).given() == {"nodes": 2}  # gpus comes from another layer
    with pytest.raises(SGPUConfigError) as info:
        spec_mod.layer("task", strategy="zero3")
    assert info.value.field == "strategy" and "fsdp" in str(info.value)
    with pytest.raises(SGPUConfigError, match="one of gpus"):
        spec_mod.layer("task", gpu=2)


def test_decorator_without_arguments_takes_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_SGPU_GPUS", "3")
    assert distributed(_noop).spec.gpus == 3
    assert distributed(gpus=1)(_noop).spec.gpus == 1, "given explicitly, the default value wins"


def test_none_turns_the_watchdog_and_straggler_naming_off_as_the_docs_say(monkeypatch: pytest.MonkeyPatch) -> None:
    def fn() -> None:
        return None

    spec = distributed(gpus=1, hang_timeout=None, straggler_factor=None)(fn).spec
    assert spec.hang_timeout is None and spec.straggler_factor is None
    monkeypatch.setenv("PREFECT_SGPU_HANG_TIMEOUT", "none")
    assert distributed(gpus=1)(fn).spec.hang_timeout is None
    with pytest.raises(SGPUConfigError, match="hang_timeout"):
        distributed(gpus=1, hang_timeout=0)(fn)
