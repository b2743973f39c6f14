"""What an EC2 node reads from IMDSv2 about its own future: a spot ``instance-action`` is a reclaim
notice; a rebalance recommendation is a warning that may never be followed by one (AWS docs, "EC2
instance rebalance recommendations"). The node host against the simulator's FakeIMDS, and the node's
watch (:class:`prefect_sgpu.launch.node_liveness.NodeLiveness`) over a local job folder."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from support.ec2_simulator import FakeIMDS
from prefect_sgpu.launch.ec2_host import IMDS_ENV, EC2NodeHost
from prefect_sgpu.launch.node_liveness import NodeLiveness
from prefect_sgpu.protocol.jobfolder import JobFolder, new_key
from prefect_sgpu.runtime import PREEMPT_FILE, REBALANCE_FILE
from prefect_sgpu.store import LocalStore

REBALANCE = json.dumps({"noticeTime": "2026-11-29T08:00:00Z"})
INSTANCE_ACTION = json.dumps({"action": "terminate", "time": "2026-11-29T08:02:00Z"})


@pytest.fixture
def imds(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeIMDS]:
    served = FakeIMDS({"instance-id": "i-0123456789abcdef0", "ami-launch-index": "0", "local-ipv4": "10.0.0.1"})
    monkeypatch.setenv(IMDS_ENV, served.url)
    try:
        yield served
    finally:
        served.close()


def test_a_rebalance_recommendation_is_not_a_reclaim_notice_and_a_later_instance_action_is(imds: FakeIMDS) -> None:
    host = EC2NodeHost(notice_every_s=0.0)
    assert (host.reclaim_notice(), host.rebalance_notice()) == (None, None)

    imds.metadata["events/recommendations/rebalance"] = REBALANCE
    assert host.reclaim_notice() is None
    assert host.rebalance_notice() == f"rebalance recommendation: {REBALANCE}"

    imds.metadata["spot/instance-action"] = INSTANCE_ACTION
    assert host.reclaim_notice() == f"spot interruption: {INSTANCE_ACTION}"
    assert host.rebalance_notice() == f"rebalance recommendation: {REBALANCE}"


class _Node(NodeLiveness):
    """The watch of one node, with what the bootstrap gives it: host, job folder, identity."""

    def __init__(self, host: Any, store: LocalStore, job_dir: Path) -> None:
        self.host, self.store, self.job_dir, self.index, self.run_id = host, store, job_dir, 0, "r-notices"
        self.folder = JobFolder(store, self.run_id, new_key())
        self.identity = SimpleNamespace(instance_id="i-0123456789abcdef0")
        self.notice = self.rebalance = None
        self._notice_published = self._rebalance_published = False
        self._alive_lock = threading.Lock()
        self.errors: list[str] = []

    def _store_error(self, what: str, exc: BaseException) -> None:
        self.errors.append(f"{what}: {exc}")


def test_the_node_tells_a_rebalance_as_a_warning_and_a_later_reclaim_as_a_reclaim(
        imds: FakeIMDS, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    node = _Node(EC2NodeHost(notice_every_s=0.0), LocalStore(tmp_path / "store"), job_dir)

    imds.metadata["events/recommendations/rebalance"] = REBALANCE
    node.watch_notices()
    assert not (job_dir / PREEMPT_FILE).exists(), "a rebalance recommendation told the ranks to preempt"
    assert (job_dir / REBALANCE_FILE).read_text() == f"rebalance recommendation: {REBALANCE}"
    assert node.notice is None
    first = node.folder.notice(0, instance_id="i-0123456789abcdef0")
    assert first is not None and first.reclaim is False and REBALANCE in first.text
    version = node.folder.node_documents()["nodes/node-0.notice"]

    node.watch_notices()  # the same recommendation again: nothing new is written
    assert node.folder.node_documents()["nodes/node-0.notice"] == version

    imds.metadata["spot/instance-action"] = INSTANCE_ACTION
    node.watch_notices()
    assert (job_dir / PREEMPT_FILE).read_text() == f"spot interruption: {INSTANCE_ACTION}"
    second = node.folder.notice(0, instance_id="i-0123456789abcdef0")
    assert second is not None and second.reclaim is True and INSTANCE_ACTION in second.text
    assert node.folder.node_documents()["nodes/node-0.notice"] != version
    assert node.errors == []
