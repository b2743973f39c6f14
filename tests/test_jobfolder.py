"""The job-folder protocol: every document is sealed and bound to its job, kind, node and rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefect_sgpu.protocol import jobfolder
from prefect_sgpu.protocol import payload
from prefect_sgpu.errors import DocumentRefused, PayloadError
from prefect_sgpu.protocol.jobfolder import Alive, JobFolder, LaunchDocument, NodeStatus
from prefect_sgpu.store import LocalStore


@pytest.fixture
def folder(tmp_path: Path) -> JobFolder:
    return JobFolder(LocalStore(tmp_path), "job-1", jobfolder.new_key())


def test_documents_round_trip_and_stay_typed(folder: JobFolder) -> None:
    folder.put_launches({1: (LaunchDocument(argv=["python", "-m", "x"], env={"A": "1"}), "i-1"),
                         0: (LaunchDocument(argv=["python", "-m", "y"]), "i-0")})
    assert folder.launch(1, instance_id="i-1") == LaunchDocument(argv=["python", "-m", "x"], env={"A": "1"})
    assert folder.launch(0, instance_id="i-0") == LaunchDocument(argv=["python", "-m", "y"])
    assert folder.launch(2, instance_id="i-2") is None, "no entry for a node: nothing to run yet"
    folder.put_status(0, NodeStatus(node=0, exit_code=0))
    assert folder.status(0) == NodeStatus(node=0, exit_code=0)
    first, second = folder.beat(), folder.beat()
    assert second.seq == first.seq + 1 and folder.heartbeat() == second


def _put_bundle(folder: JobFolder, entries: dict[int, bytes]) -> None:
    folder.store.put(folder.run_id, jobfolder.LAUNCH_KEY, jobfolder.launch_bundle(entries))


def test_an_unsigned_launch_document_is_refused(folder: JobFolder) -> None:
    _put_bundle(folder, {0: b'{"argv": ["sh", "-c", "touch /tmp/x"]}'})
    with pytest.raises(DocumentRefused, match="not a signed"):
        folder.launch(0)
    folder.store.put(folder.run_id, jobfolder.LAUNCH_KEY, b'{"0": {"argv": ["sh"]}}')
    with pytest.raises(DocumentRefused, match="not a launch bundle"):
        folder.launch(0)
    whole = jobfolder.launch_bundle({0: folder.seal_launch(0, LaunchDocument(argv=["sh"]))})
    folder.store.put(folder.run_id, jobfolder.LAUNCH_KEY, whole[:-5])
    with pytest.raises(DocumentRefused, match="cut short"):
        folder.launch(0)


def test_a_document_sealed_with_another_key_is_refused(folder: JobFolder) -> None:
    other = JobFolder(folder.store, folder.run_id, jobfolder.new_key())
    other.put_launches({0: (LaunchDocument(argv=["sh"]), None)})
    with pytest.raises(DocumentRefused, match="signature does not match"):
        folder.launch(0)


def test_a_document_moved_to_another_node_or_instance_is_refused(folder: JobFolder) -> None:
    blob = folder.seal_launch(1, LaunchDocument(argv=["agent"]), instance_id="i-1")
    _put_bundle(folder, {0: blob, 1: blob})
    with pytest.raises(DocumentRefused, match="node=1"):
        folder.launch(0, instance_id="i-1")
    with pytest.raises(DocumentRefused, match="instance_id=i-1"):
        folder.launch(1, instance_id="i-2")
    assert folder.launch(1, instance_id="i-1") == LaunchDocument(argv=["agent"])


def test_an_assignment_is_bound_to_its_lease_node_and_instance_and_is_no_launch(folder: JobFolder) -> None:
    from pydantic import ValidationError

    from prefect_sgpu.protocol.jobfolder import Assign

    folder.put_assignments({0: (Assign(run_id="job-2", seq=3), "i-0"), 1: (Assign(run_id="job-2", seq=3), "i-1")})
    assert folder.assignment(1, instance_id="i-1") == Assign(run_id="job-2", seq=3)
    with pytest.raises(DocumentRefused, match="instance_id=i-1"):
        folder.assignment(1, instance_id="i-0")
    bundle = folder.store.get(folder.run_id, jobfolder.ASSIGN_KEY)
    assert bundle is not None
    folder.store.put(folder.run_id, jobfolder.LAUNCH_KEY, bundle)  # an assignment is not a launch document
    with pytest.raises(DocumentRefused, match="kind=assign"):
        folder.launch(0, instance_id="i-0")
    other_lease = JobFolder(folder.store, "lease-2", folder.key)
    other_lease.store.put("lease-2", jobfolder.ASSIGN_KEY, bundle)  # copied to another lease's folder
    with pytest.raises(DocumentRefused, match="run_id=job-1"):
        other_lease.assignment(0, instance_id="i-0")
    with pytest.raises(ValidationError):  # a run id names folders and SSM parameters: no paths
        Assign(run_id="../etc", seq=1)


def test_a_status_cannot_stand_in_for_another_kind_or_job(folder: JobFolder, tmp_path: Path) -> None:
    folder.put_alive(0, Alive(phase="up", seq=1, time=0.0))
    blob = folder.store.get(folder.run_id, jobfolder.alive_key(0))
    assert blob is not None
    folder.store.put(folder.run_id, jobfolder.status_key(0), blob)
    assert folder.status(0) is None, "a refused document counts as absent for pollers"
    other_job = JobFolder(folder.store, "job-2", folder.key)
    other_job.put_status(0, NodeStatus(node=0, exit_code=1))
    folder.store.put(folder.run_id, jobfolder.status_key(0), folder.store.get("job-2", jobfolder.status_key(0)) or b"")
    assert folder.status(0) is None


def test_results_are_bound_to_their_rank(folder: JobFolder) -> None:
    env = payload.success_envelope({"rank": 0, "node": 0, "local_rank": 0, "host": "h"}, 42)
    folder.put_result(0, payload.dump_envelope(env))
    blob = folder.store.get(folder.run_id, jobfolder.result_key(0))
    assert blob is not None
    folder.store.put(folder.run_id, jobfolder.result_key(1), blob)  # copied over rank 1's place
    found = folder.results()
    assert list(found) == [0]
    assert payload.load_envelope(found[0]).value() == 42


def test_payload_tampering_is_refused(folder: JobFolder) -> None:
    folder.put_payload(payload.build(payload.FunctionCall(len, ("abc",))))
    call = payload.load(folder.payload())
    assert call.fn(*call.args) == 3
    blob = folder.store.get(folder.run_id, jobfolder.PAYLOAD)
    assert blob is not None
    folder.store.put(folder.run_id, jobfolder.PAYLOAD, blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(PayloadError, match="signature"):
        folder.payload()


def test_control_files_go_logs_stay(folder: JobFolder) -> None:
    folder.put_payload(b"x")
    folder.beat()
    folder.put_stop(1.0)
    folder.put_status(0, NodeStatus(node=0, exit_code=0))
    folder.put_result(0, b"r")
    log = folder.path(jobfolder.log_key(0))
    log.parent.mkdir(parents=True)
    log.write_text("line\n")
    folder.delete_control_files()
    left = sorted(str(p.relative_to(folder.path())) for p in folder.path().rglob("*") if p.is_file())
    assert left == ["logs/rank-00000.log"]
