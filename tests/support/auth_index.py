"""A package index on 127.0.0.1 that answers only with HTTP Basic credentials (PEP 503 simple pages).

It holds wheels built here (:func:`build_wheel`, a pure-Python package of one module) and
answers 404 for every other project, so an installer falls through to its other indexes. It
records which requests came with the right credentials and which did not.
"""

from __future__ import annotations

import base64
import hashlib
import html
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def build_wheel(folder: Path, name: str, version: str, source: str) -> Path:
    """A ``py3-none-any`` wheel of module ``name`` (dashes become underscores) holding ``source``."""
    module = name.replace("-", "_")
    wheel = Path(folder) / f"{module}-{version}-py3-none-any.whl"
    info = f"{module}-{version}.dist-info"
    files = {
        f"{module}.py": source.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: prefect-sgpu-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


class AuthIndex:
    """``http://127.0.0.1:<port>/simple/`` serving ``wheels`` to whoever sends ``user``:``password``."""

    def __init__(self, wheels: list[Path], user: str, password: str) -> None:
        self.wheels = {w.name: w.read_bytes() for w in wheels}
        self.expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.authorized: list[str] = []
        self.refused: list[str] = []
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:
                pass

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                self.do_GET(head=True)

            def do_GET(self, head: bool = False) -> None:  # noqa: N802
                if self.headers.get("Authorization") != index.expected:
                    index.refused.append(self.path)
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="sgpu-test"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                index.authorized.append(self.path)
                status, body, kind = index.answer(self.path)
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="auth-index", daemon=True)

    def answer(self, path: str) -> tuple[int, bytes, str]:
        path = path.split("?", 1)[0]
        if path.startswith("/files/") and path[len("/files/"):] in self.wheels:
            return 200, self.wheels[path[len("/files/"):]], "application/octet-stream"
        if path.startswith("/simple/"):
            project = path[len("/simple/"):].strip("/")
            links = [(name, hashlib.sha256(data).hexdigest()) for name, data in self.wheels.items()
                     if name.split("-")[0].replace("_", "-") == project]
            if links:
                body = "".join(f'<a href="/files/{html.escape(n)}#sha256={h}">{html.escape(n)}</a>\n'
                               for n, h in links)
                return 200, f"<!DOCTYPE html><html><body>\n{body}</body></html>".encode(), "text/html"
        return 404, b"not found", "text/plain"

    def url(self, userinfo: str) -> str:
        return f"http://{userinfo}@127.0.0.1:{self.port}/simple/"

    def __enter__(self) -> "AuthIndex":
        self._thread.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
