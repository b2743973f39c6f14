"""Shared fixtures: an isolated home for jobs and MLflow, one Prefect server per session."""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Iterator

import pytest

_HOME = Path(tempfile.mkdtemp(prefix="sgpu-tests-"))
os.environ["PREFECT_SGPU_HOME"] = str(_HOME)
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_HOME / 'mlflow.db'}"
# Prefect's home (profiles, persisted task results, the local storage of cache hits) is this process's
# too: otherwise every suite on the machine run by plain pytest shares ~/.prefect (./dev: one per
# checkout), and a task cached by its inputs in one suite is a cache hit in another
os.environ["PREFECT_HOME"] = str(_HOME / "prefect")
# prices read from the (simulated) Price List API are kept in this home, never in the user's cache
os.environ["PREFECT_SGPU_PRICE_CACHE"] = str(_HOME / "prices")
os.environ.setdefault("PREFECT_SGPU_DEVICE", "cpu")  # CI has no GPU; GPU runs set it to "cuda"
# DeepSpeed's comm-op build belongs to this venv (./dev builds it there): one folder shared by two
# checkouts' venvs is rebuilt by each in turn
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
# Cold jobs unless a test asks for warm nodes (tests/compute/test_warm.py, the local_warm conformance
# case): a job's processes then end with the job, which is what most tests look for afterwards.
os.environ.setdefault("PREFECT_SGPU_KEEP_WARM", "0")
# Ray's memory monitor kills a node's newest workers once the *machine's* used memory passes 95 %.
# One suite peaks near 12 GiB of this 24 GiB machine; with a second suite beside it (the loaded runs
# docs/testing.md asks for) the other suite's memory alone brought the machine there, and the monitor
# killed ranks of tests that were not short of memory. The tests' Ray processes (the clusters they
# start and the ones @ray_launch starts) run without it; the kernel's OOM killer still stands.
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
# this suite's id, inherited by every process it starts: what tells its processes and names apart from
# a second suite's on the same machine (tests/support/timeline.py)
os.environ.setdefault("SGPU_TEST_SUITE", uuid.uuid4().hex[:12])


#: tests that share one resource a worker process holds for the whole session run on one xdist
#: worker, one after another (``--dist loadgroup``): the session's two-node Ray cluster
#: (``ray_address``): a process joins one Ray cluster, and a cluster serves one job at a time.
RAY_CLUSTER_GROUP = "ray-cluster"
#: tests that load the whole machine on purpose (many drivers, a work pool's runs at once) carry
#: ``pytest.mark.xdist_group("whole-machine")``: they never overlap each other.


def pytest_addoption(parser: pytest.Parser) -> None:
    from support.quick_tier import add_option

    add_option(parser)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put each test that needs the session's Ray cluster in the Ray group (and, under ``--quick``,
    leave out the long end-to-end tests: tests/support/quick_tier.py).

    The conformance cases pick their compute's fixture at run time (``getfixturevalue``), so a
    ``ray`` or ``ray_warm`` case is found by its parameter, not by its fixture names.
    """
    from support.quick_tier import select

    select(config, items)
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "ray_address" in getattr(item, "fixturenames", ()) or any(
                isinstance(v, str) and v in ("ray", "ray_warm") for v in params.values()):
            item.add_marker(pytest.mark.xdist_group(RAY_CLUSTER_GROUP))
    # the Ray group is the longest run one worker must do alone: it goes first, so the other
    # workers share out the rest meanwhile instead of waiting for it at the end. The end-to-end
    # tests (about 90 % of the suite's CPU, and most of its waiting) come next and the quick ones
    # last: the last minutes keep both cores busy with short tests instead of one long test
    # waiting on a TTL while the other workers have nothing left to take
    items.sort(key=lambda item: 0 if _group(item) == RAY_CLUSTER_GROUP
               else 1 if _group(item) or item.get_closest_marker("e2e") else 2)


def pytest_configure(config: pytest.Config) -> None:
    """A clear refusal, before any worker starts, of the pair that loses the groups."""
    from packaging.version import Version

    from support.cpu_use import CpuUse

    config.pluginmanager.register(CpuUse(), "sgpu-cpu-use")  # each test's CPU seconds (docs/testing.md)
    from support.quick_tier import configure

    configure(config)  # --quick: which of the package's modules the tier touched
    from support import timeline

    timeline.configure(config)  # SGPU_TEST_TIMELINE: tests and processes per second (docs/testing.md)

    if config.getoption("dist", "no") != "loadgroup":
        return
    import xdist

    if Version(pytest.__version__) >= Version("9.2") and Version(xdist.__version__) <= Version("3.8.0"):
        raise pytest.UsageError(f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__}: "
                                "--dist loadgroup groups nothing (pytest-dev/pytest-xdist#1386); "
                                "install the versions in constraints.txt")


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Refuse to run when xdist lost the groups: the Ray group split over workers starts one cluster
    each (memory, CPUs), which is slow at best and order-dependent at worst."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in session.items if _group(item) and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(f"--dist loadgroup did not take effect for {len(lost)} grouped tests "
                                f"(e.g. {lost[0]}); pytest {pytest.__version__} with this pytest-xdist "
                                "loses the groups: install the versions in constraints.txt")


def _group(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    return str(marker.args[0]) if marker and marker.args else None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the session's Ray cluster (``ray_address``) after the last test of the Ray group on this
    worker instead of at the session's end: the group runs first, and its idle cluster (GCS, raylets,
    dashboards, agents) otherwise used about 2 CPU s a minute and its memory for the rest of the
    suite. A later test that asks for it again starts a new one."""
    if _group(item) != RAY_CLUSTER_GROUP or (nextitem is not None and _group(nextitem) == RAY_CLUSTER_GROUP):
        return
    # the conformance cases reach it through getfixturevalue: looked up by name, not the item's own list
    for fixturedef in item.session._fixturemanager.getfixturedefs("ray_address", item) or ():
        if fixturedef.cached_result is not None:
            fixturedef.finish(getattr(item, "_request"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """This process's home goes when none of its tests failed (kept to look into otherwise)."""
    if exitstatus == 0 and not session.testsfailed:
        import shutil

        shutil.rmtree(_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def sgpu_home() -> Path:
    return _HOME


@pytest.fixture(autouse=True)
def _mlflow_process_state_restored() -> Iterator[None]:
    """A test that calls ``mlflow.set_tracking_uri`` (or leaves a run active) does not leak it.

    MLflow keeps the tracking and registry URIs set in a process ahead of
    ``MLFLOW_TRACKING_URI``; left set, they send a later test's ``models:/`` lookup
    to another test's store.
    """
    yield
    if "mlflow" not in sys.modules:
        return
    import mlflow
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    while mlflow.active_run() is not None:
        mlflow.end_run()
    tracking_utils._tracking_uri = None
    registry_utils._registry_uri = None


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[None]:
    """One real temporary Prefect server (SQLite) for every test that needs one."""
    from prefect.testing import utilities
    from prefect.testing.utilities import prefect_test_harness

    from support.aws_fixtures import free_port

    # the harness takes its port by binding port 0: one of the ephemeral ports every outgoing
    # connection draws from, which on a busy machine another socket can hold by the time the
    # server binds it; a port outside that range, reserved machine-wide, instead
    assert callable(getattr(utilities, "_find_available_port", None)), "prefect.testing.utilities changed"
    utilities._find_available_port = free_port
    # a deadline, not a wait: on a machine busy with other suites the server has taken over 2 minutes
    with prefect_test_harness(server_startup_timeout=300):
        yield


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator["Postgres"]:  # noqa: F821
    """One PostgreSQL server (Debian's package, 127.0.0.1 only) for the tests of this worker that need one."""
    from support.postgres import postgres

    with postgres() as cluster:
        yield cluster


@pytest.fixture(scope="module")  # its background services poll the database: ended with the module
def prefect_on_postgres(postgres_cluster: "Postgres") -> Iterator[str]:  # noqa: F821
    """A real ``prefect server start`` whose database is PostgreSQL (database ``prefect``): its API URL."""
    from support.postgres import prefect_server_on

    with prefect_server_on(postgres_cluster, "prefect") as api:
        yield api


# AWS fixtures (moto server, fake credentials, VPC, leak check) for every test module.
from support.aws_fixtures import (  # noqa: E402,F401
    aws_env,
    aws_faults,
    aws_network,
    aws_proxy,
    moto_server,
    no_leaked_instances,
)


@pytest.fixture
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> "VirtualClock":  # noqa: F821
    """The retry helper's clock in this process made virtual: its minutes of backoff pass at once."""
    from prefect_sgpu import retry
    from support.fast_clock import VirtualClock

    clock = VirtualClock()
    monkeypatch.setattr(retry, "CLOCK", clock)
    return clock


@pytest.fixture(autouse=True)
def _driver_modules_stay_home(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs of the suite leave the driver's own modules out (``PREFECT_SGPU_ENVIRONMENT``, the lowest
    layer), unless the test is marked ``own_modules``: a test worker's own modules are the test
    runner's (``conftest``, ``support``, every test file imported so far, each a top-level module),
    which no job needs, and which grow as the worker runs, so that every job would get an
    environment of its own (a venv built on simulated nodes, new Ray workers for a new
    ``runtime_env``). The default is proven by the tests that are marked."""
    from prefect_sgpu.environment import ENVIRONMENT_ENV

    if request.node.get_closest_marker("own_modules") is None and ENVIRONMENT_ENV not in os.environ:
        monkeypatch.setenv(ENVIRONMENT_ENV, '{"auto_modules": false}')
