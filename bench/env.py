"""Seconds to agent up on EC2 (simulated): an image with everything, a bare image cold, a bare image reused.

Runs offline, like the test suite: a moto server, the EC2 simulator that boots each instance's
real user-data as local processes (``tests/support``). Three 2-node jobs of a trivial function:

1. ``image``: the simulated image has prefect-sgpu and every package (``environment="image"``);
2. ``bare cold``: a bare image (the system Python with pip only); the nodes fetch the uv wheel
   the stage pins (from a package index on 127.0.0.1) and build the driver's environment (a venv
   by digest, packages offline from uv's cache, the shipped files from the store);
3. ``bare reused``: the same environment again on the same node disk: the venv is reused;
4. a warm lease (``keep_warm``): its first job boots the machines, the next one is assigned to them.

For each: the wall time of the job, the seconds from the job's start to every agent up, and the
stage's own seconds as the nodes printed them (built / reused).

Then the store's pack of a built environment, at full size (the driver's own environment: a
CUDA torch venv of several GB; too large for moto, so the store's transfer is left out and the
stage's own steps are timed on this machine): a cold build with an **empty** uv cache, its
wheels downloaded from the index (PyPI), as a bare node's first boot on AWS does; packing that
venv (tar and sha256, what node 0 adds before its bootstrap); unpacking it under another root
(checked entry by entry, the venv's Python run), what a later cold boot does instead of the
build. ``--no-pack`` skips this part (it downloads several GB and writes three copies of the venv).

    ./dev bench env [--no-pack]

On AWS a cold build downloads the wheels from the index (several GB with CUDA torch) instead of
linking them from a warm cache: the cold number here is a lower bound.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from prefect_sgpu import distributed  # noqa: E402
from support.aws_fixtures import create_network, offline_aws  # noqa: E402
from support.conformance_ec2 import ec2_environment  # noqa: E402

STAGE = re.compile(r"\[prefect-sgpu env\] (built|reused) environment \S+ at \S+ in ([0-9.]+)s")


def _rank() -> int:
    from prefect_sgpu import runtime

    return runtime.rank()


class AgentsUp(logging.Handler):
    """When the driver logged its last "agent up" line (every node announced itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "agent up" in message and re.search(r"\((\d+)/\1\)", message):
            self.at = time.monotonic()


def one(env: Any, label: str, watcher: AgentsUp, environment: str | None, compute: Any = None) -> dict[str, Any]:
    fn = distributed(gpus=2, gpu_type="A10", remote=True, mlflow=False, timeout=900,
                     compute=compute or env.compute(agent_timeout_s=900.0),
                     **({"environment": environment} if environment else {}))(_rank)
    job = fn.job()
    watcher.at = None
    started = time.monotonic()
    values = job.run().values
    wall = time.monotonic() - started
    assert values == [0, 1], values
    stage = [STAGE.search(env.simulator.console(i["InstanceId"])) for i in env.instances(job.run_id)]
    row = {"label": label, "wall": wall, "agents_up": (watcher.at or started) - started,
           "stage": ", ".join(f"{m.group(1)} {float(m.group(2)):.1f}" for m in stage if m) or "-"}
    print(f"{label}: {row}", flush=True)
    return row


def pack_rows(work: Path, aws: Any) -> list[tuple[str, float, str]]:
    """(step, seconds, what) of the stage's steps on the driver's full environment (see the module doc)."""
    import subprocess
    import uuid

    from prefect_sgpu.environment import ship as environment_ship
    from prefect_sgpu.environment import capture
    from prefect_sgpu.launch import ec2_stage, node_env, node_pack
    from prefect_sgpu.store.s3 import S3Store
    from support.ec2_simulator import bare_image

    env = capture()
    bucket = f"sgpu-bench-{uuid.uuid4().hex[:8]}"
    aws.client("s3").create_bucket(Bucket=bucket)
    store = S3Store(f"s3://{bucket}/jobs", session=aws.session(), endpoint_url=aws.endpoint_url)
    environment_ship.ship(store, env)
    sha = environment_ship.manifest_sha256(env)
    base = f".environments/{env.digest}"
    s3 = ec2_stage.S3StageTransport(f"s3://{bucket}/jobs", aws.env.get("AWS_DEFAULT_REGION", "us-east-1"),
                                    aws.endpoint_url)
    manifest = node_env.check_manifest(s3.get(f"{base}/manifest-{sha}.json"), sha)
    saved = dict(os.environ)
    rows = []
    try:
        os.environ["PATH"] = f"{bare_image() / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}"  # uv: ./dev's
        os.environ["UV_CACHE_DIR"] = str(work / "empty-uv-cache")  # nothing cached: every wheel from the index
        os.environ.pop("UV_OFFLINE", None)
        os.environ[node_env.ENV_ROOT_ENV] = str(work / "builder")
        started = time.monotonic()
        venv, how = node_env.ensure(manifest, s3, f"{base}/files")
        assert how == "built", how
        size = subprocess.run(["du", "-sb", str(venv)], capture_output=True, text=True).stdout.split()[0]
        rows.append(("cold build, empty uv cache, wheels from PyPI", time.monotonic() - started,
                     f"{len(manifest['pins'])} distributions, venv {int(size) / 2**30:.2f} GiB"))
        started = time.monotonic()
        archive = work / "pack.tar"
        digest, packed = node_pack.pack(venv, archive)
        rows.append(("pack (tar + sha256), node 0 of the first job", time.monotonic() - started,
                     f"{packed / 2**30:.2f} GiB"))
        other = work / "fresh-node"
        other.mkdir()
        started = time.monotonic()
        node_pack.unpack(archive, other, other / venv.name, manifest["python"])
        rows.append(("unpack (check + extract + run), a later cold boot", time.monotonic() - started,
                     "the download from S3 is not included"))
        done = subprocess.run([str(other / venv.name / "bin" / "python"), "-c", "import torch, prefect_sgpu"],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return rows


def main() -> None:
    watcher = AgentsUp()
    logging.getLogger("prefect_sgpu.compute.remote.nodes").addHandler(watcher)
    logging.getLogger("prefect_sgpu.compute.remote.nodes").setLevel(logging.INFO)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sgpu-bench-env-") as tmp, offline_aws() as (aws, proxy):
        work = Path(tmp)
        network = create_network(aws)
        with ec2_environment(aws, network, work / "image-nodes", proxy=proxy, bare=False) as env:
            rows.append(one(env, "image (everything baked in)", watcher, None))
        with ec2_environment(aws, network, work / "bare-nodes", proxy=proxy, bare=True,
                             env_root=work / "node-envs") as env:
            rows.append(one(env, "bare image, cold", watcher, "driver"))
            rows.append(one(env, "bare image, reused", watcher, "driver"))
            warm = env.compute(agent_timeout_s=900.0, keep_warm=120.0)
            try:  # a warm lease: its machines boot once (the venv reused from disk here), then serve jobs
                rows.append(one(env, "bare image, a new warm lease", watcher, "driver", warm))
                rows.append(one(env, "bare image, the next job on the warm lease", watcher, "driver", warm))
            finally:
                warm.close()  # ends the lease: its instances terminated before the leak check
        packs = [] if "--no-pack" in sys.argv else pack_rows(work, aws)
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    print("\n| date | machine | job | wall s | agents up s | env stage s (per node) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {dt.date.today()} | {machine} | {row['label']} | {row['wall']:.1f} | {row['agents_up']:.1f} "
              f"| {row['stage']} |")
    if packs:
        print("\n| date | machine | step (the driver's whole environment) | s | what |")
        print("| --- | --- | --- | --- | --- |")
        for step, seconds, what in packs:
            print(f"| {dt.date.today()} | {machine} | {step} | {seconds:.1f} | {what} |")


if __name__ == "__main__":
    main()
