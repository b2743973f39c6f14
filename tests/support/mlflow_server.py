"""``mlflow server`` as a real process on loopback, its artifacts proxied to an S3 location (the moto server)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from support.aws_fixtures import free_port


@contextlib.contextmanager
def mlflow_server(artifacts: str, aws_env: dict[str, str], endpoint_url: str) -> Iterator[str]:
    """A tracking server (its backend a SQLite file) whose artifacts live at ``artifacts`` (``s3://...``);
    clients upload and download artifacts through the server, so they need no S3 credentials. Its URL."""
    home = Path(tempfile.mkdtemp(prefix="sgpu-mlflow-server-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(aws_env)
    env.update({"MLFLOW_S3_ENDPOINT_URL": endpoint_url, "HOME": str(home)})
    url = f"http://127.0.0.1:{port}"
    with open(home / "server.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}", "--artifacts-destination", artifacts],
            env=env, cwd=home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300  # its first start migrates the database; a busy machine is slow
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited ({proc.returncode}): {(home / 'server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server not up in 300 s: {(home / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        import shutil

        shutil.rmtree(home, ignore_errors=True)
