"""Index URLs with credentials on bare EC2 nodes: delivered as ``secrets=`` are, shown nowhere.

The manifest (and so the store, the user-data and the environment's digest) holds the index
settings masked; the real URLs travel in the job's SSM SecureString
(``/prefect-sgpu/<store scope>/<run id>/secrets``), which the node's environment stage reads with its own
Signature V4 and hands to uv only through uv's environment. The end-to-end test points an extra
index at a server on 127.0.0.1 that answers only with the right Basic credentials
(:mod:`support.auth_index`) and holds one wheel built here, which the job's ranks import.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from prefect_sgpu import distributed
from prefect_sgpu.environment import ship as environment_ship
from prefect_sgpu.compute.ec2.request import render_user_data
from prefect_sgpu.environment import capture
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.protocol.jobfolder import ssm_secrets_parameter
from prefect_sgpu.launch import node_env
from support.auth_index import AuthIndex, build_wheel
from support.conformance_ec2 import EC2Env

USER_MODULE = "sgpu_index_user_train"
TOKEN_ENV = "SGPU_TEST_INDEX_TOKEN"


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's project whose training function imports a package only the private index has."""
    root = tmp_path / "project"
    root.mkdir()
    (root / f"{USER_MODULE}.py").write_text(textwrap.dedent("""
        def train():
            import os

            import sgpu_index_demo
            from prefect_sgpu import runtime

            return {"rank": runtime.rank(), "value": sgpu_index_demo.VALUE, "file": sgpu_index_demo.__file__,
                    "index_env": sorted(k for k in os.environ if "INDEX" in k)}
    """))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, USER_MODULE, raising=False)
    return root


# --- what the driver writes ---------------------------------------------------------------------


def test_a_credentialed_index_is_masked_in_the_manifest_and_revealed_only_for_the_secret(project: Path) -> None:
    token = "s3cret-index-token-123"
    env = capture(working_dir=project, index_url=f"https://user:{token}@pypi.example.com/simple",
                  extra_index_urls=["https://extra.example.com/simple?key=q-" + token])
    script = render_user_data("s3://bucket/jobs", "run-1", "eu-west-1", 900, environment=env)
    raw = environment_ship.manifest_bytes(env)
    assert token not in script and token not in raw.decode() and token not in repr(env.describe())
    index = json.loads(raw)["index"]
    assert index == {"index_url": "https://***@pypi.example.com/simple",
                     "extra_index_urls": ["https://extra.example.com/simple?***"], "find_links": [],
                     "credentials": True}
    secret = environment_ship.index_secret(env)
    assert list(secret) == [environment_ship.INDEX_SECRET]
    assert json.loads(secret[environment_ship.INDEX_SECRET]) == {
        "index_url": f"https://user:{token}@pypi.example.com/simple",
        "extra_index_urls": [f"https://extra.example.com/simple?key=q-{token}"], "find_links": []}
    plain = capture(working_dir=project, index_url="https://pypi.example.com/simple")
    assert environment_ship.index_secret(plain) == {} and "credentials" not in environment_ship.manifest(plain)["index"]
    # nodes cannot reach this machine's paths, credentials or not
    local = capture(find_links=[str(project)])
    with pytest.raises(SGPUConfigError, match="environment.find_links"):
        environment_ship.manifest(local)
    with pytest.raises(SGPUConfigError, match="environment.index_url"):
        environment_ship.manifest(capture(index_url="file:///srv/wheels"))


def test_a_rotated_token_keeps_the_digest_and_a_missing_variable_fails_naming_it(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"https://bob:${{{TOKEN_ENV}}}@pypi.example.com/simple"
    monkeypatch.setenv(TOKEN_ENV, "first-token-aaaa")
    env = capture(working_dir=project, index_url=url)
    first = json.loads(environment_ship.index_secret(env)[environment_ship.INDEX_SECRET])
    monkeypatch.setenv(TOKEN_ENV, "second-token-bbbb")
    again = capture(working_dir=project, index_url=url)
    assert again.digest == env.digest and environment_ship.manifest_bytes(again) == environment_ship.manifest_bytes(env)
    assert first["index_url"] == "https://bob:first-token-aaaa@pypi.example.com/simple"
    assert "second-token-bbbb" in environment_ship.index_secret(again)[environment_ship.INDEX_SECRET]
    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(SGPUConfigError, match=TOKEN_ENV) as info:
        environment_ship.index_secret(again)
    assert "token" not in str(info.value).replace(TOKEN_ENV, "")


# --- what the node does with them ---------------------------------------------------------------


def test_the_stage_reads_the_real_urls_from_the_secret_and_masks_them_in_all_it_prints(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_env, "_MASKS", [])
    real = {"index_url": "https://bob:tok-9f8e7d6c@pypi.example.com/simple",
            "extra_index_urls": ["https://x.example.com/simple?key=k-5a4b3c2d"], "find_links": []}
    manifest = {"index": {"index_url": "https://***@pypi.example.com/simple",
                          "extra_index_urls": ["https://x.example.com/simple?***"], "find_links": [],
                          "credentials": True}}
    secret = json.dumps({environment_ship.INDEX_SECRET: json.dumps(real), "MY_TOKEN": "other"})
    assert node_env.revealed_index(manifest, lambda: secret) == real
    assert node_env.index_env(real) == {"UV_INDEX_URL": real["index_url"],
                                        "UV_EXTRA_INDEX_URL": real["extra_index_urls"][0]}
    # the credentials reach the child's environment, not its command line, and never its printed output
    with pytest.raises(node_env.SetupError) as info:
        node_env.run("installing", [sys.executable, "-c", "import os, sys; print(os.environ['UV_INDEX_URL']); "
                                    "print('token tok-9f8e7d6c and k-5a4b3c2d'); sys.exit(1)"],
                     node_env.index_env(real))
    out = capsys.readouterr().out + str(info.value)
    assert "tok-9f8e7d6c" not in out and "k-5a4b3c2d" not in out, out
    assert "https://***@pypi.example.com/simple" in out and "token *** and ***" in out, out
    # no credentials in the manifest: the SecureString is never read
    assert node_env.revealed_index({"index": {"index_url": None}}, lambda: pytest.fail("read")) is None
    with pytest.raises(node_env.SetupError, match="index credentials"):
        node_env.revealed_index(manifest, lambda: json.dumps({"MY_TOKEN": "x"}))


# --- end to end ---------------------------------------------------------------------------------


def _scan(bare: EC2Env, run_id: str, seen: dict[str, str]) -> dict[str, str]:
    """Every place the job wrote that is not its SecureString: store objects, SSM parameters, user-data, tags,
    consoles."""
    places = dict(seen)
    ec2 = bare.aws.client("ec2")
    for inst in bare.instances(run_id):
        data = ec2.describe_instance_attribute(InstanceId=inst["InstanceId"], Attribute="userData")["UserData"]
        places[f"user-data {inst['InstanceId']}"] = base64.b64decode(data.get("Value", "")).decode()
        places[f"tags {inst['InstanceId']}"] = json.dumps(inst.get("Tags", []))
        places[f"console {inst['InstanceId']}"] = bare.simulator.console(inst["InstanceId"])
    return places


@pytest.mark.e2e
@pytest.mark.parametrize("keep_warm", [0.0, 60.0], ids=["cold", "warm-lease"])
def test_a_job_installs_from_an_index_that_needs_its_token_and_the_token_shows_nowhere(
        bare: EC2Env, project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str], keep_warm: float) -> None:
    """Cold: the job's machines read the job's SecureString at boot. A warm lease's machines boot for
    the lease (its own SecureString, deleted when the lease ends) and serve the job after."""
    import importlib

    from prefect_sgpu.compute.remote.lease import lease_id

    token = "idx-tok-" + base64.b32encode(os.urandom(10)).decode().lower()
    monkeypatch.setenv(TOKEN_ENV, token)
    wheel = build_wheel(tmp_path, "sgpu-index-demo", "0.1", "VALUE = 4217\n")
    # this image is online (the other bare-node tests install offline from uv's cache): the private
    # index is a server, and uv checks the pins' pages on the default index (this machine's CA bundle)
    bare.simulator.env_overrides = {"UV_OFFLINE": None, **{name: os.environ[name] for name in
                                                           ("SSL_CERT_FILE", "SSL_CERT_DIR") if name in os.environ}}
    train = importlib.import_module(USER_MODULE).train
    seen: dict[str, str] = {}
    parameters: dict[str, str] = {}
    done = threading.Event()

    def watch() -> None:  # what the store and SSM hold while the job runs (release deletes them)
        s3, ssm = bare.aws.client("s3"), bare.aws.client("ssm")
        while not done.is_set():
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bare.bucket):
                for obj in page.get("Contents", []):
                    try:
                        body = s3.get_object(Bucket=bare.bucket, Key=obj["Key"])["Body"].read()
                    except s3.exceptions.NoSuchKey:
                        continue
                    seen[f"s3://{bare.bucket}/{obj['Key']}"] = body.decode("utf-8", "replace")
            for page in ssm.get_paginator("describe_parameters").paginate():
                for meta in page.get("Parameters", []):
                    try:
                        value = ssm.get_parameter(Name=meta["Name"], WithDecryption=True)["Parameter"]["Value"]
                    except ssm.exceptions.ParameterNotFound:
                        continue
                    parameters[meta["Name"]] = value
            time.sleep(0.3)

    with AuthIndex([wheel], "bob", token) as index:
        compute = bare.compute(agent_timeout_s=600.0, keep_warm=keep_warm)
        fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=compute,
                         mlflow=False, timeout=600,
                         environment={"working_dir": str(project), "requirements": ["sgpu-index-demo==0.1"],
                                      "extra_index_urls": [index.url(f"bob:${{{TOKEN_ENV}}}")],
                                      "allow_http_index": True})(train)
        job = fn.job()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            result = job.run()
            compute.close()  # a warm lease ends with its compute
        finally:
            done.set()
            watcher.join(timeout=60)
    launch = lease_id(job.run_id) if keep_warm else job.run_id  # what the machines were launched for
    assert [v["rank"] for v in result.values] == [0, 1]
    assert all(v["value"] == 4217 for v in result.values), result.values
    assert all(v["index_env"] == [] for v in result.values), result.values  # the stage's, not the ranks'
    assert all(Path(v["file"]).is_relative_to(bare.simulator.env_root) for v in result.values), result.values
    assert any(p.startswith("/files/sgpu_index_demo") for p in index.authorized), index.authorized
    scope = bare.store().scope
    own = {ssm_secrets_parameter(job.run_id, scope), ssm_secrets_parameter(launch, scope)}
    assert token in parameters.get(ssm_secrets_parameter(launch, scope), ""), sorted(parameters)  # what the nodes read
    places = _scan(bare, launch, seen)
    places.update({f"ssm {name}": value for name, value in parameters.items() if name not in own})
    out = capfd.readouterr()
    places["driver output"] = out.out + out.err
    assert any("installing the extra requirements" in v for k, v in places.items() if k.startswith("console"))
    manifests = [v for k, v in places.items() if "/manifest-" in k]
    assert manifests and all('"credentials":true' in m and "${" + TOKEN_ENV + "}" in m for m in manifests)
    leaked = sorted(k for k, v in places.items() if token in v)
    assert leaked == [], leaked
    assert bare.leftovers(job.run_id) == [] and bare.leftovers(launch) == []
    left = [p["Name"] for page in bare.aws.client("ssm").get_paginator("describe_parameters").paginate()
            for p in page.get("Parameters", []) if p["Name"] in own]
    assert left == [], left
