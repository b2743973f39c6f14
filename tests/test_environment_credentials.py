"""Credentials do not travel with a job's files.

Files named like credentials stay behind by default; a text file that would travel with an AWS
access key id or a PEM private key in it refuses the capture, naming the file and the opt-outs;
an installed distribution's RECORD ships files inside its site folder only.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from prefect_sgpu.environment import capture
from prefect_sgpu.environment.files import scan
from prefect_sgpu.errors import SGPUConfigError

AWS_KEY_ID = "AKIA" + "Q3EGRHVXW7NBT5KD"  # the shape of a real one (split so this file is not one itself)
PEM = "-----BEGIN " + "OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n"


def _paths(env: object) -> set[str]:
    return {f.path for f in env.working_dir.files}  # type: ignore[attr-defined]


def _project(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_files_named_like_credentials_stay_behind_unless_taken_back(tmp_path: Path) -> None:
    project = _project(tmp_path / "project", {
        "train.py": "print('hi')\n", "id_utils.py": "x = 1\n", "README.key.md": "notes\n",
        ".env": "TOKEN=x\n", ".env.production": "TOKEN=y\n", "certs/server.pem": "cert\n", "tls/server.key": "k\n",
        ".netrc": "machine m\n", ".aws/credentials": "[default]\n", ".aws/config": "[default]\n",
        "keys/id_ed25519": "k\n", "keys/id_rsa.pub": "ssh-rsa\n", ".ssh/known_hosts": "h\n", ".pypirc": "[pypi]\n",
        ".git-credentials": "https://u:p@h\n"})
    assert _paths(capture(mode="image", working_dir=project)) == {"train.py", "id_utils.py", "README.key.md"}
    taken_back = capture(mode="image", working_dir=project, excludes=["!.env.production"])
    assert ".env.production" in _paths(taken_back) and ".env" not in _paths(taken_back)


@pytest.mark.parametrize("rel,text,kind", [
    ("settings.py", f"AWS_ACCESS_KEY_ID = '{AWS_KEY_ID}'\n", "an AWS access key id"),
    ("deploy/notes.txt", "the key:\n" + PEM, "a PEM private key"),
])
def test_a_credential_in_a_travelling_text_file_refuses_the_capture_naming_the_file(
        tmp_path: Path, rel: str, text: str, kind: str) -> None:
    project = _project(tmp_path / "project", {"train.py": "print('hi')\n", rel: text})
    with pytest.raises(SGPUConfigError) as err:
        capture(mode="image", working_dir=project)
    message = str(err.value)
    assert "environment.working_dir" in message and f"{rel} in {project}" in message and kind in message
    assert f"excludes=['/{rel}']" in message and "allow_credential_files" in message, "the opt-outs are named"
    assert AWS_KEY_ID not in message and "b3BlbnNz" not in message, "the credential itself is never shown"

    assert rel not in _paths(capture(mode="image", working_dir=project, excludes=[f"/{rel}"]))
    allowed = capture(mode="image", working_dir=project, allow_credential_files=[f"/{rel}"])
    assert rel in _paths(allowed), "an explicit opt-out lets a fixture travel"
    with pytest.raises(SGPUConfigError, match="py_modules"):
        capture(mode="image", py_modules=[str(project)], auto_modules=False)


def test_the_scan_passes_binary_files_and_awss_documented_example_key(tmp_path: Path) -> None:
    project = _project(tmp_path / "project", {"docs.md": "e.g. AKIAIOSFODNN7EXAMPLE\n",
                                              "id.txt": "AKIAQ3EGRHVXW7NBT5KDX is longer than a key id\n"})
    (project / "weights.bin").write_bytes(b"\0\1\2" + AWS_KEY_ID.encode() + b"\0")
    assert _paths(capture(mode="image", working_dir=project)) == {"docs.md", "id.txt", "weights.bin"}


def test_an_editable_checkouts_file_with_a_credential_is_left_out_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    checkout = _project(tmp_path / "checkout", {"pkg/__init__.py": "x = 1\n",
                                                "tests/fixture.py": f"KEY = '{AWS_KEY_ID}'\n"})
    with caplog.at_level(logging.WARNING, logger="prefect_sgpu.environment"):
        tree = scan("pkg", checkout, "environment (the installed package pkg)", credentials="leave_out")
    assert {f.path for f in tree.files} == {"pkg/__init__.py"}
    assert f"tests/fixture.py in {checkout} holds an AWS access key id: left out" in caplog.text


def test_a_record_entry_outside_its_site_folder_never_ships_a_driver_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution installed from a file (PEP 610 ``direct_url.json``, not editable) whose RECORD
    names an absolute path and a link out of its site folder: neither file travels."""
    secret = tmp_path / "home" / ".aws" / "credentials"
    secret.parent.mkdir(parents=True)
    secret.write_text("[default]\naws_secret_access_key = s3cr3t\n")
    site = tmp_path / "site"
    pkg = site / "recordpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    os.symlink(secret, pkg / "linked.txt")
    info = site / "recordpkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: recordpkg\nVersion: 1.0\n")
    (info / "direct_url.json").write_text(json.dumps({"url": (tmp_path / "recordpkg-1.0.tar.gz").as_uri(),
                                                      "archive_info": {}}))
    (info / "RECORD").write_text("\n".join([
        "recordpkg/__init__.py,,", f"{secret},,", "recordpkg/linked.txt,,", "recordpkg-1.0.dist-info/METADATA,,",
        "recordpkg-1.0.dist-info/RECORD,,"]) + "\n")
    monkeypatch.syspath_prepend(str(site))

    env = capture(mode="driver", auto_modules=False)
    [tree] = [t for t in env.local_packages if t.name == "recordpkg"]
    shipped = {f.path for f in tree.files}
    assert shipped == {"recordpkg/__init__.py", "recordpkg-1.0.dist-info/METADATA",
                       "recordpkg-1.0.dist-info/RECORD"}, shipped
    assert not any(p.startswith("/") or ".aws" in p for p in shipped)
