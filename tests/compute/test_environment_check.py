"""Nodes whose image cannot run the driver's calls are refused once they are up, before any rank starts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.aws_fixtures import free_port
from support.conformance_fake import FakeCase

from prefect_sgpu import EnvironmentMismatch, ProvisioningError, distributed
from prefect_sgpu.protocol.versions import differences, runtime_versions

pytestmark = pytest.mark.e2e


def _never_runs() -> int:
    raise AssertionError("no rank may start on a node that cannot run the driver's calls")


def test_the_same_versions_agree_and_each_difference_is_named() -> None:
    mine = runtime_versions()
    assert mine["python"].count(".") == 2 and mine["prefect-sgpu"]
    assert differences(mine, dict(mine)) == []
    minor = mine["python"].rsplit(".", 1)[0]
    assert differences(mine, {**mine, "python": f"{minor}.99"}) == [], "a micro release runs the same calls"
    other = {**mine, "python": "3.10.12", "torch": "1.13.1", "cloudpickle": ""}
    found = " | ".join(differences(mine, other))
    assert f"python 3.10.12 on the node, {mine['python']} on the driver" in found
    assert "cloudpickle not installed on the node" in found
    if mine["torch"]:
        assert f"torch 1.13.1 on the node, {mine['torch']} on the driver" in found
    assert "reports no versions" in differences(mine, {})[0], "an older node half says nothing: refused"


def test_a_node_image_with_another_python_fails_the_job_in_seconds_naming_both(tmp_path: Path) -> None:
    case = FakeCase(tmp_path, free_port())
    case.provider.image_versions = {"python": "3.10.12"}
    try:
        job = distributed(**case.options(timeout=600))(_never_runs).job()
        started = time.monotonic()
        with pytest.raises(EnvironmentMismatch) as info:
            job.run()
        waited = time.monotonic() - started
        message = str(info.value)
        assert "python 3.10.12 on the node" in message and f"{runtime_versions()['python']} on the driver" in message
        assert info.value.node in (0, 1) and info.value.host.startswith("fake-")
        assert job.run_id not in case.compute.sent_launches, "no launch document was written: no rank started"
        assert waited < case.compute.agent_timeout_s, f"failed after {waited:.0f}s, not at a timeout"
        assert case.leftovers(job.run_id) == []
    finally:
        case.close()


def test_a_node_whose_image_cannot_start_the_node_half_fails_the_job_in_seconds_with_its_output(
        tmp_path: Path) -> None:
    case = FakeCase(tmp_path, free_port())
    case.provider.broken_image = "ModuleNotFoundError: No module named 'prefect_sgpu'"
    try:
        job = distributed(**case.options(timeout=600))(_never_runs).job()
        started = time.monotonic()
        with pytest.raises(ProvisioningError) as info:
            job.run()
        waited = time.monotonic() - started
        assert "went away while booting" in str(info.value)
        assert "console output:\nModuleNotFoundError: No module named 'prefect_sgpu'" in str(info.value)
        assert waited < case.compute.agent_timeout_s, f"failed after {waited:.0f}s, not at a timeout"
        assert case.leftovers(job.run_id) == []
    finally:
        case.close()
