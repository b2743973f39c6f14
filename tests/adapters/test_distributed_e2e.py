"""End-to-end runs with real torch elastic agents and real gloo process groups."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from support.processes import default_sigint, job_processes
from support.tokens import digest_of, token_digest
from prefect_sgpu import LaunchTimeout, RankFailedError, distributed, run_script, runtime
from prefect_sgpu.compute.local import LocalProcessCompute, namespaces_available
from prefect_sgpu.errors import JobCancelled

pytestmark = pytest.mark.e2e


class TrainingDiverged(Exception):
    """An exception class defined in the caller's module, raised inside a rank."""


def _all_reduce_rank_sum(tag: str) -> dict:
    import torch
    import torch.distributed as dist

    backend = runtime.init_process_group()
    t = torch.tensor([float(runtime.rank())])
    dist.all_reduce(t)
    print(f"{tag}: rank {runtime.rank()} of {runtime.world_size()} sum={t.item():g}")
    return {"rank": runtime.rank(), "world": runtime.world_size(), "node": runtime.node_rank(),
            "local_rank": runtime.local_rank(), "sum": t.item(), "backend": backend,
            "device": str(runtime.device())}


@pytest.mark.quick  # the inner loop's tier: one short job of this kind
def test_one_node_two_ranks_returns_values_in_rank_order(capfd: pytest.CaptureFixture[str]) -> None:
    fn = distributed(gpus=2, mlflow=False)(_all_reduce_rank_sum)
    result = fn.run("hello")
    values = result.values
    assert [v["rank"] for v in values] == [0, 1]
    assert all(v["sum"] == 1.0 and v["world"] == 2 and v["backend"] == "gloo" for v in values)
    assert all(v["device"] == "cpu" for v in values)
    out = capfd.readouterr().out
    assert "[rank 0 node 0] hello: rank 0 of 2 sum=1" in out
    assert "[rank 1 node 0] hello: rank 1 of 2 sum=1" in out
    logs = Path(result.logs_uri)
    assert "rank 1 of 2" in (logs / "rank-00001.log").read_text(), "full per-rank logs stay in the store"
    assert job_processes(result.run_id) == []


def test_two_nodes_two_ranks_each_world_of_four() -> None:
    fn = distributed(gpus=4, nodes=2, mlflow=False)(_all_reduce_rank_sum)
    result = fn.run("multi")
    assert [v["rank"] for v in result.values] == [0, 1, 2, 3]
    assert [v["node"] for v in result.values] == [0, 0, 1, 1]
    assert [v["local_rank"] for v in result.values] == [0, 1, 0, 1]
    assert all(v["sum"] == 6.0 and v["world"] == 4 for v in result.values)
    assert [r.node for r in result.ranks] == [0, 0, 1, 1]
    assert job_processes(result.run_id) == []
    # the gang check ran before the function (on by default), and the function's own group started clean
    check = result.gang_check
    assert check is not None and (check["ranks"], check["nodes"], check["backend"]) == (4, 2, "gloo")
    assert sorted((link["from node"], link["to node"]) for link in check["links"]) == [(0, 1), (1, 0)]
    assert all(link["GB/s"] > 0 for link in check["links"])
    skipped = distributed(gpus=4, nodes=2, mlflow=False, gang_check=False)(_all_reduce_rank_sum).run("multi")
    assert skipped.gang_check is None and all(v["sum"] == 6.0 for v in skipped.values)


@pytest.mark.skipif(not namespaces_available(), reason="needs root and util-linux unshare for namespaces")
def test_simulated_nodes_have_their_own_dev_shm_and_proc() -> None:
    @distributed(gpus=4, nodes=2, mlflow=False, compute=LocalProcessCompute(isolation="namespaces"))
    def node_view() -> tuple[list[str], int, str | None]:
        import psutil
        import torch.distributed as dist

        Path(f"/dev/shm/sgpu-test-rank-{runtime.rank()}").write_text("x")
        runtime.init_process_group()
        dist.barrier()
        shm = sorted(p.name for p in Path("/dev/shm").glob("sgpu-test-rank-*"))
        # the node's own /proc: a process sees itself (DeepSpeed and others call psutil.Process())
        return shm, psutil.Process().pid - os.getpid(), os.environ.get("OMP_NUM_THREADS")

    views = node_view.distributed()
    assert views[0][0] == views[1][0] == ["sgpu-test-rank-0", "sgpu-test-rank-1"]
    assert views[2][0] == views[3][0] == ["sgpu-test-rank-2", "sgpu-test-rank-3"]
    assert [v[1] for v in views] == [0, 0, 0, 0]
    threads = str(max(1, (os.cpu_count() or 1) // 4))
    assert [v[2] for v in views] == [threads] * 4, "each rank gets its share of the host's cores"
    assert not list(Path("/dev/shm").glob("sgpu-test-rank-*")), "the host's /dev/shm is untouched"


def test_failing_rank_raises_its_own_exception_and_stops_the_others() -> None:
    @distributed(gpus=4, nodes=2, mlflow=False)
    def diverge() -> int:
        import torch.distributed as dist

        runtime.init_process_group()
        dist.barrier()
        if runtime.rank() == 3:
            raise TrainingDiverged("loss is nan at step 7")
        time.sleep(3600)  # left to sleep, the others would keep the job past the test's timeout
        return runtime.rank()

    job = diverge.job()
    with pytest.raises(TrainingDiverged, match="loss is nan at step 7") as info:
        job.run()
    failure = info.value.sgpu_failure
    assert (failure.rank, failure.node, failure.exit_code) == (3, 1, 1)
    assert failure.host
    assert "loss is nan at step 7" in failure.remote_traceback
    assert "raise TrainingDiverged" in failure.remote_traceback
    assert any("rank 3 (node 1)" in note for note in info.value.__notes__)
    assert job_processes(job.run_id) == []


def test_unimportable_exception_becomes_rank_failed_error() -> None:
    @distributed(gpus=2, mlflow=False)
    def bad() -> None:
        if runtime.rank() == 1:
            class Unreachable(Exception):
                def __reduce__(self):  # cannot be rebuilt on the caller's side
                    raise TypeError("no")

            raise Unreachable("custom failure")

    with pytest.raises(RankFailedError) as info:
        bad.distributed()
    assert info.value.rank == 1 and info.value.exit_code == 1
    assert "custom failure" in str(info.value)


def test_rank_killed_by_signal_is_reported() -> None:
    @distributed(gpus=2, mlflow=False)
    def crash() -> None:
        if runtime.rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)

    job = crash.job()
    with pytest.raises(RankFailedError) as info:
        job.run()
    assert info.value.rank == 0
    assert info.value.exit_code == -9
    assert "SIGKILL" in str(info.value)
    assert job_processes(job.run_id) == []


def test_timeout_stops_every_rank() -> None:
    @distributed(gpus=2, timeout=8, mlflow=False)
    def forever() -> None:
        time.sleep(600)

    job = forever.job()
    with pytest.raises(LaunchTimeout, match="timeout=8s"):
        job.run()
    assert job_processes(job.run_id) == []


def test_cancelled_future_stops_every_rank(tmp_path: Path) -> None:
    marker = tmp_path / "started"

    @distributed(gpus=2, mlflow=False)
    def slow(path: str) -> None:
        Path(path + str(runtime.rank())).write_text("1")
        time.sleep(600)

    future = slow.submit(str(marker))
    deadline = time.monotonic() + 60
    while not (Path(str(marker) + "0").exists() and Path(str(marker) + "1").exists()):
        assert time.monotonic() < deadline, "ranks never started"
        time.sleep(0.2)
    assert future.cancel()
    with pytest.raises(JobCancelled):
        future.result(timeout=60)
    run_dirs = [p.name for p in (Path(os.environ["PREFECT_SGPU_HOME"]) / "jobs").iterdir()]
    assert all(job_processes(r) == [] for r in run_dirs)


def test_submit_runs_calls_side_by_side() -> None:
    @distributed(gpus=1, mlflow=False)
    def square(x: int) -> int:
        return x * x

    futures = [square.submit(x) for x in (2, 3)]
    assert [f.result(timeout=120) for f in futures] == [[4], [9]]


def test_large_results_come_back_intact() -> None:
    @distributed(gpus=2, mlflow=False)
    def big() -> bytes:
        return bytes([runtime.rank()]) * (24 * 1024 * 1024)

    a, b = big.distributed()
    assert len(a) == len(b) == 24 * 1024 * 1024
    assert a[:3] == b"\x00\x00\x00" and b[-3:] == b"\x01\x01\x01"


def test_max_restarts_relaunches_the_worker_group(tmp_path: Path) -> None:
    @distributed(gpus=2, max_restarts=1, mlflow=False)
    def flaky(path: str) -> int:
        restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if restart == 0 and runtime.rank() == 1:
            raise RuntimeError("transient failure")
        return restart

    assert flaky.distributed(str(tmp_path)) == [1, 1]


def test_env_reaches_ranks_but_prefect_api_key_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_API_KEY", "pnu_secret_should_not_travel")

    @distributed(gpus=1, mlflow=False, env={"MY_SETTING": "42"})
    def read_env() -> tuple[str | None, str | None]:
        return os.environ.get("MY_SETTING"), os.environ.get("PREFECT_API_KEY") or None

    assert read_env.distributed() == [("42", None)]


_KEY_DRIVER = """
import json, sys
from prefect.settings import get_current_settings
from prefect_sgpu import distributed


def prefect_in_a_rank():
    from prefect.settings import get_current_settings

    s = get_current_settings()
    secret = lambda v: v.get_secret_value() if v is not None else None
    import os, stat
    job = os.environ["SGPU_JOB_DIR"]
    mode = lambda p: oct(stat.S_IMODE(os.stat(p).st_mode))
    return {"key": secret(s.api.key), "auth": secret(s.api.auth_string), "home": str(s.home),
            "password": secret(s.server.database.password), "job_dir": mode(job),
            "log": mode(os.path.join(job, "logs", "rank-00000.log"))}


mine = get_current_settings().api.key
ranks = distributed(gpus=1, mlflow=False, env={"PREFECT_API_KEY": "pnu_passed_as_env"})(prefect_in_a_rank)
print(json.dumps({"driver": mine.get_secret_value() if mine else None, "ranks": ranks.distributed()}))
"""


def test_a_rank_finds_no_prefect_credential_in_a_profile_dotenv_or_toml_and_its_files_are_private(tmp_path: Path) -> None:
    home = tmp_path / "prefect-home"
    home.mkdir()
    (home / "profiles.toml").write_text('active = "team"\n[profiles.team]\n'
                                        'PREFECT_API_KEY = "pnu_from_the_profile_0123456789"\n')
    project = tmp_path / "project"  # the driver's working directory, which ranks share
    project.mkdir()
    (project / ".env").write_text("PREFECT_API_KEY=pnu_from_dotenv_0123456789\n"
                                  "PREFECT_API_AUTH_STRING=admin:from-dotenv\n")
    (project / "prefect.toml").write_text('[server.database]\npassword = "db-password-from-toml"\n')
    (project / "driver.py").write_text(_KEY_DRIVER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") or k == "PREFECT_SGPU_HOME"}
    env.update({"PREFECT_HOME": str(home), "PREFECT_SGPU_DEVICE": "cpu",
                "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    out = subprocess.run([sys.executable, "driver.py"], cwd=project, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["driver"] == "pnu_from_dotenv_0123456789", "the driver itself reads .env (the setup is real)"
    [rank] = seen["ranks"]
    assert (rank["key"] or None, rank["auth"] or None, rank["password"] or None) == (None, None, None), rank
    assert rank["home"] != str(home) and rank["home"].endswith("prefect-home"), "a Prefect home of the job's own"
    assert (rank["job_dir"], rank["log"]) == ("0o700", "0o600"), "the job folder and logs are the user's alone"


SCRIPT = """
import os, sys
import torch, torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
out = sys.argv[sys.argv.index("--out") + 1]
with open(f"{out}.{dist.get_rank()}", "w") as fh:
    fh.write(f"{t.item():g}")
if "--fail-rank" in sys.argv and dist.get_rank() == int(sys.argv[sys.argv.index("--fail-rank") + 1]):
    sys.exit(3)
dist.destroy_process_group()
"""


def test_run_script_runs_an_unmodified_torchrun_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "sum"
    run_script(script, ["--out", str(out)], gpus=2, mlflow=False)
    assert [Path(f"{out}.{r}").read_text() for r in (0, 1)] == ["3", "3"]


def test_run_script_raises_on_non_zero_exit(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    with pytest.raises(RankFailedError) as info:
        run_script(script, ["--out", str(tmp_path / "x"), "--fail-rank", "1"], gpus=2, mlflow=False)
    assert (info.value.rank, info.value.exit_code) == (1, 3)


INTERRUPTED_DRIVER = """
import sys, time
from pathlib import Path
from prefect_sgpu import distributed, runtime

@distributed(gpus=2)
def wait_forever(flag):
    Path(flag + str(runtime.rank())).write_text("up")
    time.sleep(600)

wait_forever.distributed(sys.argv[1])
"""


def _mlflow_runs_tagged(run_id: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps, filter_string=f"tags.`sgpu.run_id` = '{run_id}'")


@pytest.fixture
def start_driver(tmp_path: Path) -> Iterator[Callable[[], subprocess.Popen]]:
    """Start a driver script whose two ranks wait ten minutes; a driver a failed test left running
    is killed at the test's end (its nodes then stop themselves at the 4 s heartbeat TTL)."""
    started: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        script = tmp_path / "driver.py"
        script.write_text(textwrap.dedent(INTERRUPTED_DRIVER))
        flag = tmp_path / "up"
        proc = subprocess.Popen([sys.executable, str(script), str(flag)], cwd=tmp_path,
                                env={**os.environ, "PREFECT_SGPU_HEARTBEAT_TTL": "4"},
                                preexec_fn=default_sigint)
        started.append(proc)
        deadline = time.monotonic() + 90
        while not (Path(f"{flag}0").exists() and Path(f"{flag}1").exists()):
            assert proc.poll() is None, "driver exited early"
            assert time.monotonic() < deadline, "ranks never started"
            time.sleep(0.2)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _newest_run_id() -> str:
    jobs = Path(os.environ["PREFECT_SGPU_HOME"]) / "jobs"
    return max(jobs.iterdir(), key=lambda p: p.stat().st_mtime).name


def test_ctrl_c_stops_every_rank_and_marks_the_mlflow_run_killed(start_driver) -> None:
    proc = start_driver()
    run_id = _newest_run_id()
    assert job_processes(run_id), "the job should be running"
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert job_processes(run_id) == []
    [run] = _mlflow_runs_tagged(run_id)
    assert run.info.status == "KILLED"


def test_nodes_stop_themselves_when_the_driver_dies(start_driver) -> None:
    proc = start_driver()
    run_id = _newest_run_id()
    proc.kill()  # SIGKILL: no cleanup code runs in the driver
    proc.wait(timeout=10)
    deadline = time.monotonic() + 60
    while job_processes(run_id):
        assert time.monotonic() < deadline, f"orphans left: {job_processes(run_id)}"
        time.sleep(0.5)


def test_nodes_that_stop_for_a_stalled_heartbeat_are_named_as_the_cause_not_their_peers_errors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver still runs but its heartbeat stops advancing (a driver process too loaded to write it):
    the nodes stop themselves at their TTL, and the job's error says so, with what the ranks raised
    afterwards (a collective whose peer vanished) named as collateral, not as the cause."""
    from support.training import all_reduce_for_a_minute

    from prefect_sgpu.driver import heartbeat
    from prefect_sgpu.errors import HeartbeatExpired

    monkeypatch.setattr(heartbeat, "HEARTBEAT_INTERVAL_S", 3600.0)  # the first beat, then none
    monkeypatch.setenv("PREFECT_SGPU_HEARTBEAT_TTL", "3")
    job = distributed(gpus=2, nodes=2, mlflow=False, timeout=120)(all_reduce_for_a_minute).job()
    with pytest.raises(HeartbeatExpired) as info:
        job.run()
    text = str(info.value)
    assert "no new driver heartbeat for" in text and "(ttl 3s)" in text, text
    assert "still ran" in text and "heartbeat TTL" in text, text
    if info.value.collateral is not None:
        assert "collateral" in text and info.value.collateral in text
    assert job_processes(job.run_id) == []


def _own_process_group_timeout() -> float:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_timeout

    dist.init_process_group(backend="gloo")  # user code that does not use runtime.init_process_group
    try:
        # gloo's constructor has no closing handshake: a rank that tears its group down at
        # once can close a pair its peer is still connecting, so both meet first
        dist.barrier()
        return _get_default_timeout(dist.Backend.GLOO).total_seconds()
    finally:
        dist.destroy_process_group()


def test_collective_timeout_applies_to_process_groups_user_code_creates() -> None:
    """torch's default is 30 min; a rank's default comes from SGPU_COLLECTIVE_TIMEOUT_S."""
    timeouts = distributed(gpus=2, mlflow=False, env={"SGPU_COLLECTIVE_TIMEOUT_S": "123"})(
        _own_process_group_timeout).distributed()
    assert timeouts == [123.0, 123.0]


@pytest.mark.usefixtures("prefect_server")
def test_secrets_reach_every_rank_from_secret_blocks_and_rest_nowhere(sgpu_home: Path) -> None:
    import uuid

    from prefect.blocks.system import Secret

    from prefect_sgpu.errors import SGPUConfigError

    value = f"tok-{uuid.uuid4().hex}"
    Secret(value=value).save("sgpu-test-token", overwrite=True)
    fn = distributed(gpus=2, mlflow=False, secrets={"MY_TOKEN": "sgpu-test-token"})(token_digest)
    shown = json.dumps(fn.dry_run(), default=str)
    assert "MY_TOKEN" in shown and value not in shown
    job = fn.job()
    assert job.run().values == [digest_of(value)] * 2
    left = [p for p in (sgpu_home / "jobs" / job.run_id).rglob("*") if p.is_file() and value.encode() in p.read_bytes()]
    assert left == [], "a secret rests in the job folder"
    before = {p.name for p in (sgpu_home / "jobs").iterdir()}
    with pytest.raises(SGPUConfigError, match=r"secrets\[MY_TOKEN\]"):
        distributed(gpus=1, mlflow=False, secrets={"MY_TOKEN": "no-such-block"})(token_digest).distributed()
    assert {p.name for p in (sgpu_home / "jobs").iterdir()} == before, "refused before anything was started"
    with pytest.raises(SGPUConfigError, match="environment variable name"):
        distributed(gpus=1, secrets={"NOT A NAME": "sgpu-test-token"})(token_digest)


class _RunsACommand:
    """A return value whose unpickling would run a shell command in whoever loads it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_a_rank_returning_an_object_that_runs_a_command_is_refused_in_the_driver(tmp_path: Path) -> None:
    from prefect_sgpu import ResultRefused

    marker = tmp_path / "MARKER"

    def hostile(path: str) -> object:
        return _RunsACommand(path) if runtime.rank() == 1 else {"rank": runtime.rank()}

    with pytest.raises(ResultRefused) as info:
        distributed(gpus=2, mlflow=False)(hostile).distributed(str(marker))
    assert info.value.rank == 1 and info.value.global_name.endswith(".system")
    assert "trusted_results=True" in str(info.value)
    assert not marker.exists(), "the command never ran in the driver"
