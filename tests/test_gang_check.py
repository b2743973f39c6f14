"""The gang check (prefect_sgpu.observe.gang_check) on real processes and a real workers' store.

Four rank processes on this host stand for 2 nodes x 2 ranks, with the environment torch elastic
gives ranks (``RANK``, ``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` of a store the test hosts,
``TORCHELASTIC_USE_AGENT_STORE``). The end-to-end runs, through the launcher, are in
``tests/compute/test_ec2_gang_check.py`` and ``tests/adapters/test_distributed_e2e.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from prefect_sgpu.observe import gang_check
from prefect_sgpu import spec as spec_mod
from prefect_sgpu.errors import GangCheckFailed

RANK = textwrap.dedent("""
    import json, os, sys
    from prefect_sgpu.observe import gang_check
    from prefect_sgpu.errors import GangCheckFailed
    out = {"rank": int(os.environ["RANK"])}
    try:
        out["report"] = gang_check.run_if_enabled()
    except GangCheckFailed as exc:
        out.update(failed={str(k): v for k, v in exc.failed.items()}, message=str(exc), nodes=exc.nodes)
    else:
        # the user's own process group, on the same store, after the check
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        value = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(value)
        out["user_sum"] = value.item()
        dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)
""")


def _gang(tmp_path: Path, world: int = 4, per_node: int = 2, node_env: dict[int, dict[str, str]] | None = None,
          absent: set[int] = frozenset(), timeout: float = 120.0, host: str = "127.0.0.1",
          wrap: dict[int, list[str]] | None = None, nbytes: int = 1 << 20) -> dict[int, dict]:
    from prefect_sgpu.launch.rendezvous import host_store

    store = host_store(host, 0, timeout_s=60)  # the workers' store, on one address only
    port = store.port
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    procs = {}
    for rank in range(world):
        if rank in absent:
            continue
        node = rank // per_node
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node),
               "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(node), "MASTER_ADDR": host,
               "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True", gang_check.ENV: "1",
               gang_check.TIMEOUT_ENV: str(timeout), gang_check.BYTES_ENV: str(nbytes), "SGPU_DEVICE": "cpu",
               "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "SGPU_RUN_ID": "sgpu-test-gang",
               "SGPU_INSTANCE_ID": f"i-node{node}", **(node_env or {}).get(node, {})}
        argv = [*(wrap or {}).get(node, []), sys.executable, str(script)]
        procs[rank] = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
    results = {}
    try:
        for rank, proc in procs.items():
            out, _ = proc.communicate(timeout=240)
            line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
            assert line is not None, f"rank {rank} printed no result:\n{out}"
            results[rank] = json.loads(line[len("RESULT "):])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        del store
    return results


def test_a_sound_gang_passes_reports_each_link_and_leaves_the_user_a_clean_start(tmp_path: Path) -> None:
    results = _gang(tmp_path)
    assert [results[r]["user_sum"] for r in range(4)] == [6.0] * 4  # the user's group after the check's
    report = results[0]["report"]
    assert all(results[r]["report"] is None for r in (1, 2, 3))  # only rank 0 carries it
    assert (report["ranks"], report["nodes"], report["backend"], report["bytes"]) == (4, 2, "gloo", 1 << 20)
    assert sorted((link["from node"], link["to node"]) for link in report["links"]) == [(0, 1), (1, 0)]
    assert {(link["from"], link["to"]) for link in report["links"]} == {("i-node0", "i-node1"), ("i-node1", "i-node0")}
    assert all(link["GB/s"] > 0 and link["ms"] > 0 for link in report["links"])
    assert report["where"]["3"]["instance"] == "i-node1" and report["where"]["0"]["node"] == 0
    info, warnings = gang_check.describe(report)
    assert "gang check passed: 4 rank(s) on 2 node(s)" in info and "node 0 -> 1" in info
    # no verdict on speed here: on a loaded machine a loopback link can measure 4x slower than the other
    assert all(w.startswith("gang check: slow link node ") for w in warnings), warnings


@pytest.mark.e2e  # four ranks in two nodes' processes; the sound gang is the quick tier's
def test_a_node_whose_network_device_fails_is_named_with_its_instance_not_after_a_timeout(tmp_path: Path) -> None:
    # node 1's ranks are told to use a network interface the machine does not have: gloo cannot
    # open its device there; node 0's ranks would wait for them until the collective timeout
    results = _gang(tmp_path, node_env={1: {"GLOO_SOCKET_IFNAME": "sgpu-missing0"}}, timeout=300.0)
    for rank in range(4):
        out = results[rank]
        assert "failed" in out, out
        assert out["nodes"] == [1], out  # every rank names node 1 alone
        assert "i-node1" in out["message"] and "sgpu-missing0" in out["message"]
        assert "did not finish within" not in out["message"]  # it did not wait out the 300 s
    failed = results[0]["failed"]
    culprits = {k for k, v in failed.items() if not v["collateral"]}
    assert culprits and culprits <= {"2", "3"}, failed  # node 1's ranks; node 0's stopped because of them
    assert all(failed[k]["instance"] == "i-node1" and failed[k]["node"] == 1 for k in culprits)
    assert "rank 0 (" not in results[0]["message"] and "stopped because of that" in results[0]["message"]


@pytest.mark.e2e  # four ranks in two nodes' processes; the sound gang is the quick tier's
def test_a_rank_that_never_arrives_is_named_with_its_node_from_its_peer(tmp_path: Path) -> None:
    # 10 s: on a loaded machine the present ranks finish importing torch seconds apart
    results = _gang(tmp_path, absent={3}, timeout=10.0)
    assert sorted(results) == [0, 1, 2]
    for out in results.values():
        assert out["nodes"] == [1], out
        culprits = {k for k, v in out["failed"].items() if not v["collateral"]}
        assert culprits == {"3"}, out["message"]
        assert "did not reach the gang check within 10 s" in out["failed"]["3"]["error"], out["message"]
    assert results[0]["failed"]["3"]["instance"] == "i-node1"  # from rank 2, its peer on node 1


def _can_shape_links() -> bool:
    return os.geteuid() == 0 and bool(shutil.which("ip")) and bool(shutil.which("tc"))


class NodeNamespace:
    """A network namespace of this test's own, joined to this one by a veth pair whose two ends
    pass at most ``rate`` (tc's token bucket): a node in it reaches every other node slowly."""

    def __init__(self, rate: str) -> None:
        tag = f"{os.getpid() % 100000}{uuid.uuid4().hex[:3]}"
        self.ns, self.outer, self.inner = f"sgpu-gc-{tag}", f"sgo{tag}", f"sgi{tag}"
        # a /30 of its own among 16384 (two suites side by side each pick theirs)
        block = int(uuid.uuid4().hex[:4], 16) % 16384
        third, fourth = block // 64, block % 64 * 4
        self.outer_ip, self.inner_ip = f"10.231.{third}.{fourth + 1}", f"10.231.{third}.{fourth + 2}"
        self.rate = rate

    def __enter__(self) -> "NodeNamespace":
        ns = ["ip", "netns", "exec", self.ns]
        steps = [["ip", "netns", "add", self.ns],
                 ["ip", "link", "add", self.outer, "type", "veth", "peer", "name", self.inner],
                 ["ip", "link", "set", self.inner, "netns", self.ns],
                 ["ip", "addr", "add", f"{self.outer_ip}/30", "dev", self.outer],
                 ["ip", "link", "set", self.outer, "up"],
                 [*ns, "ip", "addr", "add", f"{self.inner_ip}/30", "dev", self.inner],
                 [*ns, "ip", "link", "set", self.inner, "up"], [*ns, "ip", "link", "set", "lo", "up"],
                 ["tc", "qdisc", "add", "dev", self.outer, "root", "tbf", "rate", self.rate, "burst", "32kbit",
                  "latency", "400ms"],
                 [*ns, "tc", "qdisc", "add", "dev", self.inner, "root", "tbf", "rate", self.rate, "burst", "32kbit",
                  "latency", "400ms"]]
        try:
            for step in steps:
                subprocess.run(step, check=True, capture_output=True, timeout=30)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        subprocess.run(["ip", "link", "del", self.outer], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)


@pytest.mark.e2e  # four ranks in two nodes' network namespaces
@pytest.mark.skipif(not _can_shape_links(), reason="needs root, ip and tc to give a node a slow link of its own")
def test_a_node_behind_a_slow_link_is_named_by_the_bandwidth_table(tmp_path: Path) -> None:
    # three nodes of one rank: nodes 0 and 2 here, node 1 in its own namespace behind a 10 Mbit/s link
    # (0.00125 GB/s)
    with NodeNamespace(rate="10mbit") as slow_node:
        results = _gang(tmp_path, world=3, per_node=1, host=slow_node.outer_ip, nbytes=1 << 19, node_env={
            0: {"GLOO_SOCKET_IFNAME": slow_node.outer}, 2: {"GLOO_SOCKET_IFNAME": slow_node.outer},
            1: {"GLOO_SOCKET_IFNAME": slow_node.inner}}, wrap={1: ["ip", "netns", "exec", slow_node.ns]})
    report = results[0]["report"]
    assert [results[r]["user_sum"] for r in range(3)] == [3.0] * 3
    speed = {(link["from node"], link["to node"]): link["GB/s"] for link in report["links"]}
    assert set(speed) == {(0, 1), (1, 2), (2, 0)}
    assert max(speed[0, 1], speed[1, 2]) < 0.0015 and speed[2, 0] > 4 * max(speed[0, 1], speed[1, 2]), speed
    assert report["slow_nodes"] == [1], report
    assert len(report["slow_links"]) == 2 and all("node 1" in text for text in report["slow_links"])
    _, warnings = gang_check.describe(report)
    assert "gang check: node 1 is on every slow link" in warnings


@pytest.mark.e2e  # four ranks in two nodes' network namespaces
@pytest.mark.skipif(not _can_shape_links(), reason="needs root and ip to give a node a network namespace of its own")
def test_a_node_that_cannot_reach_its_peers_is_named_at_once(tmp_path: Path) -> None:
    # node 1 reaches the store (on the veth) but not its peers' data address (127.0.0.1 here is not
    # theirs inside its namespace); they reach its own
    with NodeNamespace(rate="1gbit") as ns:
        results = _gang(tmp_path, world=3, per_node=1, host=ns.outer_ip, timeout=300.0, node_env={
            0: {"GLOO_SOCKET_IFNAME": "lo"}, 2: {"GLOO_SOCKET_IFNAME": "lo"}, 1: {"GLOO_SOCKET_IFNAME": ns.inner}},
            wrap={1: ["ip", "netns", "exec", ns.ns]})
    for out in results.values():
        assert out.get("nodes") == [1], out
        assert "node 1 -> node 0" in out["message"] and "node 1 -> node 2" in out["message"], out["message"]
        assert "did not finish within" not in out["message"]  # named by the probe, not at the 300 s timeout
    assert results[0]["failed"]["1"]["instance"] == "i-node1"


def test_slow_links_and_the_node_on_all_of_them_are_named() -> None:
    def link(a: int, b: int, gbps: float) -> dict:
        return {"from node": a, "to node": b, "GB/s": gbps}

    even = [link(0, 1, 2.0), link(1, 2, 2.2), link(2, 0, 1.9)]
    assert gang_check.slow(even) == ([], [])
    named, nodes = gang_check.slow([link(0, 1, 0.1), link(1, 2, 0.2), link(2, 3, 2.0), link(3, 0, 2.1)])
    assert nodes == [1] and len(named) == 2 and "node 0 -> node 1: 0.1 GB/s" in named[0]
    named, nodes = gang_check.slow([link(0, 1, 0.1), link(1, 0, 2.0)])  # two nodes: the link, not a node
    assert nodes == [] and len(named) == 1
    report = {"ranks": 4, "nodes": 2, "seconds": 0.5, "backend": "gloo", "links": [], "slow_links": named,
              "slow_nodes": [], "warnings": ["rank 2: GPU 0 is throttled: thermal slowdown"]}
    _, warnings = gang_check.describe(report)
    assert warnings == [f"gang check: slow link {named[0]}", "gang check: rank 2: GPU 0 is throttled: thermal slowdown"]


def test_the_error_survives_pickling_and_names_the_culprits_first() -> None:
    failed = {0: {"node": 0, "host": "a", "instance": "i-a", "error": "stopped", "collateral": True},
              2: {"node": 1, "host": "b", "instance": "i-b", "error": "process group: boom", "collateral": False}}
    exc = pickle.loads(pickle.dumps(GangCheckFailed("run-1", failed, "4 ranks on 2 node(s)")))
    assert exc.nodes == [1] and exc.failed[2]["instance"] == "i-b"
    assert "rank 2 (node 1, instance i-b, host b): process group: boom" in str(exc)


@pytest.mark.parametrize("given, expected", [({}, True), ({"gang_check": False}, False)])
def test_the_flag_reaches_every_rank_and_can_be_turned_off(given: dict, expected: bool) -> None:
    spec = spec_mod.build(spec_mod.layer("call", **given), environ={})
    assert spec.gang_check is expected
    assert (spec.rank_env().get(gang_check.ENV) == "1") is expected
    assert spec_mod.build(environ={"PREFECT_SGPU_GANG_CHECK": "false"}).gang_check is False


def test_a_pool_job_variable_turns_it_off() -> None:
    from prefect_sgpu.adapters import pool_variables as pv

    defaults = pv.gpu_defaults({"gang_check": False})
    assert defaults == {"gang_check": False}
    env = pv.gpu_defaults_env(defaults)
    assert spec_mod.build(environ=env).gang_check is False
    with pytest.raises(Exception, match="gang_check"):
        pv.gpu_defaults({"gang_check": "sometimes"})
