"""A server program the tests start as their own process: up when its health URL answers 200."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator


@contextlib.contextmanager
def served(what: str, argv: Callable[[Path], list[str]], env: Callable[[Path], dict[str, str]], health: str,
           timeout: float = 300.0) -> Iterator[Path]:
    """Run ``argv(home)`` with ``env(home)`` in a fresh folder ``home`` (its output in ``home/server.log``)
    until ``health`` answers 200, or fail with the end of that output; stopped (its whole process
    group) and the folder removed afterwards. ``timeout``: a first start migrates a database, on a
    machine that may be busy."""
    home = Path(tempfile.mkdtemp(prefix="sgpu-served-"))
    log_path = home / "server.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv(home), env=env(home), cwd=home, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited ({proc.returncode}): {log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(health, timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not up in {timeout:g} s: {log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield home
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        shutil.rmtree(home, ignore_errors=True)
