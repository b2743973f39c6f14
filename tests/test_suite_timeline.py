"""The suite's own timeline (tests/support/timeline.py) and its summary (bench/suite_timeline.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import timeline

ROOT = Path(__file__).resolve().parents[1]
BURN = ("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\n"
        "end = time.process_time() + 0.4\nwhile time.process_time() < end: pass\n"
        "open(sys.argv[1], 'a').write(' burned')\ntime.sleep(60)")
#: starts BURN and exits at once: init (or a subreaper) adopts the burner
ORPHAN = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], start_new_session=True)"


def _burned(pid_file: Path) -> int:
    """The burner's pid, once it has used its CPU."""
    deadline = time.monotonic() + 120
    while not pid_file.exists() or "burned" not in pid_file.read_text():
        assert time.monotonic() < deadline, f"{pid_file} never written"
        time.sleep(0.05)
    return int(pid_file.read_text().split()[0])


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_the_sampler_counts_the_suites_processes_orphans_included_and_no_one_elses(tmp_path: Path) -> None:
    out = tmp_path / "timeline.jsonl"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    sampler = timeline.Sampler(fd, os.getpid(), every=1.0)
    env = {**os.environ, timeline.SUITE_ENV: timeline.suite_id()}
    foreign_env = {k: v for k, v in env.items() if k != timeline.SUITE_ENV}
    child = subprocess.Popen([sys.executable, "-c", BURN, str(tmp_path / "child")], env=env)
    # an orphan: its parent exits at once, so init adopts it; only its environment says whose it is
    subprocess.run([sys.executable, "-c", ORPHAN, BURN, str(tmp_path / "orphan")], env=env, check=True)
    # another program's process: neither below this one (its parent exits) nor carrying the suite's id
    subprocess.run([sys.executable, "-c", ORPHAN, BURN, str(tmp_path / "foreign")], env=foreign_env, check=True)
    child_pid, orphan_pid, foreign_pid = (_burned(tmp_path / name) for name in ("child", "orphan", "foreign"))
    try:
        sampler.sample()
        sampler.sample()
    finally:
        os.close(fd)
        for pid in (child_pid, orphan_pid, foreign_pid):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        child.wait()
    records = _records(out)
    seen = {r["pid"] for r in records if r["ev"] == "proc"}
    assert {os.getpid(), child_pid, orphan_pid} <= seen and foreign_pid not in seen, records
    ticks = {pid: t for r in records if r["ev"] == "cpu" for pid, _, t in r["p"]}
    hz = os.sysconf("SC_CLK_TCK")
    assert ticks[child_pid] / hz >= 0.3 and ticks[orphan_pid] / hz >= 0.3, ticks


def test_the_summary_puts_each_seconds_cpu_under_its_test_a_server_or_the_time_between(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import suite_timeline
    finally:
        sys.path.pop(0)
    lines = [
        {"ev": "worker", "t": 0, "worker": "main", "pid": 10, "controller": True, "hz": 100, "cores": 2},
        {"ev": "worker", "t": 0, "worker": "gw0", "pid": 20, "controller": False, "hz": 100, "cores": 2},
        {"ev": "proc", "t": 1, "pid": 10, "start": 1, "ppid": 1, "cmd": "python -m pytest -n 1"},
        {"ev": "proc", "t": 1, "pid": 20, "start": 2, "ppid": 10, "cmd": "python -c exec(...)"},
        {"ev": "start", "t": 2, "worker": "gw0", "pid": 20, "test": "t.py::a"},
        {"ev": "proc", "t": 3, "pid": 30, "start": 3, "ppid": 20,
         "cmd": "python -m uvicorn --factory prefect.server.api.server:create_app"},
        {"ev": "proc", "t": 3, "pid": 31, "start": 3, "ppid": 20, "cmd": "python -m prefect_sgpu.launch.node_agent"},
        {"ev": "cpu", "t": 4, "p": [[20, 2, 100], [30, 3, 300], [31, 3, 200]]},
        {"ev": "end", "t": 5, "worker": "gw0", "pid": 20, "test": "t.py::a"},
        {"ev": "cpu", "t": 6, "p": [[20, 2, 150], [30, 3, 350], [31, 3, 260], [10, 1, 40]]},
        {"ev": "start", "t": 7, "worker": "gw0", "pid": 20, "test": "t.py::b"},
        {"ev": "cpu", "t": 8, "p": [[20, 2, 250], [31, 3, 280]]},
        {"ev": "end", "t": 13, "worker": "gw0", "pid": 20, "test": "t.py::b"},
    ]
    path = tmp_path / "timeline.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"ev": "cpu", "t"')  # a cut last line
    text = suite_timeline.summarize(suite_timeline.load(str(path)), top=5)
    rows = {cells[1].strip(): float(cells[2]) for cells in (line.split("|") for line in text.splitlines())
            if len(cells) == 5 and cells[2].strip().replace(".", "").isdigit()}
    assert rows["tests (the worker process)"] == 2.0  # 1 s in a, 1 s in b
    assert rows["tests (processes they started)"] == 2.0  # the agent, inside a
    assert rows["session server: Prefect server"] == 3.5
    assert rows["between tests (the worker process)"] == 0.5
    assert rows["after its test (processes outliving the test that started them)"] == 0.8  # the agent after a
    assert rows["the controller"] == 0.4
    assert "| t.py::b | 6 | 1 | 0.17 |" in text, text


def test_prefect_home_and_its_result_storage_are_this_test_processs_own(sgpu_home: Path) -> None:
    """Two suites on one machine (or one suite's workers) never share persisted results or profiles."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    assert Path(settings.home) == sgpu_home / "prefect"
    assert Path(settings.results.local_storage_path).is_relative_to(sgpu_home)
    assert os.environ[timeline.SUITE_ENV]  # the suite's id, inherited by the processes it starts
