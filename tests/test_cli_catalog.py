"""``prefect-sgpu gpus`` and ``prefect-sgpu --version``: the installed command, run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import tomllib

import prefect_sgpu
from prefect_sgpu import catalog

ROOT = Path(__file__).resolve().parents[1]
COMMAND = Path(sys.executable).parent / "prefect-sgpu"


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(COMMAND), *argv], check=False, capture_output=True, text=True, timeout=120, env=env,
                          cwd=Path.home())


def test_gpus_prints_every_instance_type_of_the_catalog_with_its_gpus_and_price() -> None:
    done = _run("gpus")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "on-demand USD per hour in us-east-1" in lines[0]
    assert lines[1].split()[:3] == ["GPU", "instance", "type"]
    rows = {line.split()[2 if "(" in line else 1]: line.split() for line in lines[2:]}
    expected = {it.name: (acc.name, it) for acc in catalog.CATALOG.values() for it in acc.instance_types}
    assert set(rows) == set(expected)
    for name, (gpu, it) in expected.items():
        row = rows[name]
        assert row[0] == gpu, row
        numbers = row[row.index(name) + 1:]
        assert numbers[0] == str(it.gpus)
        assert float(numbers[-2]) == it.price_per_hour
        assert float(numbers[-1]) == round(it.price_per_hour / it.gpus, 3)
    assert any(line.startswith("A10 (A10G)") and "g5.48xlarge" in line for line in lines)


def test_gpus_json_holds_gpus_per_node_and_prices_by_instance_type() -> None:
    done = _run("gpus", "--json")
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed["region"] == "us-east-1" and printed["priced_regions"] == ["us-east-1"]
    by_name = {g["name"]: g for g in printed["gpu_types"]}
    assert sorted(by_name) == catalog.known_gpu_types()
    assert by_name["A10"]["gpus_per_node"] == [1, 4, 8] and by_name["A10"]["aliases"] == ["A10G"]
    (p5,) = by_name["H100"]["instance_types"]
    assert p5 == {"name": "p5.48xlarge", "gpus": 8, "vcpus": 192, "memory_gib": 2048, "gpu_memory_gib": 640,
                  "efa_interfaces": 32, "usd_per_hour": 55.04, "usd_per_gpu_hour": 6.88}


def test_gpus_in_a_region_without_prices_says_so_and_prints_none() -> None:
    done = _run("gpus", "--region", "eu-west-1")
    assert done.returncode == 0, done.stderr
    assert "the catalog has no prices for eu-west-1 (it has us-east-1)" in done.stdout
    assert all(line.split()[-2:] == ["-", "-"] for line in done.stdout.splitlines()[2:])
    printed = json.loads(_run("gpus", "--region", "eu-west-1", "--json").stdout)
    assert printed["region"] == "eu-west-1"
    assert {it["usd_per_hour"] for g in printed["gpu_types"] for it in g["instance_types"]} == {None}
    assert {it["gpus"] for g in printed["gpu_types"] for it in g["instance_types"]} == {1, 4, 8}


def test_gpus_refuses_a_malformed_region_naming_it() -> None:
    done = _run("gpus", "--region", "Mars-1")
    assert done.returncode == 2
    assert "prefect-sgpu gpus: region='Mars-1' is not allowed: an AWS region name such as us-east-1" in done.stderr
    assert done.stdout == ""


def test_version_is_pyprojects_everywhere() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert metadata.version("prefect-sgpu") == declared
    assert prefect_sgpu.__version__ == declared
    done = _run("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"prefect-sgpu {declared}"
    helped = _run("--help")
    assert helped.returncode == 0 and "gpus" in helped.stdout and "gc" in helped.stdout
