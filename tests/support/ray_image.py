"""A cluster "image" Python for Ray runtime_env tests, and a tiny wheel built without a network.

Ray's pip (and uv) plugin makes each environment's virtualenv from the cluster's Python: with
``--system-site-packages`` from a plain Python, by *copying the whole virtualenv* when the
cluster itself runs in one. This checkout's ``.venv`` is several GB (CUDA torch), so a cluster
started from it would copy that for every new runtime_env. An image usually has Ray in its own
site-packages; :func:`image_python` stands in for one: a virtualenv of a few files whose
site-packages adds the checkout's ``.venv`` site-packages (``site.addsitedir``), so Ray copies
only those few files and its pip installs on top of everything the checkout has.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path


def image_python(folder: Path) -> Path:
    """A small virtualenv in ``folder`` that sees this interpreter's packages; its python."""
    python = folder / "bin" / "python"
    if python.exists():
        return python
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    site = folder / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    here = sysconfig.get_paths()["purelib"]
    (site / "sgpu_image.pth").write_text(f"import site; site.addsitedir({here!r})\n")
    return python


def tiny_wheel(folder: Path, name: str, version: str, source: str) -> Path:
    """A pure-Python wheel of one module ``name`` whose ``__init__.py`` is ``source``."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": source.encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: sgpu-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{path},sha256={_digest(data)},{len(data)}" for path, data in files.items()]
    files[f"{dist}/RECORD"] = ("\n".join([*record, f"{dist}/RECORD,,"]) + "\n").encode()
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
