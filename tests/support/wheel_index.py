"""A package index on 127.0.0.1 for the nodes of the fake cloud, and the uv wheel it serves.

A bare image has no uv; the environment stage fetches the uv wheel it pins
(:data:`prefect_sgpu.launch.stage_uv.UV_WHEELS`) from a package index and checks its sha256. On AWS
that index is PyPI or the user's mirror; here it is :class:`WheelIndex`, serving the real wheel that
``./dev`` downloads once into the venv (``python tests/support/wheel_index.py --fetch``), so the
stage runs the same code with the index swapped.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import platform
import subprocess
import sys
import threading
from pathlib import Path

WHEELS = Path(sys.prefix) / "sgpu-wheels"


def pinned_uv() -> tuple[str, str]:
    """(file name, sha256) of the uv wheel the stage pins for this machine."""
    from prefect_sgpu.launch import stage_uv

    return stage_uv.UV_WHEELS[stage_uv.this_machine()]


def uv_wheel() -> Path:
    """The pinned uv wheel for this machine, as ``./dev`` downloaded it (checked)."""
    name, sha = pinned_uv()
    path = WHEELS / name
    assert path.exists(), f"{path} is missing: ./dev downloads it (python tests/support/wheel_index.py --fetch)"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == sha, f"{path} is not the pinned file"
    return path


def fetch() -> int:
    """Download the pinned uv wheel for this machine into the venv, unless it is there already."""
    name, sha = pinned_uv()
    path = WHEELS / name
    if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == sha:
        return 0
    version = name.split("-")[1]
    tag = name.split("-")[-1].removesuffix(".whl").split(".")[0]  # manylinux_2_17_x86_64
    WHEELS.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--platform", tag, "-d", str(WHEELS), f"uv=={version}"], check=True)
    if not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() != sha:
        print(f"{path}: the download is not the pinned uv wheel (sha256 {sha})", file=sys.stderr)
        return 1
    return 0


class WheelIndex:
    """A simple-API index (PEP 503 HTML) on 127.0.0.1 serving ``files`` (name -> bytes), one project
    each by the name's first part; ``requests`` lists the paths asked for. With ``auth`` (user,
    password) every request needs that Basic auth (401 otherwise); with ``redirect`` (a base URL)
    every request is answered with a redirect there."""

    def __init__(self, files: dict[str, bytes], auth: tuple[str, str] | None = None,
                 redirect: str | None = None) -> None:
        self.files = dict(files)
        self.authorizations: list[str | None] = []  # the Authorization header of each request
        want = None if auth is None else "Basic " + base64.b64encode(":".join(auth).encode()).decode()
        self.requests: list[str] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                index.requests.append(self.path)
                index.authorizations.append(self.headers.get("Authorization"))
                if redirect is not None:  # everything lives elsewhere (a CDN, another host)
                    self.send_response(302)
                    self.send_header("Location", redirect + self.path)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                if want is not None and self.headers.get("Authorization") != want:
                    return self._send(401, b"credentials needed", "text/plain")
                parts = [p for p in self.path.split("?")[0].split("/") if p]
                if len(parts) == 2 and parts[0] == "simple":
                    names = [n for n in index.files if n.split("-")[0] == parts[1]]
                    if names:
                        links = "".join(f'<a href="../../files/{n}#sha256={hashlib.sha256(index.files[n]).hexdigest()}">'
                                        f"{n}</a>\n" for n in names)
                        return self._send(200, f"<html><body>\n{links}</body></html>".encode(), "text/html")
                if len(parts) == 2 and parts[0] == "files" and parts[1] in index.files:
                    return self._send(200, index.files[parts[1]], "application/octet-stream")
                self._send(404, b"not found", "text/plain")

            def _send(self, code: int, body: bytes, kind: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        threading.Thread(target=self.server.serve_forever, name="wheel-index", daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "WheelIndex":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_shared: WheelIndex | None = None
_lock = threading.Lock()


def uv_index() -> WheelIndex:
    """This process's index serving the pinned uv wheel (started on first use, a daemon thread)."""
    global _shared
    with _lock:
        if _shared is None:
            wheel = uv_wheel()
            _shared = WheelIndex({wheel.name: wheel.read_bytes()})
        return _shared


if __name__ == "__main__":
    if sys.argv[1:] != ["--fetch"]:
        raise SystemExit("usage: python tests/support/wheel_index.py --fetch")
    sys.exit(fetch())
