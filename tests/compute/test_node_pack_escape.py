"""A pack writes nothing outside its staging folder, whatever links its entries make.

Each entry's name alone can look harmless while extraction writes through a link an earlier entry
made: the venv's absolute interpreter link with a file under it, or a chain of relative links each
lexically inside the venv (``l1 -> l0/..``) that resolves above it. Real archives, real extraction.
"""

from __future__ import annotations

import io
import os
import sys
import tarfile
from pathlib import Path

import pytest

from prefect_sgpu.launch import node_pack

PYTHON = "%d.%d" % sys.version_info[:2]


def _archive(path: Path, entries: list[tuple[str, str | None, bytes | None]]) -> Path:
    """A tar of (name, link target or None, file bytes or None for a folder)."""
    with tarfile.open(path, "w") as tar:
        for name, link, data in entries:
            info = tarfile.TarInfo(name)
            if link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tar.addfile(info)
            elif data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def _everything(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_file_under_the_venv_s_absolute_interpreter_link_is_refused_and_nothing_is_written_outside(
        tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    archive = _archive(tmp_path / "pack.tar", [
        ("venv", None, None), ("venv/bin", None, None),
        ("venv/bin/python3", str(outside), None),  # an allowed absolute interpreter link...
        ("venv/bin/python3/pwned", None, b"written as root\n"),  # ...and a file under it
    ])
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(node_pack.PackError, match=r"'venv/bin/python3/pwned' lies under the link 'venv/bin/python3'"):
        node_pack.unpack(archive, root, root / "venv-x", PYTHON)
    assert _everything(outside) == [], "nothing written through the link"
    assert _everything(root) == [], "the staging folder is gone, nothing else was made"


def test_a_chain_of_relative_links_that_resolves_above_the_venv_is_refused_and_nothing_is_written_outside(
        tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    # venv/l0 -> . is the venv; l1 -> l0/.. is the staging folder; l2 -> l1/.. is root; l3 -> l2/.. is tmp_path:
    # each lexically inside venv/
    chain = [("venv", None, None), ("venv/l0", ".", None), ("venv/l1", "l0/..", None),
             ("venv/l2", "l1/..", None), ("venv/l3", "l2/..", None)]
    through = _archive(tmp_path / "through.tar", [*chain, ("venv/l3/pwned", None, b"written as root\n")])
    with pytest.raises(node_pack.PackError, match=r"'venv/l3/pwned' lies under the link 'venv/l3'"):
        node_pack.unpack(through, root, root / "venv-x", PYTHON)
    assert not (tmp_path / "pwned").exists() and not (root / "pwned").exists()

    # the links alone: extracted, then refused as they resolve, before anything uses them
    links = _archive(tmp_path / "links.tar", chain)
    with pytest.raises(node_pack.PackError, match=r"'venv/l1' links to 'l0/\.\.', which resolves outside its folder"):
        node_pack.unpack(links, root, root / "venv-x", PYTHON)
    assert _everything(root) == [], "the staging folder is gone"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["links.tar", "root", "through.tar"]


def test_an_entry_given_twice_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    archive = _archive(tmp_path / "pack.tar", [
        ("venv", None, None), ("venv/bin", None, None), ("venv/bin/python3", str(outside / "target"), None),
        ("venv/bin/python3", None, b"through the link\n"),  # a file over the link: open() would follow it
    ])
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(node_pack.PackError, match=r"entry 'venv/bin/python3' appears twice"):
        node_pack.unpack(archive, root, root / "venv-x", PYTHON)
    assert _everything(outside) == [] and _everything(root) == []


def test_a_normal_pack_with_its_absolute_interpreter_link_and_relative_links_still_unpacks(tmp_path: Path) -> None:
    builder = tmp_path / "builder"
    venv = builder / "venv-a"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib" / "site").mkdir(parents=True)
    home = os.path.dirname(sys.executable)
    (venv / "pyvenv.cfg").write_text(f"home = {home}\n")
    (venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    (venv / "bin" / "python3").symlink_to("python")
    (venv / "lib" / "site" / "mod.py").write_text("X = 1\n")
    (venv / "lib64").symlink_to("lib")
    archive = tmp_path / "pack.tar"
    sha, size = node_pack.pack(venv, archive)
    assert size == archive.stat().st_size and sha == node_pack.file_sha256(archive)

    root = tmp_path / "node"
    root.mkdir()
    node_pack.unpack(archive, root, root / "venv-b", PYTHON)
    got = root / "venv-b"
    assert (got / "lib64" / "site" / "mod.py").read_text() == "X = 1\n"
    assert os.readlink(got / "bin" / "python3") == "python"
    assert [p.name for p in root.iterdir()] == ["venv-b"], "no staging folder left"
