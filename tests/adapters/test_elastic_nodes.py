"""Elastic jobs, ``nodes=(min, max)``: the spec, the launch, the runtime, and a job a late node joins."""

from __future__ import annotations

import shlex

import pytest

from support.late_nodes import LateNodesCompute
from support.processes import job_processes
from prefect_sgpu import distributed, gpu_task, runtime, spec
from prefect_sgpu.compute.local import LocalProcessCompute
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.launch import node_agent
from prefect_sgpu.store import LocalStore


@pytest.mark.parametrize("nodes, shown", [
    ((0, 2), "(0, 2)"), ((3, 2), "min 3 is more than max 2"), ((1, 2, 3), "(1, 2, 3)"), ((1.5, 2), "(1.5, 2)"),
    (("a", 2), "('a', 2)"), ((True, 2), "(True, 2)"), (0, "nodes=0"), ([1], "[1]"),
])
def test_bad_nodes_are_refused_naming_the_value_and_what_is_allowed(nodes: object, shown: str) -> None:
    with pytest.raises(SGPUConfigError) as err:
        distributed(gpus=2, nodes=nodes)(lambda: None)
    assert err.value.field == "nodes" and shown in str(err.value)
    assert "(min, max): two whole numbers with 1 <= min <= max" in err.value.allowed


def test_elastic_nodes_in_the_spec_plan_and_every_api() -> None:
    job = spec.merge(spec.layer("call", gpus=4, nodes=(1, 2)))
    assert (job.nodes, job.min_nodes, job.max_nodes, job.elastic) == ((1, 2), 1, 2, True)
    plan = spec.plan_local(job, 0)
    assert (plan.min_nodes, plan.max_nodes, plan.procs_per_node, plan.world_size, plan.elastic) == (1, 2, 2, 4, True)
    # a fixed gang is unchanged: nodes=N, and (n, n) is n
    fixed = spec.plan_local(spec.merge(spec.layer("call", gpus=4, nodes=(2, 2))), 0)
    assert (fixed.nodes, fixed.min_nodes, fixed.elastic) == (2, 2, False)
    assert spec.merge(spec.layer("call", gpus=4, nodes=2)).nodes == 2
    assert spec.environment_layer({"PREFECT_SGPU_NODES": "1:2"}).nodes == (1, 2)
    with pytest.raises(SGPUConfigError, match="PREFECT_SGPU_NODES='2:1'"):
        spec.environment_layer({"PREFECT_SGPU_NODES": "2:1"})
    # gpus are the ranks at max nodes: each node runs the same number
    with pytest.raises(SGPUConfigError, match="gpus=3 .* a multiple of nodes=2 .*max=2 nodes"):
        distributed(gpus=3, nodes=(1, 2))(lambda: None)
    fn = distributed(gpus=2, nodes=(1, 2), mlflow=False)(lambda: None)
    assert fn.with_options(nodes=(2, 4), gpus=4).layer.nodes == (2, 4)
    task = gpu_task(gpus=2, nodes=(1, 2))(lambda: None)
    assert task.sgpu.nodes == (1, 2)
    remote = spec.plan_remote(spec.merge(spec.layer("call", gpus=8, nodes=(1, 2), gpu_type="A10")))
    assert (remote.nodes, remote.min_nodes, remote.procs_per_node, remote.elastic) == (2, 1, 4, True)


def test_the_launch_asks_torch_elastic_for_min_to_max_nodes(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PREFECT_SGPU_ELASTIC_WAIT_S", "7")
    fn = distributed(gpus=2, nodes=(1, 2), mlflow=False, compute=LocalProcessCompute(keep_warm=0),
                     store=LocalStore(tmp_path))(lambda: None)
    argv = shlex.split(fn.dry_run()["nodes"][1]["command"])
    assert {"--nnodes=2", "--min-nodes=1", "--elastic-wait=7"} <= set(argv)
    args = node_agent.parse_args(argv[argv.index("prefect_sgpu.launch.node_agent") + 1:])
    assert node_agent.elastic_options(args) == (1, {"last_call_timeout": 7, "keep_alive_interval": 5,
                                                    "keep_alive_max_attempt": 3})  # a lost node: dropped after 15 s
    fixed = node_agent.parse_args(["--run-id=r", "--job-dir=/x", "--node-index=0", "--nnodes=2",
                                   "--nproc-per-node=1", "--rdzv-endpoint=127.0.0.1:1"])
    assert node_agent.elastic_options(fixed) == (2, {})
    monkeypatch.setenv("PREFECT_SGPU_ELASTIC_WAIT_S", "soon")
    with pytest.raises(SGPUConfigError, match="PREFECT_SGPU_ELASTIC_WAIT_S='soon'"):
        fn.dry_run()


def test_runtime_tells_the_world_size_and_whether_it_changed(monkeypatch) -> None:
    for name in ("SGPU_MEMBERSHIP_ROUND", "SGPU_PREVIOUS_NODES", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert (runtime.membership_round(), runtime.previous_world_size(), runtime.world_size_changed()) == (
        None, None, False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("SGPU_MEMBERSHIP_ROUND", "0")
    monkeypatch.setenv("SGPU_PREVIOUS_NODES", "")
    assert (runtime.membership_round(), runtime.previous_world_size(), runtime.world_size_changed()) == (
        0, None, False)
    monkeypatch.setenv("SGPU_MEMBERSHIP_ROUND", "2")
    monkeypatch.setenv("SGPU_PREVIOUS_NODES", "1")
    assert (runtime.membership_round(), runtime.previous_world_size(), runtime.world_size_changed()) == (
        2, 2, True)
    monkeypatch.setenv("SGPU_PREVIOUS_NODES", "2")
    assert runtime.world_size_changed() is False


def _grow() -> dict:
    """Waits, in a world of one node, to be restarted when the second node joins; then all-reduces."""
    import time

    import torch
    import torch.distributed as dist

    if runtime.world_size() == 1:
        until = time.monotonic() + 120
        while time.monotonic() < until:  # the joining node restarts this rank in a larger world
            runtime.progress(0, force=True)
            time.sleep(0.2)
        return {"world": 1}
    runtime.init_process_group("gloo")
    t = torch.tensor([float(runtime.rank() + 1)])
    dist.all_reduce(t)
    return {"rank": runtime.rank(), "world": runtime.world_size(), "sum": t.item(),
            "changed": runtime.world_size_changed(), "previous": runtime.previous_world_size(),
            "round": runtime.membership_round(), "restarts": runtime.restart_count()}


@pytest.mark.e2e
def test_a_late_node_joins_an_elastic_job_at_the_next_round(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PREFECT_SGPU_ELASTIC_WAIT_S", "1")  # node 0 starts alone after 1 s, not torch's 30
    compute = LateNodesCompute(late={1}, keep_warm=0)
    fn = distributed(gpus=2, nodes=(1, 2), mlflow=False, compute=compute, store=LocalStore(tmp_path),
                     timeout=300)(_grow)
    result = fn.run()
    values = result.values
    assert [v["rank"] for v in values] == [0, 1]
    assert all(v["world"] == 2 and v["sum"] == 3.0 for v in values), values
    # the same answer on both nodes, the one that was there and the one that joined
    assert all(v["changed"] is True and v["previous"] == 1 for v in values), values
    assert values[0]["round"] == values[1]["round"] >= 1
    assert all(v["restarts"] == 0 for v in values), "a membership change is not a failure restart"
    assert compute.started_late[1] > 0
    assert job_processes(result.run_id) == []


def _quick() -> dict:
    return {"rank": runtime.rank(), "world": runtime.world_size()}


@pytest.mark.e2e
def test_an_elastic_job_that_ended_before_a_node_joined_does_not_wait_for_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PREFECT_SGPU_ELASTIC_WAIT_S", "1")
    # node 1's machine arrives once node 0's rank has already returned its value
    compute = LateNodesCompute(late={1}, keep_warm=0, ready=lambda a: a.folder.path("results").is_dir()
                               and any(a.folder.path("results").iterdir()))
    fn = distributed(gpus=2, nodes=(1, 2), mlflow=False, compute=compute, store=LocalStore(tmp_path),
                     timeout=300)(_quick)
    result = fn.run()
    assert result.values == [{"rank": 0, "world": 1}]
    assert [r.rank for r in result.ranks] == [0]
    assert job_processes(result.run_id) == []


def test_computes_that_are_not_elastic_yet_refuse_min_max_nodes_before_spending(tmp_path) -> None:
    from prefect_sgpu import ray_launch
    from prefect_sgpu.ray.compute import RayTrainCompute

    elastic = spec.merge(spec.layer("call", gpus=2, nodes=(1, 2)))
    with pytest.raises(SGPUConfigError, match="on RayCompute: elastic jobs"):
        RayTrainCompute(address="127.0.0.1:1").plan(elastic, "run-1")
    fn = ray_launch(gpus=2, nodes=(1, 2), mlflow=False, compute=LocalProcessCompute(keep_warm=0),
                    store=LocalStore(tmp_path))(lambda: None)
    with pytest.raises(SGPUConfigError, match="on @ray_launch: elastic jobs"):
        fn.job()


def _world() -> dict:
    return {"rank": runtime.rank(), "world": runtime.world_size(), "changed": runtime.world_size_changed(),
            "previous": runtime.previous_world_size(), "round": runtime.membership_round()}


@pytest.mark.e2e
def test_an_elastic_job_whose_nodes_all_come_at_once_runs_at_max_on_warm_nodes(tmp_path) -> None:
    compute = LocalProcessCompute(keep_warm=5)
    try:
        fn = distributed(gpus=4, nodes=(1, 2), mlflow=False, compute=compute, store=LocalStore(tmp_path),
                         timeout=300)(_world)
        values = fn.run().values
    finally:
        compute.close()
    assert [v["rank"] for v in values] == [0, 1, 2, 3]
    assert all(v["world"] == 4 and v["changed"] is False and v["previous"] is None for v in values), values
    assert len({v["round"] for v in values}) == 1
