"""``@ray_launch``: a real Ray cluster over simulated local nodes, the function as its driver."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.ray_cluster import job_leftovers
from prefect_sgpu import SGPUConfigError
from prefect_sgpu.ray import RayCompute, ray_launch

# @ray_launch clusters sit on the local compute's node addresses (127.0.0.1, 127.0.0.2): these
# modules share one xdist worker, so two such clusters never run at once (docs/testing.md)
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("ray-launch")]


class ShardMissing(Exception):
    """Defined in the caller's module, raised by the Ray driver on node 0."""


def _spread_over_nodes(tasks: int) -> dict:
    import ray

    ray.init()  # RAY_ADDRESS points at the job's head

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # each task pinned to one node of the cluster, round robin (SPREAD is best effort: on a busy
    # machine it ran every task on the first node, whose worker was up first)
    @ray.remote(num_cpus=1)
    def where() -> str:
        return ray.util.get_node_ip_address()

    alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    ips = sorted(set(ray.get([where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        alive[i % len(alive)], soft=False)).remote() for i in range(tasks)])))
    resources = ray.cluster_resources()
    print(f"driver sees {len(ray.nodes())} node(s): {ips}")
    return {"nodes": sum(1 for n in ray.nodes() if n["Alive"]), "ips": ips, "cpus": resources.get("CPU"),
            "gpus": resources.get("GPU", 0.0)}


def test_two_nodes_form_one_cluster_and_the_driver_value_comes_back(capfd: pytest.CaptureFixture[str]) -> None:
    fn = ray_launch(gpus=2, nodes=2, ray_metrics_to_mlflow=True)(_spread_over_nodes)
    result = fn.run(6)
    value = result.values[0]
    assert len(result.values) == 1, "the function runs once, as the driver"
    assert value["nodes"] == 2
    assert value["ips"] == ["127.0.0.2", "127.0.1.1"], "each simulated node on its own loopback address"
    assert value["cpus"] == 2.0 and value["gpus"] == 0.0, "logical resources match the plan: 2 nodes x 1 CPU"
    out = capfd.readouterr().out
    assert "[rank 0 node 0] driver sees 2 node(s)" in out
    assert "driver sees 2 node(s)" in (Path(result.logs_uri) / "rank-00000.log").read_text()
    assert job_leftovers(result.run_id) == [], "no raylet, GCS or worker of the job is left"

    from mlflow.tracking import MlflowClient

    run = MlflowClient(result.mlflow_tracking_uri).get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["system/ray/nodes_alive"] == 2.0
    assert run.data.metrics["system/ray/cpu_total"] == 2.0
    history = MlflowClient(result.mlflow_tracking_uri).get_metric_history(result.mlflow_run_id,
                                                                          "system/ray/cpu_total")
    assert len(history) >= 2, "sampled at start and at the end"


def test_driver_exception_is_reraised_with_the_remote_traceback() -> None:
    @ray_launch(gpus=1)
    def load_shards() -> None:
        import ray

        ray.init()
        print("looking for shard 7")
        raise ShardMissing("shard 7 is not in the bucket")

    job = load_shards.job()
    with pytest.raises(ShardMissing, match="shard 7 is not in the bucket") as info:
        job.run()
    failure = info.value.sgpu_failure
    assert (failure.rank, failure.node, failure.exit_code) == (0, 0, 1)
    assert 'raise ShardMissing("shard 7 is not in the bucket")' in failure.remote_traceback
    assert job.tracked is not None and job.tracked.status == "FAILED"
    assert job_leftovers(job.run_id) == []


def test_options_are_validated_like_distributed() -> None:
    with pytest.raises(SGPUConfigError, match="gpu_type"):
        ray_launch(gpus=2, gpu_type="TPU9")(lambda: None)
    with pytest.raises(SGPUConfigError, match="gpus"):
        ray_launch(gpus=3, nodes=2)(lambda: None).dry_run()
    with pytest.raises(SGPUConfigError, match="max_restarts"):
        ray_launch(gpus=2, max_restarts=1)(lambda: None)
    with pytest.raises(SGPUConfigError, match="gpu_type"):
        ray_launch(gpus=8, remote=True)(lambda: None)  # remote needs whole nodes of a known type
    with pytest.raises(SGPUConfigError, match="compute"):
        ray_launch(gpus=2, compute=RayCompute(address="ray://127.0.0.1:1"))(lambda: None).job()

    fn = ray_launch(gpus=4, nodes=2)(_spread_over_nodes)
    with pytest.raises(TypeError, match=r"\.distributed\(\.\.\.\)"):
        fn(3)
    assert fn.with_options(ray_metrics_to_mlflow=True).ray_metrics_to_mlflow is True

    plan = fn.dry_run(3)
    commands = [node["command"] for node in plan["nodes"]]
    assert all("-m prefect_sgpu.ray.node" in c and "--num-cpus=2" in c and "--num-gpus=0" in c for c in commands)
    assert "--node-index=0" in commands[0] and "--node-index=1" in commands[1]


def test_cancel_stops_every_ray_process_of_the_job_without_namespaces() -> None:
    import threading
    import time

    from prefect_sgpu.compute.local import LocalProcessCompute
    from prefect_sgpu.errors import JobCancelled

    @ray_launch(gpus=2, nodes=2, mlflow=False, compute=LocalProcessCompute(isolation="none"))
    def serve_forever() -> None:
        import time

        import ray

        ray.init()
        print("cluster ready", flush=True)
        time.sleep(600)

    cancel = threading.Event()
    job = serve_forever.job(cancel_event=cancel)
    outcome: list[BaseException] = []
    runner = threading.Thread(target=lambda: outcome.append(_raised(job.run)))
    runner.start()
    log = Path(job.store.uri(job.run_id, "logs")) / "rank-00000.log"
    # as long as a node may take to join (ray/node.py's --join-timeout, 600 s) and a minute more: beside a
    # second suite the two nodes' cluster once took over 300 s to be up
    deadline = time.monotonic() + 660
    while not (log.exists() and "cluster ready" in log.read_text()):
        assert time.monotonic() < deadline and runner.is_alive(), f"the driver never started: {outcome}"
        time.sleep(0.5)
    assert job_leftovers(job.run_id), "the job's Ray processes are running"
    cancel.set()
    runner.join(timeout=120)
    assert isinstance(outcome[0], JobCancelled)
    assert job_leftovers(job.run_id) == [], "raylets, GCS and workers were stopped by pid"


def _raised(fn) -> BaseException | None:  # type: ignore[no-untyped-def]
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


def test_a_head_whose_port_lies_in_rays_default_worker_range_starts() -> None:
    """Listener ports come from 10000 up; Ray's default worker ports (10002-19999) must not refuse them."""
    import io
    import shutil
    import tempfile

    from prefect_sgpu.compute.ports import free_port
    from prefect_sgpu.ray.node_process import RayNodeProcess, RayNodeSpec

    # reserved machine-wide, as every listener port is: a port merely bindable now was taken by the same
    # test of a second suite on this machine, whose head ``ray start --port`` then joined
    # ("Session name ... does not match persisted value")
    port = next(p for p in iter(lambda: free_port("127.0.0.13"), None) if 10002 <= p <= 19999)
    out = io.StringIO()
    temp = tempfile.mkdtemp(prefix="sgpu-rh-", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    head = RayNodeProcess(RayNodeSpec(node_ip="127.0.0.13", temp_dir=temp, num_cpus=1, gcs_port=port,
                                      object_store_memory=128 << 20), output=out)
    try:
        head.start()
        assert head.alive(), out.getvalue()
    finally:
        head.stop()
        shutil.rmtree(temp, ignore_errors=True)
    assert not head.alive()


def test_the_driver_starts_connected_and_its_own_ray_init_is_harmless() -> None:
    @ray_launch(gpus=1, mlflow=False)
    def as_in_a_notebook() -> dict:
        import ray

        before = ray.is_initialized()
        cpus = ray.cluster_resources().get("CPU")  # no ray.init(): connected already
        per_node = ray._private.state.available_resources_per_node()
        ray.init(address="auto", namespace="mine")  # what user code often does: answered, not refused
        return {"before": before, "cpus": cpus, "nodes": len(per_node), "after": ray.is_initialized()}

    result = as_in_a_notebook.run()
    assert result.values == [{"before": True, "cpus": 1.0, "nodes": 1, "after": True}]
    assert job_leftovers(result.run_id) == []
