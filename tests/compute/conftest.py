"""The computes the conformance suite runs against, one fixture per compute."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import pytest

from support.conformance import LocalCase, LocalSpawnCase, LocalWarmCase

if TYPE_CHECKING:
    from support.conformance_ec2 import EC2Case, EC2Env, EC2WarmCase
    from support.conformance_fake import FakeCase, FakeEnvCase, FakeWarmCase
    from support.conformance_ray import RayCase

@pytest.fixture
def local_case() -> LocalCase:
    return LocalCase()


@pytest.fixture
def local_spawn_case(monkeypatch: pytest.MonkeyPatch) -> LocalSpawnCase:
    monkeypatch.setenv("PREFECT_SGPU_RANK_START", "spawn")
    return LocalSpawnCase()


@pytest.fixture
def local_warm_case() -> Iterator[LocalWarmCase]:
    case = LocalWarmCase()
    yield case
    case.compute.close()


@pytest.fixture(scope="session")
def ray_address() -> "Iterator[str]":
    """One two-node loopback Ray cluster (one CPU a node: two workers) for every Ray test of the session.

    A process joins one Ray cluster, so the Ray tests share it; this process leaves it at the end.
    """
    from prefect_sgpu.ray.compute import RayTrainCompute
    from support.ray_cluster import ray_cluster

    with ray_cluster(cpus_per_node=1) as address:
        yield address
        RayTrainCompute(address=address).close()


@pytest.fixture
def ray_case(ray_address: str) -> "RayCase":
    from support.conformance_ray import RayCase

    return RayCase(ray_address)


@pytest.fixture
def ray_warm_case(ray_address: str) -> "Iterator[RayCase]":
    from prefect_sgpu.ray.warm_group import RAY_POOL
    from support.conformance_ray import RayWarmCase

    case = RayWarmCase(ray_address)
    yield case
    RAY_POOL.close(owner=id(case.compute))


@pytest.fixture
def fake_case(tmp_path: Any) -> "Iterator[FakeCase]":
    """The fake cloud: the remote-node wing with local processes for machines and no AWS."""
    from support.aws_fixtures import free_port
    from support.conformance_fake import FakeCase

    case = FakeCase(tmp_path, free_port())
    try:
        yield case
    finally:
        case.close()


@pytest.fixture
def fake_warm_case(tmp_path: Any) -> "Iterator[FakeWarmCase]":
    from support.aws_fixtures import free_port
    from support.conformance_fake import FakeWarmCase

    case = FakeWarmCase(tmp_path, free_port())
    try:
        yield case
    finally:
        case.close()


@pytest.fixture(scope="session")
def fake_env_root(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One venv folder for every fake_env machine of the session, as one machine's disk keeps it across
    boots: the first job builds the driver's environment, later ones reuse it."""
    return tmp_path_factory.mktemp("fake-node-envs")


@pytest.fixture
def fake_env_case(tmp_path: Any, fake_env_root: Any) -> "Iterator[FakeEnvCase]":
    """The fake cloud shipping the driver's environment: bare machines build it through the real stage."""
    from support.aws_fixtures import free_port
    from support.conformance_fake import FakeEnvCase

    case = FakeEnvCase(tmp_path, free_port(), fake_env_root)
    try:
        yield case
    finally:
        case.close()


@pytest.fixture
def ec2_case(aws_env: Any, aws_network: Any, aws_faults: Any, tmp_path: Any) -> "Iterator[EC2Case]":
    """EC2 on moto (through the recording proxy), each instance booted by the simulator."""
    from support.conformance_ec2 import EC2Case, ec2_environment

    with ec2_environment(aws_env, aws_network, tmp_path / "nodes", proxy=aws_faults) as env:
        yield EC2Case(env)


@pytest.fixture
def ec2_warm_case(aws_env: Any, aws_network: Any, aws_faults: Any, tmp_path: Any) -> "Iterator[EC2WarmCase]":
    """EC2 on moto with a warm lease kept between the test's jobs, ended before the leak checks."""
    from support.conformance_ec2 import EC2WarmCase, ec2_environment

    with ec2_environment(aws_env, aws_network, tmp_path / "nodes", proxy=aws_faults) as env:
        case = EC2WarmCase(env)
        try:
            yield case
        finally:
            case.close()


@pytest.fixture
def ec2(aws_env: Any, aws_network: Any, aws_faults: Any, tmp_path: Any) -> "Iterator[EC2Env]":
    """One test's offline AWS: bucket, moto through the recording proxy, the instance simulator booting
    bare images (the nodes build the driver's environment from the store: docs/environment.md)."""
    from support.conformance_ec2 import ec2_environment

    with ec2_environment(aws_env, aws_network, tmp_path / "nodes", proxy=aws_faults) as env:
        yield env


@pytest.fixture
def ec2_own_store(aws_env: Any, aws_network: Any, aws_faults: Any, tmp_path: Any) -> "Iterator[EC2Env]":
    """``ec2`` with a bucket of the test's own: for a test that sweeps the whole store and needs its live
    run judged live under a short TTL (every earlier job of the worker's shared store is judged first,
    one listing each, and the pass's clock runs on meanwhile)."""
    from support.conformance_ec2 import ec2_environment

    with ec2_environment(aws_env, aws_network, tmp_path / "nodes", proxy=aws_faults, own_bucket=True) as env:
        yield env


@pytest.fixture
def ec2_image(aws_env: Any, aws_network: Any, aws_faults: Any, tmp_path: Any) -> "Iterator[EC2Env]":
    """As ``ec2``, with an image that has everything (the driver's venv, this checkout): for tests that
    launch through the compute's own calls, with no job to ship an environment."""
    from support.conformance_ec2 import ec2_environment

    with ec2_environment(aws_env, aws_network, tmp_path / "nodes", proxy=aws_faults, bare=False) as env:
        yield env


@pytest.fixture
def bare(aws_env: Any, aws_network: Any, aws_faults: Any, tmp_path: Any) -> "Iterator[EC2Env]":
    """Offline AWS whose instances boot a bare image (`docs/environment.md`); one venv folder for
    every node of the test, as one instance's disk keeps it across boots, and a bucket of the test's own
    (its tests read every object of the store: what a build shipped and left)."""
    from support.conformance_ec2 import ec2_environment

    with ec2_environment(aws_env, aws_network, tmp_path / "nodes", proxy=aws_faults, bare=True,
                         env_root=tmp_path / "node-envs", own_bucket=True) as env:
        yield env
