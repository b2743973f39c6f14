"""The driver's environment built on bare EC2 nodes (moto server, the simulator running the real user-data).

A bare node has a venv of the system Python with only pip: no uv (the stage fetches the wheel it
pins from a package index on 127.0.0.1), no prefect-sgpu, no torch, no checkout on any path. The user-data's environment stage reads the manifest the driver shipped
through the store, builds a venv keyed by the environment's digest (packages offline from uv's
cache, which ``./dev`` filled; the user's index on AWS), lays out the shipped files (this project,
the user's project) after checking each sha256, and starts the bootstrap in it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
import textwrap
import zlib
from pathlib import Path
from typing import Any

import pytest

from prefect_sgpu import distributed
from prefect_sgpu.environment import ship as environment_ship
from prefect_sgpu.compute.ec2.request import render_user_data
from prefect_sgpu.environment import capture
from prefect_sgpu.errors import ProvisioningError, SGPUConfigError
from prefect_sgpu.launch import ec2_stage, node_env, stage_uv
from support.conformance_ec2 import EC2Env

USER_MODULE = "sgpu_user_project_train"


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's project: a training module that imports a sibling package of the project."""
    root = tmp_path / "project"
    (root / "features").mkdir(parents=True)
    (root / "features" / "__init__.py").write_text("")
    (root / "features" / "encode.py").write_text(textwrap.dedent("""
        def tokenize(text):
            return [ord(c) % 7 for c in text]
    """))
    (root / f"{USER_MODULE}.py").write_text(textwrap.dedent("""
        def train(text):
            import features.encode
            import prefect_sgpu
            from prefect_sgpu import runtime

            return {"rank": runtime.rank(), "tokens": features.encode.tokenize(text),
                    "features": features.encode.__file__, "prefect_sgpu": prefect_sgpu.__file__}
    """))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, USER_MODULE, raising=False)
    monkeypatch.delitem(sys.modules, "features", raising=False)
    monkeypatch.delitem(sys.modules, "features.encode", raising=False)
    return root


def _consoles(env: EC2Env, run_id: str) -> list[str]:
    return [env.simulator.console(i["InstanceId"]) for i in env.instances(run_id)]


# --- what the driver ships and what the user-data says ------------------------------------------


def test_the_manifest_pins_index_distributions_and_ships_local_code_by_sha256(project: Path) -> None:
    env = capture(working_dir=project)
    manifest = environment_ship.manifest(env)
    assert manifest["python"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert manifest["digest"] == env.digest
    pins = {p.split("==")[0]: p.split("==")[1] for p in manifest["pins"]}
    index = {d.name: d.version for d in env.distributions if d.source == "index"}
    assert pins["torch"] == index["torch"] and pins["cloudpickle"] == index["cloudpickle"]
    assert "prefect-sgpu" not in pins and "pip" not in pins and "uv" not in pins
    trees = {t["name"]: t for t in manifest["trees"]}
    own = trees["prefect-sgpu"]  # this project travels as files, never as a name from an index
    assert own["kind"] == "path" and own["dist"][0] == "prefect-sgpu"
    assert any(path == "prefect_sgpu/launch/node_env.py" for path, _, _ in own["files"])
    work = {path: sha for path, _, sha in trees["working_dir"]["files"]}
    encode = project / "features" / "encode.py"
    assert work["features/encode.py"] == hashlib.sha256(encode.read_bytes()).hexdigest()
    # the manifest holds nothing of this machine's paths
    assert str(project) not in json.dumps(manifest)


def test_the_user_data_names_the_manifest_and_carries_the_stage(project: Path) -> None:
    env = capture(working_dir=project)
    pack = f"linux-x86_64:{'a' * 64}:{7 << 30}"  # a recorded pack of 7 GiB
    script = render_user_data("s3://bucket/jobs", "run-1", "eu-west-1", 900, environment=env, packs=[pack],
                              offer_pack=True)
    assert f"--manifest={environment_ship.manifest_sha256(env)}" in script and f"--pack={pack}" in script
    assert "-m prefect_sgpu.launch.bootstrap" in script and "pip install" not in script
    # the stage, its transport and the retry helper travel without docstrings and comments: room is left for
    # setup_commands (what is over EC2's limit fails at render time, naming them)
    assert len(script.encode()) <= 15.5 * 1024 < environment_ship.USER_DATA_LIMIT
    files = json.loads(zlib.decompress(base64.b85decode(max(script.split(), key=len).strip("'"))))
    assert files == environment_ship.stage_files("ec2_stage") and "--transport=ec2_stage" in script
    carried = files[environment_ship.STAGE_MAIN]
    assert carried == environment_ship.stage_text() and not any('"""' in text for text in files.values())
    assert "def uv(" in carried and "def main(" in carried
    assert set(files) == {environment_ship.STAGE_MAIN, "ec2_stage.py", "retry.py"}  # the transport's retry helper
    assert "AWS4-HMAC-SHA256" in files["ec2_stage.py"] and "AWS4" not in carried and "169.254" not in carried
    image = render_user_data("s3://bucket/jobs", "run-1", "eu-west-1", 900, environment=env.model_copy(
        update={"mode": "image"}))
    assert "--manifest" not in image and image.splitlines()[-1].startswith("python3 -m prefect_sgpu.launch.bootstrap")


def test_an_index_with_credentials_never_reaches_the_user_data(project: Path) -> None:
    """Planned (the credentials travel in the job's SecureString: tests/compute/test_ec2_index_credentials.py),
    masked in the manifest the user-data names; a path of this machine is still refused."""
    env = capture(working_dir=project, index_url="https://user:s3cret-tok@pypi.example.com/simple")
    script = render_user_data("s3://bucket/jobs", "run-1", "eu-west-1", 900, environment=env)
    assert "s3cret-tok" not in script and environment_ship.manifest_sha256(env) in script
    assert "s3cret-tok" not in environment_ship.manifest_bytes(env).decode()
    local = capture(find_links=[str(project)])
    with pytest.raises(SGPUConfigError, match="environment.find_links"):
        environment_ship.manifest(local)


def test_a_job_role_reads_its_own_environment_and_no_other() -> None:
    from prefect_sgpu.compute.ec2 import roles

    digest, packages = "ab" * 32, "cd" * 32
    policy = roles.node_policy("train-1", "eu-west-1", "210987654321", ["s3://b/jobs/train-1"], "0123456789abcdef",
                               environment_uri=f"s3://b/jobs/{environment_ship.STORE_FOLDER}/{digest}",
                               packages_uri=f"s3://b/jobs/{environment_ship.STORE_FOLDER}/packages-{packages}")
    own = [s for s in policy["Statement"] if s["Sid"].startswith("OwnEnvironment")]
    assert own == [{"Sid": "OwnEnvironment", "Effect": "Allow", "Action": "s3:GetObject",
                    "Resource": f"arn:aws:s3:::b/jobs/.environments/{digest}/*"},
                   {"Sid": "OwnEnvironmentPacks", "Effect": "Allow",  # the packs of its packages: read, and offer one
                    "Action": ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"],
                    "Resource": f"arn:aws:s3:::b/jobs/.environments/packages-{packages}/*"}]
    without = roles.node_policy("train-1", "eu-west-1", "210987654321", ["s3://b/jobs/train-1"], "0123456789abcdef")
    assert not [s for s in without["Statement"] if s["Sid"].startswith("OwnEnvironment")], "no environment, no access"


@pytest.mark.parametrize("path", ["../escape.py", "/etc/passwd", "a//b", "./a", "a/../../b", ""])
def test_the_stage_refuses_a_path_that_leaves_its_folder(path: str) -> None:
    with pytest.raises(node_env.SetupError, match="is not allowed"):
        node_env.safe_relative(path)


def test_the_stage_refuses_a_manifest_the_user_data_does_not_name() -> None:
    raw = json.dumps({"format": 1, "digest": "0" * 64, "trees": []}).encode()
    with pytest.raises(node_env.SetupError, match="the user-data names"):
        node_env.check_manifest(raw, hashlib.sha256(b"another").hexdigest())
    assert node_env.check_manifest(raw, hashlib.sha256(raw).hexdigest())["digest"] == "0" * 64


def _with_own_files(env: Any, tmp_path: Path, *modules: str) -> Any:
    """``env`` with prefect-sgpu's own files reduced to ``modules`` (of ``prefect_sgpu/launch/``): what
    the stage loads from the environment (its uv fetcher, the pack code)."""
    import shutil

    from prefect_sgpu.environment import Distribution
    from prefect_sgpu.environment.files import scan

    own = tmp_path / "prefect-sgpu-source"
    (own / "prefect_sgpu" / "launch").mkdir(parents=True, exist_ok=True)
    for module in modules:
        shutil.copy(module, own / "prefect_sgpu" / "launch" / Path(module).name)
    return env.model_copy(update={
        "distributions": (*env.distributions, Distribution(name="prefect-sgpu", version="0.0.0", source="editable")),
        "local_packages": (scan("prefect-sgpu", own, "environment.local_packages"),)})


def _store_and_small_environment(aws_env: Any, project: Path) -> tuple[str, Any, Any]:
    """A new bucket, its store on moto, and an environment of one pinned distribution and the project."""
    import uuid
    from importlib import metadata

    from prefect_sgpu.environment import Distribution, Environment, PythonVersion
    from prefect_sgpu.environment.files import scan
    from prefect_sgpu.store.s3 import S3Store

    bucket = f"sgpu-env-{uuid.uuid4().hex[:12]}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    store = S3Store(f"s3://{bucket}/jobs", session=aws_env.session(), endpoint_url=aws_env.endpoint_url)
    env = Environment(python=PythonVersion.here(),
                      distributions=(Distribution(name="six", version=metadata.version("six")),),
                      working_dir=scan("working_dir", project, "environment.working_dir"))
    return bucket, store, env


# --- the node stage against the store (moto's S3), with real uv installing offline ---------------


def test_a_second_boot_installs_nothing_a_new_requirement_builds_a_new_venv_and_a_changed_file_is_refused(
        aws_env: Any, project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    from importlib import metadata

    from prefect_sgpu.environment import Environment
    from support.ec2_simulator import bare_image
    from support.wheel_index import uv_index

    bucket, store, env = _store_and_small_environment(aws_env, project)
    assert environment_ship.ship(store, env)["uploaded"] == 3
    assert environment_ship.ship(store, env)["uploaded"] == 0, "shipped content is not uploaded again"

    # a bare node: the image's Python (no uv: the stage fetches its pinned wheel), packages offline from uv's cache
    monkeypatch.setenv("PATH", f"{bare_image() / 'bin'}:/usr/bin:/bin")
    monkeypatch.setenv(node_env.UV_INDEX_ENV, uv_index().url)
    monkeypatch.setenv("UV_OFFLINE", "1")
    monkeypatch.setenv("UV_CACHE_DIR", str(Path.home() / ".cache" / "uv"))
    monkeypatch.setenv("UV_PYTHON_DOWNLOADS", "never")
    monkeypatch.setenv(node_env.ENV_ROOT_ENV, str(tmp_path / "envs"))
    s3 = ec2_stage.S3StageTransport(f"s3://{bucket}/jobs", aws_env.region, aws_env.endpoint_url)
    s3.put("run-1/setup/i-1.log", b"what the stage said")  # signed by the stage, read by the driver
    assert store.get("run-1", "setup/i-1.log") == b"what the stage said"

    def boot(environment: Environment) -> tuple[Path, bool]:
        sha = environment_ship.manifest_sha256(environment)
        base = f".environments/{environment.digest}"
        manifest = node_env.check_manifest(s3.get(f"{base}/manifest-{sha}.json"), sha)
        venv, how = node_env.ensure(manifest, s3, f"{base}/files")
        return venv, how == "built"

    def imports(venv: Path, code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin"})

    venv, built = boot(env)
    assert built and venv.name.startswith(env.digest)
    done = imports(venv, "import six, features.encode; print(six.__version__, features.encode.tokenize('ab'))")
    assert done.stdout.split() == [metadata.version("six"), "[6,", "0]"], done.stderr
    assert "No module named 'torch'" in imports(venv, "import torch").stderr, "not the driver's venv"
    marker = (venv / node_env.COMPLETE).stat()

    again, built = boot(env)  # a second boot of the same environment: nothing installed
    assert (again, built) == (venv, False) and (venv / node_env.COMPLETE).stat().st_mtime_ns == marker.st_mtime_ns

    changed = env.model_copy(update={"requirements": (f"idna=={metadata.version('idna')}",)})
    environment_ship.ship(store, changed)
    other, built = boot(changed)
    assert built and other != venv
    assert imports(other, "import idna").returncode == 0 and imports(venv, "import idna").returncode != 0

    # whoever writes the store cannot change a shipped file: a fresh node checks every sha256
    encode = next(f for f in env.working_dir.files if f.path == "features/encode.py")
    store.put(environment_ship.STORE_FOLDER, f"{env.digest}/files/{encode.sha256}", b"def tokenize(text): 'evil'")
    monkeypatch.setenv(node_env.ENV_ROOT_ENV, str(tmp_path / "fresh-node"))
    with pytest.raises(node_env.SetupError, match="does not match its sha256"):
        boot(env)


def test_the_first_build_is_packed_into_the_store_and_a_fresh_node_unpacks_it_installing_nothing(
        aws_env: Any, project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0 of the first job builds cold and packs the venv into the store (a multipart upload); the
    driver records the offer; a node with an empty uv cache, offline, under another root, unpacks it.
    A forged offer or record is refused, and a pack whose bytes changed is passed over: that node builds."""
    import subprocess
    from importlib import metadata

    from prefect_sgpu.protocol.jobfolder import new_key, seal
    from support.ec2_simulator import bare_image
    from support.wheel_index import uv_index

    import shutil

    from prefect_sgpu.environment import Distribution
    from prefect_sgpu.environment.files import scan
    from prefect_sgpu.launch import node_pack

    bucket, store, env = _store_and_small_environment(aws_env, project)
    # the pack code reaches the node as a file of the environment's own prefect-sgpu (here only that file)
    own = tmp_path / "prefect-sgpu-source"
    (own / "prefect_sgpu" / "launch").mkdir(parents=True)
    shutil.copy(node_pack.__file__, own / "prefect_sgpu" / "launch" / "node_pack.py")
    env = env.model_copy(update={  # numpy: a pack of several 5 MiB parts
        "distributions": (*env.distributions, Distribution(name="numpy", version=metadata.version("numpy")),
                          Distribution(name="prefect-sgpu", version="0.0.0", source="editable")),
        "local_packages": (scan("prefect-sgpu", own, "environment.local_packages"),)})
    environment_ship.ship(store, env)
    monkeypatch.setenv("SGPU_CHECKPOINT_SECRET", new_key())  # the driver's secret, which seals pack records
    monkeypatch.setenv("PATH", f"{bare_image() / 'bin'}:/usr/bin:/bin")
    monkeypatch.setenv(node_env.UV_INDEX_ENV, uv_index().url)
    monkeypatch.setenv("UV_OFFLINE", "1")
    monkeypatch.setenv("UV_CACHE_DIR", str(Path.home() / ".cache" / "uv"))
    monkeypatch.setenv("UV_PYTHON_DOWNLOADS", "never")
    monkeypatch.setattr(node_pack, "part_size", lambda size: 5 << 20)  # S3's smallest part: a multipart upload
    s3 = ec2_stage.S3StageTransport(f"s3://{bucket}/jobs", aws_env.region, aws_env.endpoint_url)
    sha = environment_ship.manifest_sha256(env)
    base = f".environments/{env.digest}"
    manifest = node_env.check_manifest(s3.get(f"{base}/manifest-{sha}.json"), sha)
    job_key = new_key()
    packages = node_env.packages_digest(manifest)
    folder = environment_ship.packages_folder(env)
    assert folder == f"packages-{packages}"
    packs_key = f".environments/{folder}"

    def boot(root: str, packs: list[str], offer_as: str | None = None, manifest: dict = manifest) -> tuple[Path, str]:
        monkeypatch.setenv(node_env.ENV_ROOT_ENV, str(tmp_path / root))
        offer_to = None
        if offer_as:
            offer_to = lambda venv, packing: packing.offer(  # noqa: E731
                s3, packs_key, f"run-1/setup/pack-{offer_as}.json", venv, manifest, packages,
                node_env.platform_key(), lambda: job_key, "run-1", offer_as)
        files = f".environments/{manifest['digest']}/files"
        return node_env.ensure(manifest, s3, files, packs=node_env.parse_packs(packs), offer_to=offer_to,
                               packs_key=packs_key)

    def runs(venv: Path) -> str:
        done = subprocess.run([str(venv / "bin" / "python"), "-c", "import six, features.encode; "
                               "print(six.__version__, features.encode.tokenize('ab'))"],
                              capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    first, how = boot("node-a", [], offer_as="i-a")
    assert how == "built"
    packs = [n for n in store.list(environment_ship.STORE_FOLDER, folder)]
    assert len(packs) == 1 and packs[0].endswith(".tar")
    tar_key = f"jobs/{packs_key}/{packs[0].rsplit('/', 1)[-1]}"
    size = aws_env.client("s3").head_object(Bucket=bucket, Key=tar_key)
    assert size["ContentLength"] > 5 << 20 and "-" in size["ETag"], "one object from a multipart upload"

    # the driver, before any rank runs: an offer sealed with another key, or for another machine, is refused
    forged = seal(new_key(), "envpack", "run-1", store.get("run-1", "setup/pack-i-a.json")[-400:], instance_id="i-x")
    store.put("run-1", "setup/pack-i-x.json", forged)
    assert environment_ship.take_offers(store, env, "run-1", job_key, ["i-x"]) == []
    recorded = environment_ship.take_offers(store, env, "run-1", job_key, ["i-a", "i-x"])
    assert recorded == environment_ship.recorded_packs(store, env)
    assert recorded == [f"{node_env.platform_key()}:{packs[0].rsplit('/', 1)[-1][:-4]}:{size['ContentLength']}"]

    # a fresh node under another root, with an empty uv cache and offline: it can only unpack
    empty = tmp_path / "empty-uv-cache"
    empty.mkdir()
    monkeypatch.setenv("UV_CACHE_DIR", str(empty))
    second, how = boot("node-b", recorded)
    assert how == "unpacked" and second.parent != first.parent
    assert runs(second) == runs(first) == f"{metadata.version('six')} [6, 0]"
    assert list(empty.iterdir()) == [], "uv never ran"
    assert boot("node-b", recorded) == (second, "reused")

    # the project changes (a new environment digest, the same packages): the pack still serves it
    (project / "features" / "encode.py").write_text("def tokenize(text):\n    return [len(text)]\n")
    changed = env.model_copy(update={"working_dir": scan("working_dir", project, "environment.working_dir")})
    assert changed.digest != env.digest and environment_ship.packages_folder(changed) == folder
    environment_ship.ship(store, changed)
    assert environment_ship.recorded_packs(store, changed) == recorded
    changed_sha = environment_ship.manifest_sha256(changed)
    changed_manifest = node_env.check_manifest(
        s3.get(f".environments/{changed.digest}/manifest-{changed_sha}.json"), changed_sha)
    fourth, how = boot("node-b", recorded, manifest=changed_manifest)
    assert how == "unpacked" and fourth != second and runs(fourth) == f"{metadata.version('six')} [2]"
    assert list(empty.iterdir()) == [], "uv never ran"

    # the next launch's user-data names the recorded pack (and asks node 0 to offer one where none fits)
    from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute

    settings = {"region": aws_env.region, "store_uri": f"s3://{bucket}/jobs", "endpoint_url": aws_env.endpoint_url}
    script = EC2InstanceCompute.from_settings(settings, session=aws_env.session()).user_data("run-2", environment=env)
    assert f"--pack={recorded[0]}" in script and "--offer-pack" in script
    script = EC2InstanceCompute.from_settings({**settings, "pack_environments": False}, session=aws_env.session()
                                              ).user_data("run-2", environment=env)
    assert "--pack" not in script and "--offer-pack" not in script

    # a record sealed without the driver's secret is not used
    record = f"{folder}/{node_env.platform_key()}.json"
    good = store.get(environment_ship.STORE_FOLDER, record)
    store.put(environment_ship.STORE_FOLDER, record, seal(new_key(), "envpack", env.digest, good[-300:]))
    assert environment_ship.recorded_packs(store, env) == []
    store.put(environment_ship.STORE_FOLDER, record, good)

    # whoever writes the store changes the pack's bytes: the node checks its sha256, passes it over and builds
    aws_env.client("s3").put_object(Bucket=bucket, Key=tar_key, Body=b"not the pack")
    monkeypatch.setenv("UV_CACHE_DIR", str(Path.home() / ".cache" / "uv"))
    third, how = boot("node-c", [f"{recorded[0].rsplit(':', 1)[0]}:12"])
    assert how == "built" and runs(third) == runs(first)


@pytest.mark.parametrize("name,link", [("venv/../../escape", None), ("venv/lib/evil", "/etc"),
                                       ("venv/lib/up", "../../../etc"), ("python/../x", None), ("etc/x", None)])
def test_the_stage_refuses_a_pack_entry_that_leaves_its_folder(tmp_path: Path, name: str, link: str | None) -> None:
    import io
    import tarfile

    from prefect_sgpu.launch import node_pack

    archive = tmp_path / "pack.tar"
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo(name)
        if link:
            info.type, info.linkname = tarfile.SYMTYPE, link
            tar.addfile(info)
        else:
            info.size = 4
            tar.addfile(info, io.BytesIO(b"evil"))
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(node_pack.PackError, match="is not allowed|neither under|links to"):
        node_pack.unpack(archive, root, root / "venv-x", "3.11")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["pack.tar", "root"], "nothing unpacked anywhere"


def _other_minor_python() -> str | None:
    """A CPython of another minor version on this machine (the image's Python of a bare node)."""
    import shutil
    import subprocess

    for minor in (10, 12, 9, 13):
        if minor == sys.version_info.minor:
            continue
        pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
        for found in [*map(str, sorted(pyenv.glob(f"3.{minor}.*/bin/python3"))), shutil.which(f"python3.{minor}")]:
            if found and subprocess.run([found, "-c", "import venv, ensurepip"], capture_output=True).returncode == 0:
                return found
    return None


def test_an_image_of_another_python_runs_the_stage_and_gets_a_venv_of_the_drivers_python(
        aws_env: Any, project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage runs on the image's own Python; uv gives the venv the driver's minor version (here
    found on the machine, offline; on AWS uv downloads it)."""
    import subprocess
    from importlib import metadata

    from support.ec2_simulator import bare_image
    from support.wheel_index import uv_index

    other = _other_minor_python()
    if other is None:
        pytest.skip("no CPython of another minor version on this machine")
    image = bare_image(other)
    bucket, store, env = _store_and_small_environment(aws_env, project)
    env = _with_own_files(env, tmp_path, stage_uv.__file__)  # the stage loads its uv fetcher from them
    environment_ship.ship(store, env)
    for name, text in environment_ship.stage_files("ec2_stage").items():  # as the user-data carries them
        (tmp_path / name).write_text(text)
    stage = tmp_path / environment_ship.STAGE_MAIN
    node = {"PATH": f"{image / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "UV_OFFLINE": "1",
            "UV_CACHE_DIR": str(Path.home() / ".cache" / "uv"), node_env.ENV_ROOT_ENV: str(tmp_path / "envs"),
            node_env.UV_INDEX_ENV: uv_index().url,  # the image has no uv: the stage fetches the pinned one
            **{k: v for k, v in aws_env.env.items() if k.startswith("AWS_")}}
    done = subprocess.run(
        [str(image / "bin" / "python3"), str(stage), f"--store=s3://{bucket}/jobs", "--run-id=r1",
         f"--region={aws_env.region}", f"--endpoint-url={aws_env.endpoint_url}", f"--environment={env.digest}",
         f"--manifest={environment_ship.manifest_sha256(env)}", "--",
         "-c", "import sys, six, features.encode; print('%d.%d' % sys.version_info[:2], six.__version__)"],
        capture_output=True, text=True, env=node, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "built environment" in done.stdout and f"fetched uv {stage_uv.UV_VERSION}" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == f"{env.python.minor} {metadata.version('six')}", done.stdout


# --- bare nodes, end to end ----------------------------------------------------------------------


@pytest.mark.e2e
def test_bare_nodes_build_the_driver_environment_once_and_run_the_users_project(
        bare: EC2Env, project: Path) -> None:
    import importlib

    train = importlib.import_module(USER_MODULE).train
    compute = bare.compute(agent_timeout_s=600.0)
    env_root = bare.simulator.env_root

    def job(**environment: Any) -> Any:
        fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=compute, mlflow=False, timeout=600,
                         environment={"working_dir": str(project), **environment})(train)
        return fn.job("hello")

    first = job()
    result = first.run()
    assert [v["rank"] for v in result.values] == [0, 1]
    assert all(v["tokens"] == [ord(c) % 7 for c in "hello"] for v in result.values)
    for value in result.values:  # the user's code and this project came from the store, not this checkout
        assert Path(value["features"]).is_relative_to(env_root), value
        assert Path(value["prefect_sgpu"]).is_relative_to(env_root), value
    digest = first.spec.environment.digest
    venvs = sorted(p.name for p in env_root.iterdir() if (p / ".complete").exists())
    assert venvs == [f"{digest}-{sys.platform}-{__import__('platform').machine()}"]
    consoles = _consoles(bare, first.run_id)
    assert sum("built environment" in c for c in consoles) == 1, consoles  # the other node waited, then reused
    assert sum(f"fetched uv {stage_uv.UV_VERSION}" in c for c in consoles) == 1, consoles  # the image has none
    assert sum("reused environment" in c for c in consoles) == 1, consoles

    second = job()
    assert second.run().values == result.values
    consoles = _consoles(bare, second.run_id)
    assert all("reused environment" in c for c in consoles), consoles
    assert not any("installing" in c or "creating the venv" in c for c in consoles), consoles



@pytest.mark.e2e
def test_a_failing_environment_build_ends_the_job_with_its_output_not_at_the_timeout(
        bare: EC2Env, project: Path) -> None:
    import importlib

    train = importlib.import_module(USER_MODULE).train
    fn = distributed(gpus=2, gpu_type="A10", remote=True, mlflow=False, timeout=900,
                     compute=bare.compute(agent_timeout_s=900.0),
                     environment={"working_dir": str(project), "requirements": ["sgpu-no-such-package==1.0"]})(train)
    job = fn.job("x")
    with pytest.raises(ProvisioningError, match="went away while booting") as info:
        job.run()
    text = str(info.value)
    assert "environment setup said" in text and "installing the extra requirements" in text, text
    assert "sgpu-no-such-package" in text, text
    for inst in bare.instances(job.run_id):
        assert bare.simulator.shutdowns(inst["InstanceId"]), "the user-data powered the instance off"
    assert bare.leftovers(job.run_id) == []


@pytest.fixture
def sibling_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's project run from its own folder: ``user_train.py`` imports a package ``mylib`` beside it at
    its top, so a rank needs ``mylib`` while it loads the payload, before the function runs."""
    root = tmp_path / "sibling-project"
    (root / "sgpu_sib_mylib").mkdir(parents=True)
    (root / "sgpu_sib_mylib" / "__init__.py").write_text("from .ops import double\n")
    (root / "sgpu_sib_mylib" / "ops.py").write_text("def double(x):\n    return 2 * x\n")
    (root / "sgpu_sib_user_train.py").write_text(textwrap.dedent("""
        import sgpu_sib_mylib

        def train(x):
            from prefect_sgpu import runtime

            return {"rank": runtime.rank(), "value": sgpu_sib_mylib.double(x), "mylib": sgpu_sib_mylib.__file__}
    """))
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root))
    for name in ("sgpu_sib_user_train", "sgpu_sib_mylib", "sgpu_sib_mylib.ops"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return root


@pytest.mark.e2e
@pytest.mark.own_modules
def test_a_sibling_package_of_the_users_project_reaches_bare_nodes_without_naming_it(
        bare: EC2Env, sibling_project: Path) -> None:
    import importlib

    from prefect_sgpu.errors import PayloadImportError

    train = importlib.import_module("sgpu_sib_user_train").train
    compute = bare.compute(agent_timeout_s=600.0)
    compute.sgpu_environment = None  # as for a user: no environment= anywhere
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=compute, mlflow=False, timeout=600)(train)
    job = fn.job(21)
    shipped = {t.name for t in job.spec.environment.py_modules}
    assert {"sgpu_sib_mylib", "sgpu_sib_user_train"} <= shipped, shipped
    result = job.run()
    assert [v["rank"] for v in result.values] == [0, 1]
    assert [v["value"] for v in result.values] == [42, 42]
    for value in result.values:  # laid out from the store on the node, not read from this folder
        assert Path(value["mylib"]).is_relative_to(bare.simulator.env_root), value
    assert bare.leftovers(job.run_id) == []

    # the same nodes' environment without the user's modules: the ranks name what is missing and where it is
    off = distributed(gpus=2, gpu_type="A10", remote=True, compute=compute, mlflow=False, timeout=600,
                      environment={"auto_modules": False})(train).job(21)
    with pytest.raises(PayloadImportError) as info:
        off.run()
    text = str(info.value)
    assert "sgpu_sib_mylib" in text and str(sibling_project / "sgpu_sib_mylib") in text, text
    assert "auto_modules" in text and "py_modules" in text, text
    assert bare.leftovers(off.run_id) == []
