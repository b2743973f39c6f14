"""``mlflow server`` as a real process on loopback, its artifacts proxied to an S3 location (the moto server)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

from support.aws_fixtures import free_port
from support.served import served


@contextlib.contextmanager
def mlflow_server(artifacts: str, aws_env: dict[str, str], endpoint_url: str) -> Iterator[str]:
    """A tracking server (its backend a SQLite file) whose artifacts live at ``artifacts`` (``s3://...``);
    clients upload and download artifacts through the server, so they need no S3 credentials. Its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(aws_env)
    env["MLFLOW_S3_ENDPOINT_URL"] = endpoint_url
    with served("mlflow server",
                lambda home: [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                              "--workers", "1", "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}",
                              "--artifacts-destination", artifacts],
                lambda home: {**env, "HOME": str(home)}, f"{url}/health"):
        yield url
