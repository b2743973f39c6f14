"""Blocks pass Prefect's own conformance suite, register through the CLI and round-trip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.testing.standard_test_suites import BlockStandardTestSuite

from prefect_sgpu.blocks import EC2Compute, LocalCompute, RayCompute, SGPUStore
from prefect_sgpu.errors import SGPUConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("block_class", [LocalCompute, EC2Compute, RayCompute, SGPUStore])
class TestBlockStandards(BlockStandardTestSuite):
    @pytest.fixture
    def block(self, block_class):  # type: ignore[no-untyped-def]
        return block_class

    def test_has_a_valid_image(self, block) -> None:  # type: ignore[no-untyped-def]
        # Prefect's version downloads the logo, which this network cannot: check the URL instead.
        assert str(block._logo_url).startswith("https://") and str(block._logo_url).endswith(".png")


def test_ec2_block_keeps_secrets_out_of_its_document() -> None:
    fields = EC2Compute.model_fields
    assert "aws_credentials" in fields, "AWS credentials reuse prefect-aws's block"
    allowed = {"aws_credentials", "kms_key_id"}  # a block reference, and the id (not the material) of a KMS key
    assert not [name for name in fields if ("secret" in name or "key" in name) and name not in allowed]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    return subprocess.run([sys.executable, "-m", "prefect", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.e2e  # Prefect's CLI registers the blocks
def test_cli_registers_the_blocks_and_saved_documents_load(prefect_server: None) -> None:
    out = _cli("block", "register", "-m", "prefect_sgpu")
    assert out.returncode == 0, out.stdout + out.stderr
    for slug in ("sgpu-local-compute", "sgpu-ec2-compute", "sgpu-ray-compute", "sgpu-store"):
        assert slug in out.stdout.replace("\n", " ") or slug.replace("-", " ") in out.stdout.lower()

    from prefect.settings import PREFECT_API_URL

    saved = subprocess.run([sys.executable, "blocks/save_blocks.py"], cwd=ROOT, capture_output=True,
                           text=True, env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()})
    assert saved.returncode == 0, saved.stderr
    local = LocalCompute.load("local-default")
    assert local.get_compute().isolation == "auto"
    doc = json.loads((ROOT / "blocks" / "ec2-example.json").read_text())
    ec2 = EC2Compute.load(doc["name"])
    assert ec2.subnet_ids == doc["values"]["subnet_ids"] and ec2.market == "spot"


# Every field of the EC2 block, in the order the UI and the sgpu pool's base job template show them.
EC2_BLOCK_FIELDS = [
    "region", "subnet_ids", "security_group_id", "instance_profile", "job_roles", "node_permissions_boundary",
    "ami_id", "ami_ssm_parameter", "instance_types", "market", "capacity_reservation_id", "fallback_to_on_demand",
    "placement_group",
    "volume_size_gb", "store_uri", "ttl_minutes", "tags", "owner", "python", "setup_commands", "pack_environments",
    "agent_timeout_s", "reservation_slot_wait_s",
    "elastic_seek_s",
    "node_silence_s", "replace_lost", "rendezvous_port", "kms_key_id", "bucket_owner", "keep_warm", "endpoint_url", "environment",
    "aws_credentials",
]


def test_the_ec2_block_and_its_settings_are_one_schema() -> None:
    """Each field of the block is declared once (EC2ComputeFields): the block and EC2Settings share its
    default and its check, and the settings add only what code turns."""
    from prefect_sgpu.compute.ec2.settings import EC2ComputeFields, EC2Settings

    assert list(EC2Compute.model_fields) == EC2_BLOCK_FIELDS
    shared = list(EC2ComputeFields.model_fields)
    assert shared == EC2_BLOCK_FIELDS[:-2]  # the block adds the environment and the AWS credentials
    for name in shared:
        declared = EC2ComputeFields.model_fields[name]
        for model in (EC2Compute, EC2Settings):
            field = model.model_fields[name]
            assert (field.description, field.get_default(call_default_factory=True), field.metadata) == (
                declared.description, declared.get_default(call_default_factory=True), declared.metadata), name
    assert set(EC2Settings.model_fields) - set(shared) == {
        "retry_mode", "max_attempts", "running_timeout_s", "waiter_delay_s", "heartbeat_ttl_s", "poll_interval_s"}


def test_the_ec2_block_builds_its_compute_from_its_own_fields() -> None:
    from prefect_sgpu.compute.ec2.settings import EC2Settings

    values = {"store_uri": "s3://team-bucket/sgpu", "subnet_ids": ["subnet-0123456789abcdef0"],
              "instance_profile": "sgpu-node", "instance_types": {"a10": "g5.12xlarge"}, "market": "spot",
              "ttl_minutes": 5, "python": "", "kms_key_id": "", "bucket_owner": " 123456789012 ",
              "rendezvous_port": 29500, "keep_warm": 30.0}
    block = EC2Compute(**values, environment="image")
    assert (block.instance_types, block.python, block.kms_key_id, block.bucket_owner) == (
        {"A10": "g5.12xlarge"}, "python3", None, "123456789012")  # checked and normalised where it is made
    compute = block.get_compute()
    assert compute.settings == EC2Settings(**values)
    assert (compute.heartbeat_ttl_s, compute.rendezvous_port, compute.keep_warm, compute.python) == (
        300.0, 29500, 30.0, "python3")
    assert (compute.store.root_uri, compute.store.bucket_owner) == ("s3://team-bucket/sgpu", "123456789012")
    with pytest.raises(SGPUConfigError) as info:  # a misspelt field is not saved and then ignored
        EC2Compute(volume_size=100)
    assert info.value.field == "volume_size" and "volume_size_gb" in info.value.allowed
    assert EC2Compute.model_validate(block.model_dump()).get_compute().settings == compute.settings


def test_the_pool_offers_exactly_the_ec2_blocks_fields() -> None:
    from prefect_sgpu.adapters.worker import SGPUWorker

    definitions = SGPUWorker.get_default_base_job_template()["variables"]["definitions"]
    ec2 = next(d for d in definitions.values() if d.get("block_type_slug") == "sgpu-ec2-compute")
    assert list(ec2["properties"]) == EC2_BLOCK_FIELDS
    assert (ec2["properties"]["rendezvous_port"]["minimum"], ec2["properties"]["rendezvous_port"]["maximum"]) == (
        1024, 65535)


def test_importing_the_blocks_loads_no_heavy_library() -> None:
    code = ("import sys; import prefect_sgpu.blocks; "
            "heavy = [m for m in ('torch', 'ray', 'mlflow', 'deepspeed') if m in sys.modules]; "
            "own_aws = [m for m in ('prefect_sgpu.compute.ec2.compute', 'prefect_sgpu.store.s3', 'prefect_sgpu.aws') "
            "if m in sys.modules]; print(heavy, own_aws); sys.exit(1 if heavy or own_aws else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
