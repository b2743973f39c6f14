"""``secrets=`` of an EC2 job travel as one SSM SecureString: a mapping SSM refuses fails before spending.

SSM's standard tier holds at most 4096 bytes per value. The nodes read the JSON of every
``secrets=`` name and value from one parameter, written only once the instances run; a
mapping over the limit used to fail there, after the instances were paid for.
"""

from __future__ import annotations

import json

import pytest
from support.conformance_ec2 import EC2Env

from prefect_sgpu import distributed
from prefect_sgpu.errors import SGPUConfigError

LIMIT = 4096


def _never_runs() -> int:
    return 0


def test_the_limit_counts_the_json_the_nodes_read_byte_for_byte(ec2: EC2Env) -> None:
    compute = ec2.compute()
    overhead = len(json.dumps({"A": ""}))
    compute.check_secrets({"A": "x" * (LIMIT - overhead)})  # exactly 4096 bytes
    with pytest.raises(SGPUConfigError, match=r"secrets='4097 bytes.*at most 4096 bytes"):
        compute.check_secrets({"A": "x" * (LIMIT - overhead + 1)})
    # a non-ASCII character is 6 bytes of JSON (\u00e9), not 1 character; each size counts its quotes
    with pytest.raises(SGPUConfigError, match=r"4107 bytes.*A: 4100"):
        compute.check_secrets({"A": "é" * 683})


@pytest.mark.usefixtures("prefect_server")
def test_secrets_over_ssms_limit_fail_before_any_instance_is_launched(ec2: EC2Env) -> None:
    from prefect.blocks.system import Secret

    # 4070 bytes of JSON: under the limit alone, over it with the checkpoint key that travels beside them
    Secret(value="s3cr3t-" * 555).save("sgpu-big-cert", overwrite=True)
    Secret(value="tok-" * 40).save("sgpu-small-token", overwrite=True)
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(), mlflow=False, timeout=300,
                     secrets={"CERT": "sgpu-big-cert", "TOKEN": "sgpu-small-token"})(_never_runs)
    job = fn.job()
    # what travels in the same parameter is counted too: the checkpoint location's key
    with pytest.raises(SGPUConfigError, match=r"secrets=.*CERT: 3887, SGPU_CHECKPOINT_FOLDERS_KEY: \d+, "
                                              r"SGPU_CHECKPOINT_KEY: \d+, TOKEN: 162.*"
                                              r"at most 4096 bytes") as err:
        job.run()
    assert "s3cr3t" not in str(err.value) and "tok-" not in str(err.value), "a secret value in the message"
    assert ec2.proxy is not None and ec2.proxy.calls("RunInstances") == []
    assert ec2.instances(job.run_id) == [] and ec2.objects(job.run_id) == {}


@pytest.mark.usefixtures("prefect_server")
def test_index_credentials_count_with_secrets_and_fail_before_any_instance_is_launched(
        ec2: EC2Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The index credentials of an environment built on the nodes travel in the same parameter."""
    from prefect.blocks.system import Secret

    Secret(value="s3cr3t-" * 300).save("sgpu-mid-cert", overwrite=True)  # 2100 bytes: fine alone
    token = "idx-" * 500  # 2000 bytes: fine alone
    monkeypatch.setenv("SGPU_TEST_BIG_INDEX_TOKEN", token)
    fn = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(), mlflow=False, timeout=300,
                     secrets={"CERT": "sgpu-mid-cert"},
                     environment={"mode": "driver", "extra_index_urls": [
                         "https://bob:${SGPU_TEST_BIG_INDEX_TOKEN}@pypi.example.com/simple"]})(_never_runs)
    job = fn.job()
    with pytest.raises(SGPUConfigError, match=r"secrets=.*\d+ bytes.*CERT: 2102, PREFECT_SGPU_INDEX_URLS: \d+.*"
                                              r"index URLs with their credentials.*at most 4096 bytes") as err:
        job.run()
    assert "s3cr3t" not in str(err.value) and "idx-idx" not in str(err.value), "a secret value in the message"
    assert ec2.proxy is not None and ec2.proxy.calls("RunInstances") == []
    assert ec2.instances(job.run_id) == [] and ec2.objects(job.run_id) == {}
