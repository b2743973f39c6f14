"""The node's environment stage through its transport seam, on the fake cloud (no AWS).

The stage (:mod:`prefect_sgpu.launch.node_env`) knows no cloud: it reaches the store, the secrets and
its own identity through the transport the user-data names. Here that is the fake cloud's
(:mod:`support.fake_stage`) over a local store, and the stage runs as a bare node runs it: its
carried text, a program of its own.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from prefect_sgpu.environment import ship as environment_ship
from prefect_sgpu.environment import Distribution, Environment, PythonVersion
from prefect_sgpu.environment.files import scan
from prefect_sgpu.launch import node_env
from prefect_sgpu.store import LocalStore

LAUNCH = Path(node_env.__file__).parent
TESTS = Path(__file__).resolve().parents[1]


def _shipped(tmp_path: Path) -> tuple[LocalStore, Environment]:
    project = tmp_path / "project"
    (project / "features").mkdir(parents=True)
    (project / "features" / "__init__.py").write_text("")
    store = LocalStore(tmp_path / "store")
    env = Environment(python=PythonVersion.here(),
                      distributions=(Distribution(name="six", version=metadata.version("six")),),
                      working_dir=scan("working_dir", project, "environment.working_dir"))
    environment_ship.ship(store, env)
    return store, env


def _stage(tmp_path: Path, store: LocalStore, env: Environment, manifest: str) -> subprocess.CompletedProcess[str]:
    folder = tmp_path / "stage"
    folder.mkdir(exist_ok=True)
    stage = folder / environment_ship.STAGE_MAIN
    stage.write_text(environment_ship.stage_text())  # as the user-data carries it
    argv = [sys.executable, str(stage), f"--store={store.root_uri}", "--run-id=r1", f"--environment={env.digest}",
            f"--manifest={manifest}", "--transport=support.fake_stage", f"--secrets={tmp_path / 'secrets'}",
            "--machine-id=fake-m1", "--index=0", "--", "-c", "print('the bootstrap ran')"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(TESTS),
                               node_env.ENV_ROOT_ENV: str(tmp_path / "envs")})


def test_the_stage_reads_its_manifest_through_the_fake_transport_and_runs_the_bootstrap(tmp_path: Path) -> None:
    store, env = _shipped(tmp_path)
    venv = tmp_path / "envs" / f"{env.digest}-{node_env.platform_key()}"  # built by an earlier boot
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / node_env.COMPLETE).write_text(env.digest + "\n")
    done = _stage(tmp_path, store, env, environment_ship.manifest_sha256(env))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "reused environment" in done.stdout and done.stdout.strip().endswith("the bootstrap ran"), done.stdout


def test_a_failing_stage_writes_its_reason_to_the_store_through_the_transport(tmp_path: Path) -> None:
    store, env = _shipped(tmp_path)
    done = _stage(tmp_path, store, env, "0" * 64)  # no such manifest
    assert done.returncode == 3, done.stdout + done.stderr
    said = (store.get("r1", "setup/fake-m1.log") or b"").decode()
    assert f"reading {store.root_uri}/.environments/{env.digest}/manifest-{'0' * 64}.json" in said, said


def test_only_modules_named_for_aws_speak_its_protocol_or_import_it() -> None:
    """The seam on the node side: IMDS, SigV4, SSM and boto3 only in launch modules named ec2/aws."""
    wire = ("169.254.169.254", "AWS4-HMAC-SHA256", "AmazonSSM.", "x-aws-ec2-metadata")
    for path in sorted(LAUNCH.glob("*.py")):
        if "ec2" in path.name or "aws" in path.name:
            continue
        text = path.read_text()
        assert not [w for w in wire if w in text], path.name
        imported = {(n.module or "") if isinstance(n, ast.ImportFrom) else a.name
                    for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.Import, ast.ImportFrom))
                    for a in n.names}
        cloud = {m for m in imported if m.split(".")[0] in ("boto3", "botocore")
                 or m in ("prefect_sgpu.aws", "prefect_sgpu.store.s3") or ".ec2" in m}
        assert not cloud, (path.name, cloud)
