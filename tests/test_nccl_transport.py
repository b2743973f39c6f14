"""The EFA part of the gang check, on CPU: NCCL's log text as NCCL and aws-ofi-nccl write it, stubbed
collective timings, and the decision each leads to."""

from __future__ import annotations

import os

import pytest

from prefect_sgpu.observe import gang_check, nccl_transport as nt

# what NCCL 2.21 with aws-ofi-nccl 1.9 writes on a p4d (host and pid columns as NCCL prints them)
EFA_LOG = """\
ip-10-0-1-5:1234:1301 [0] NCCL INFO NET/Plugin: Plugin name set by env to /opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so
ip-10-0-1-5:1234:1301 [0] NCCL INFO NET/Plugin: Loaded net plugin AWS Libfabric (v8)
ip-10-0-1-5:1234:1301 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.9.1-aws
ip-10-0-1-5:1234:1301 [0] NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)
ip-10-0-1-5:1234:1301 [0] NCCL INFO Using network AWS Libfabric
ip-10-0-1-5:1234:1340 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/AWS Libfabric/0/GDRDMA
"""
# what the same job writes when the plugin is not found: NCCL's own sockets
SOCKET_LOG = """\
ip-10-0-1-5:1234:1301 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so. Using internal network plugin.
ip-10-0-1-5:1234:1301 [0] NCCL INFO NET/Socket : Using [0]ens32:10.0.1.5<0>
ip-10-0-1-5:1234:1301 [0] NCCL INFO Using network Socket
ip-10-0-1-5:1234:1340 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/Socket/0
"""
# newer aws-ofi-nccl (1.16) names its network Libfabric and its provider in lower case
NEW_EFA_LOG = """\
host:78:108 [0] NCCL INFO NET/Plugin: Loaded net plugin Libfabric (v10)
host:78:108 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa-direct (found 4 nics)
host:78:187 [0] NCCL INFO Channel 00/1 : 0[0] -> 4[0] [send] via NET/Libfabric/0/GDRDMA
"""


def test_the_transport_is_read_from_ncclss_info_lines() -> None:
    assert nt.transport_from_log(EFA_LOG.splitlines())[0] == "efa"
    assert nt.transport_from_log(NEW_EFA_LOG.splitlines())[0] == "efa"
    transport, evidence = nt.transport_from_log(SOCKET_LOG.splitlines())
    assert transport == "socket" and "Using network Socket" in evidence[0]
    assert nt.transport_from_log(["NCCL INFO Using network IB"])[0] == "ib"
    assert nt.transport_from_log(["nothing of NCCL's"]) == (None, [])


def test_one_socket_channel_makes_the_transport_socket() -> None:
    mixed = EFA_LOG + "h:1:2 [3] NCCL INFO Channel 01/0 : 11[3] -> 3[3] [receive] via NET/Socket/1\n"
    assert nt.transport_from_log(mixed.splitlines())[0] == "socket"


def test_bus_bandwidth_is_nccl_tests_formula() -> None:
    nbytes = 256 * 2**20
    # 16 ranks (2 x p4d) in 6.7 ms: algbw 40.06 GB/s, bus 2*15/16 of it
    assert nt.bus_bandwidth(nbytes, 0.0067, 16) == pytest.approx(nbytes / 0.0067 / 1e9 * 30 / 16)
    assert nt.bus_bandwidth(nbytes, 1.0, 1) == 0.0
    with pytest.raises(ValueError, match="seconds"):
        nt.bus_bandwidth(nbytes, 0.0, 16)


def test_socket_on_an_efa_type_is_refused_with_the_reason() -> None:
    transport, evidence = nt.transport_from_log(SOCKET_LOG.splitlines())
    problem = nt.verdict("p4d.24xlarge", transport, evidence, 7.9, 40.0, 256 * 2**20)
    assert problem is not None
    assert "NCCL uses TCP sockets, not EFA, on p4d.24xlarge" in problem and "Using network Socket" in problem
    assert "SGPU_EFA_REQUIRED=0" in problem


def test_a_bus_bandwidth_under_the_floor_is_refused_and_says_how_to_turn_it_off() -> None:
    problem = nt.verdict("p5.48xlarge", "efa", [], 120.0, 150.0, 256 * 2**20)
    assert problem is not None
    assert "256 MiB reached 120.0 GB/s bus bandwidth over efa on p5.48xlarge" in problem
    assert "floor of 150 GB/s" in problem and "SGPU_EFA_MIN_BUS_GBPS=0" in problem


@pytest.mark.parametrize(("transport", "bus", "floor"), [("efa", 76.0, 40.0), ("efa", 10.0, None), (None, 80.0, 40.0)])
def test_efa_at_speed_or_without_a_floor_passes(transport: str | None, bus: float, floor: float | None) -> None:
    assert nt.verdict("p4d.24xlarge", transport, [], bus, floor, 256 * 2**20) is None


def test_the_floor_comes_from_the_environment() -> None:
    assert nt.floor_from("40") == 40.0
    assert nt.floor_from("0") is None and nt.floor_from(None) is None and nt.floor_from(" ") is None
    with pytest.raises(ValueError, match=r"SGPU_EFA_MIN_BUS_GBPS='fast': a number of GB/s"):
        nt.floor_from("fast")
    with pytest.raises(ValueError, match=">= 0"):
        nt.floor_from("-1")


def test_cuda_findings_name_both_versions() -> None:
    faults, _ = nt.cuda_findings(False, "12.4", 11080)
    assert faults == ["CUDA is not available to torch: torch is built for CUDA 12.4, the driver supports CUDA 11.8; "
                      "CUDA 12 needs a driver for CUDA 12.x: upgrade the driver or install torch built for CUDA 11"]
    faults, _ = nt.cuda_findings(False, None, 12020)
    assert "CPU wheel" in faults[0] and "install a CUDA build of torch" in faults[0]
    faults, _ = nt.cuda_findings(False, "12.4", None)
    assert "no libcuda.so.1 loads" in faults[0] and "NVIDIA driver" in faults[0]
    faults, _ = nt.cuda_findings(False, "12.1", 12040)
    assert "no usable GPU is visible" in faults[0]
    faults, warnings = nt.cuda_findings(True, "12.4", 12020)
    assert faults == [] and "minor-version compatibility" in warnings[0] and "CUDA 12.2" in warnings[0]
    assert nt.cuda_findings(True, "12.1", 12040) == ([], [])


def test_the_driver_version_reads_none_without_a_driver() -> None:
    version = nt.driver_cuda_version()
    assert version is None or version >= 1000


def test_nccl_debug_goes_to_the_checks_own_file_unless_the_job_set_it(tmp_path) -> None:
    log = tmp_path / "nccl" / "gang-check-rank-0.log"
    assert nt.debug_env({}, log) == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": str(log)}
    assert nt.debug_env({"NCCL_DEBUG": "WARN"}, log) == {}
    before = os.environ.get("NCCL_DEBUG")
    previous = nt.set_env({"NCCL_DEBUG": "INFO"})
    assert os.environ["NCCL_DEBUG"] == "INFO"
    nt.restore_env(previous)
    assert os.environ.get("NCCL_DEBUG") == before


def test_the_report_line_names_the_network() -> None:
    report = {"ranks": 16, "nodes": 2, "seconds": 4.2, "backend": "nccl", "links": [],
              "network": {"transport": "efa", "bus GB/s": 71.3}}
    info, _ = gang_check.describe(report)
    assert info.endswith("network: efa, all-reduce 71.3 GB/s bus bandwidth")


def checker(world: int = 16) -> gang_check.GangCheck:
    """Rank 0 of two 8-GPU nodes, as far as the network's judgement needs one (no store, no torch)."""
    return gang_check.GangCheck(None, None, "r-efa", 0, world, 0, 8, 0, 1.0, 1, "cuda")


@pytest.fixture
def p4d_rank(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SGPU_JOB_DIR", str(tmp_path))
    for name, value in {"SGPU_EFA": "1", "SGPU_EFA_RDMA": "1", "SGPU_INSTANCE_TYPE": "p4d.24xlarge",
                        "SGPU_EFA_MIN_BUS_GBPS": "40"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SGPU_EFA_REQUIRED", raising=False)
    (tmp_path / "nccl").mkdir()
    return tmp_path / "nccl" / "gang-check-rank-0.log"


def test_the_gang_check_refuses_nccl_on_sockets(p4d_rank) -> None:
    p4d_rank.write_text(SOCKET_LOG)
    check = checker()
    assert check._efa_expected()
    with pytest.raises(Exception, match="NCCL uses TCP sockets, not EFA, on p4d.24xlarge"):
        check._judge_network(0.063, 256 * 2**20)  # 8 GB/s: what 2 x p4d reach over TCP


def test_the_gang_check_refuses_efa_under_the_floor_and_passes_it_at_speed(p4d_rank, monkeypatch) -> None:
    p4d_rank.write_text(EFA_LOG)
    with pytest.raises(Exception, match="under the floor of 40 GB/s"):
        checker()._judge_network(0.0252, 256 * 2**20)  # 20 GB/s bus bandwidth
    network = checker()._judge_network(0.0067, 256 * 2**20)
    assert network["transport"] == "efa" and network["bus GB/s"] == pytest.approx(75.1, abs=0.1)
    monkeypatch.setenv("SGPU_EFA_MIN_BUS_GBPS", "0")  # the floor turned off: a slow EFA passes
    assert checker()._judge_network(0.0252, 256 * 2**20)["floor GB/s"] is None


def test_the_efa_check_runs_only_where_it_means_something(p4d_rank, monkeypatch) -> None:
    assert not gang_check.GangCheck(None, None, "r", 0, 8, 0, 8, 0, 1.0, 1, "cuda")._efa_expected()  # one node
    assert not gang_check.GangCheck(None, None, "r", 0, 16, 0, 8, 0, 1.0, 1, "cpu")._efa_expected()
    monkeypatch.setenv("SGPU_EFA_REQUIRED", "0")
    assert not checker()._efa_expected()
    monkeypatch.delenv("SGPU_EFA")
    monkeypatch.delenv("SGPU_EFA_REQUIRED")
    assert not checker()._efa_expected()
