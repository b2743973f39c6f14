"""A job's cgroup (prefect_sgpu.launch.job_cgroup) on this host's own cgroup v2 hierarchy."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from prefect_sgpu.launch.job_cgroup import JobCgroup, cgroup2_root, own_cgroup
from support.processes import HOPPER, still_growing

def _marked(marker: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]


def test_everything_a_job_started_dies_with_its_cgroup_even_a_process_that_never_keeps_its_pid(tmp_path: Path) -> None:
    name = f"sgpu-test-{uuid.uuid4().hex[:8]}"
    cgroup, why = JobCgroup.create(name)
    if cgroup is None:  # the EC2 node's requirement: root and a writable cgroup v2 hierarchy
        pytest.skip(f"this host cannot make a cgroup: {why}")
    hops = tmp_path / "hops"
    hops.touch()
    try:
        assert cgroup.path == cgroup2_root() / (own_cgroup() or "/").lstrip("/") / name
        shell = subprocess.Popen(cgroup.command([sys.executable, "-c", HOPPER, str(hops)]), start_new_session=True)
        assert shell.wait(timeout=20) == 0, "the first generation exits at once"
        assert still_growing(hops), "its descendants hop on, none of them a child of this test"
        assert cgroup.populated()
        assert cgroup.kill() >= 1
        assert not cgroup.path.exists(), "the empty cgroup was removed"
        assert not still_growing(hops), "no generation outran the kill"
        assert cgroup.kill() == 0, "idempotent"
    finally:
        if cgroup.path.exists():  # only if an assertion above failed
            cgroup.kill()


def test_a_process_joins_a_cgroup_and_a_name_left_by_a_crashed_bootstrap_is_emptied_and_made_again() -> None:
    name = f"sgpu-test-{uuid.uuid4().hex[:8]}"
    first, why = JobCgroup.create(name)
    if first is None:
        pytest.skip(f"this host cannot make a cgroup: {why}")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        first.procs.write_text(str(sleeper.pid))
        assert first.pids() == [sleeper.pid]
        second, _ = JobCgroup.create(name)  # the same name again: what ran in it is ended first
        assert second is not None and second.pids() == []
        assert sleeper.wait(timeout=10) == -9
        child = subprocess.Popen([sys.executable, "-c", "from prefect_sgpu.launch.job_cgroup import JobCgroup;"
                                  f"JobCgroup({str(second.path)!r}).join(); import time; time.sleep(600)"],
                                 env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        deadline = time.monotonic() + 20
        while child.pid not in second.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert second.pids() == [child.pid]
        assert second.kill() == 1 and child.wait(timeout=10) == -9
    finally:
        sleeper.kill()


def test_the_hierarchy_is_found_in_mountinfo_unified_or_hybrid(tmp_path: Path) -> None:
    unified = tmp_path / "unified"
    unified.write_text("24 1 0:22 / /proc rw - proc proc rw\n"
                       "31 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw\n")
    hybrid = tmp_path / "hybrid"
    hybrid.write_text("35 30 0:30 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
                      "36 30 0:31 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n")
    none = tmp_path / "none"
    none.write_text("35 30 0:30 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n")
    assert cgroup2_root(str(unified)) == Path("/sys/fs/cgroup")
    assert cgroup2_root(str(hybrid)) == Path("/sys/fs/cgroup/unified")
    assert cgroup2_root(str(none)) is None
    assert cgroup2_root(str(tmp_path / "missing")) is None
    cgroups = tmp_path / "cgroup"
    cgroups.write_text("4:memory:/x\n0::/system.slice/cloud-final.service\n")
    assert own_cgroup(str(cgroups)) == "/system.slice/cloud-final.service"


def test_a_name_that_is_not_a_plain_cgroup_name_is_refused() -> None:
    for name in ("", "..", ".hidden", "a/b", "../../escape", "run id"):
        cgroup, why = JobCgroup.create(name)
        assert cgroup is None and "not a plain cgroup name" in why, name
