"""A user who installed prefect-sgpu from its wheel (not this checkout) runs an EC2 job on bare nodes.

The suite's own driver runs from the editable checkout, whose source travels as an editable tree.
A user of the README's EC2 quick start installed a wheel (or a git URL): then prefect-sgpu is a
*local* distribution, its installed files (from its RECORD) travel, and the node lays them out in
its venv's site-packages. This test builds the wheel from a copy of the tracked sources, installs
it with the ``aws``, ``torch`` and ``test`` extras into a venv of its own (uv, from its cache), and
runs a 2-node job from that venv against moto and the simulator's bare nodes: no checkout on any
path of the driver or the nodes (the tests' support modules only, for moto and the simulator).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]

DRIVER = r'''
import json, os, sys, tempfile
from pathlib import Path

sys.path.insert(0, sys.argv[1])  # the tests' support modules (moto, the simulator); not prefect_sgpu
import prefect_sgpu
from prefect_sgpu import distributed
from prefect_sgpu.environment import ship as environment_ship
from prefect_sgpu.environment import capture
from support.aws_fixtures import create_network, offline_aws
from support.conformance_ec2 import ec2_environment


def where():
    import sys

    import prefect_sgpu
    from prefect_sgpu import runtime

    return {"rank": runtime.rank(), "file": prefect_sgpu.__file__, "prefix": sys.prefix,
            "version": prefect_sgpu.__version__}


work = Path(sys.argv[2])
env = capture()
trees = {t["name"]: t["kind"] for t in environment_ship.manifest(env)["trees"]}
with offline_aws() as (aws, proxy):
    with ec2_environment(aws, create_network(aws), work / "nodes", proxy=proxy) as ec2:
        fn = distributed(gpus=2, gpu_type="A10", remote=True, mlflow=False, timeout=600,
                         compute=ec2.compute(agent_timeout_s=300.0))(where)
        try:
            values = fn.distributed()
        except BaseException:
            for node in list(ec2.simulator.nodes):  # what each node printed: in the test's failure
                print(f"--- console of {node}", ec2.simulator.console(node)[-3000:], sep="\n", file=sys.stderr)
            print("--- simulator errors", ec2.simulator.errors, file=sys.stderr)
            raise
print("RESULT " + json.dumps({"driver": prefect_sgpu.__file__, "trees": trees, "values": values,
                              "source": next(d.source for d in env.distributions if d.name == "prefect-sgpu")}))
'''


def _sources(target: Path) -> Path:
    """A copy of the tracked files (what a clone has), so building leaves nothing in this checkout."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, listed.decode().split("\0")):
        source = ROOT / rel
        if source.is_file():
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / rel, follow_symlinks=False)
    return target


def test_a_driver_that_installed_the_wheel_runs_an_ec2_job_whose_nodes_get_the_wheels_files(tmp_path: Path) -> None:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert uv, "uv comes with the test extra's installs (./dev installs it into the venv)"
    src = _sources(tmp_path / "src")
    subprocess.run([uv, "build", "-q", "--wheel", "--out-dir", str(tmp_path / "dist"), str(src)], check=True)
    (wheel,) = (tmp_path / "dist").glob("prefect_sgpu-*.whl")
    venv = tmp_path / "user-venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    install = [uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "-c", str(ROOT / "constraints.txt"),
               f"prefect-sgpu[aws,torch,test] @ {wheel.as_uri()}"]
    if subprocess.run([*install, "--offline"], capture_output=True).returncode != 0:  # all in uv's cache, usually
        subprocess.run(install, check=True)
    # the pinned uv wheel the simulator's package index serves to bare nodes (./dev fetched it into its venv)
    shutil.copytree(Path(sys.prefix) / "sgpu-wheels", venv / "sgpu-wheels")
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "PREFECT_", "VIRTUAL_ENV"))}
    env.update(PREFECT_SGPU_HOME=str(home / "sgpu"), PREFECT_HOME=str(home / "prefect"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    done = subprocess.run([str(venv / "bin" / "python"), str(script), str(ROOT / "tests"), str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=840)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["driver"].startswith(str(venv)), "the driver imported the wheel's prefect_sgpu, not the checkout"
    assert out["source"] == "local" and out["trees"]["prefect-sgpu"] == "site", out
    assert [v["rank"] for v in out["values"]] == [0, 1]
    for value in out["values"]:
        # each rank's prefect_sgpu: the wheel's files, laid out in its node's venv (built from the store)
        assert value["file"].startswith(value["prefix"]) and "site-packages" in value["file"], value
        assert not value["file"].startswith((str(ROOT), str(venv))), value
