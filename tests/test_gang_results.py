"""Results are bound to the gang that wrote them: after a relaunch, a lost gang's sealed result that a
store writer kept and writes back is not the new gang's result. The driver against the fake compute
(real job folder on a local store, real sealing), and the rank's own side through ``rank_main``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prefect_sgpu import jobfolder, payload, spec as spec_mod
from prefect_sgpu.driver import Job
from prefect_sgpu.errors import DocumentRefused, RankFailedError
from prefect_sgpu.store import LocalStore
from support.fake_compute import FakeCompute

REPO = Path(__file__).resolve().parents[1]


def _identity(x: int) -> int:
    return x


class _ReplayingCompute(FakeCompute):
    """Node 1 is lost in the first gang; a store writer keeps rank 0's sealed result of that gang and,
    in the next gang, writes it in rank 0's place instead of the new one."""

    def __init__(self) -> None:
        super().__init__(nodes=2, lose_node=1, lose_times=1)
        self.kept: bytes | None = None

    def _node(self, allocation: Any, node: int) -> None:
        folder = allocation.folder
        if node == 0 and self.kept is not None:
            own_put = folder.put_result

            def put_result(rank: int, body: bytes) -> None:
                if rank == 0:
                    folder.store.put(folder.run_id, jobfolder.result_key(0), self.kept)
                else:
                    own_put(rank, body)

            folder.put_result = put_result
        super()._node(allocation, node)
        if node == 0 and self.kept is None:
            self.kept = folder.store.get(folder.run_id, jobfolder.result_key(0))


def test_a_lost_gangs_result_written_back_after_the_relaunch_is_refused(tmp_path: Path) -> None:
    compute = _ReplayingCompute()
    spec = spec_mod.merge(spec_mod.layer("call", mlflow=False, gpus=2))
    job = Job(payload.FunctionCall(_identity, (7,)), spec, compute, LocalStore(tmp_path), cancel_event=None)
    with pytest.raises(RankFailedError, match=r"rank\(s\) \[0\] exited without a result"):
        job.run()
    assert compute.kept is not None and compute.acquired == 2, "the first gang's result was written back"


def test_a_relaunched_gangs_documents_are_bound_to_it(tmp_path: Path) -> None:
    """Each gang reads only its own results; the rank learns its gang from its environment."""
    store = LocalStore(tmp_path)
    folder = jobfolder.JobFolder(store, "run-g", jobfolder.new_key())
    folder.put_result(0, b"first gang")
    assert folder.results() == {0: b"first gang"}
    kept = store.get("run-g", jobfolder.result_key(0))
    folder.reset_for_relaunch(1)
    assert folder.gang == 1 and folder.results() == {}
    store.put("run-g", jobfolder.result_key(0), kept)
    assert folder.results() == {}, "the first gang's result counts in the second"
    with pytest.raises(DocumentRefused, match="gang=1"):
        jobfolder.unseal(kept, folder.key, "result", "run-g", rank=0, gang=1)

    # the rank's side: rank_main seals its result for the gang named in its environment
    job_dir = tmp_path / "node" / "run-g"
    job_dir.mkdir(parents=True)
    node = jobfolder.JobFolder.local(job_dir, folder.key)
    node.put_payload(payload.build(payload.FunctionCall(_identity, (3,))))
    env = {**os.environ, "SGPU_PAYLOAD_KEY": folder.key, "SGPU_JOB_DIR": str(job_dir), "RANK": "0",
           jobfolder.GANG_ENV: "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    done = subprocess.run([sys.executable, "-m", "prefect_sgpu.launch.rank_main"], env=env, timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, (done.stdout, done.stderr)
    node.gang = 1
    (body,) = node.results().values()
    assert payload.load_envelope(body).value() == 3
