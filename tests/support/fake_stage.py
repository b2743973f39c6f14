"""The fake cloud's transport for the node's environment stage (:class:`prefect_sgpu.launch.node_env.Transport`).

What :mod:`prefect_sgpu.launch.ec2_stage` is to an ``s3://`` store, this is to the fake cloud: the
store is a local folder (a :class:`prefect_sgpu.store.LocalStore`'s root, keys relative to it), its
secrets are the files :class:`support.fake_provider.FakeProvider` writes, and the machine's identity
comes from its command line. Standard library only, as a transport must be: the stage imports it
before anything is installed (``--transport=support.fake_stage``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import urllib.parse
import uuid
from pathlib import Path


def secret_path(folder: Path, name: str) -> Path:
    """Where the fake cloud keeps secret ``name``: one file, named by the quoted name."""
    return folder / urllib.parse.quote(name, safe="")


class FakeStageTransport:
    """A local store's objects, the fake cloud's secrets and this machine's id and index."""

    def __init__(self, root: Path, secrets: Path, machine_id: str, index: int) -> None:
        self.root, self.secrets, self.machine_id, self.index = root, secrets, machine_id, index

    @classmethod
    def from_args(cls, store_uri: str, argv: list[str]) -> "FakeStageTransport":
        p = argparse.ArgumentParser(prog="prefect-sgpu-node-env (fake)")
        p.add_argument("--secrets", required=True)
        p.add_argument("--machine-id", required=True)
        p.add_argument("--index", type=int, required=True)
        args = p.parse_args(argv)
        return cls(Path(store_uri), Path(args.secrets), args.machine_id, args.index)

    @property
    def root_uri(self) -> str:
        return str(self.root)  # as LocalStore.root_uri: the store's scope derives from it

    def uri(self, key: str) -> str:
        return str(self.root / key)

    def get(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def get_range(self, key: str, start: int, end: int) -> bytes:
        with open(self.root / key, "rb") as fh:
            fh.seek(start)
            return fh.read(end - start + 1)

    def put(self, key: str, body: bytes, content_type: str = "") -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        part.write_bytes(body)
        os.replace(part, path)

    def start_upload(self, key: str) -> str:
        upload = uuid.uuid4().hex
        (self.root / ".uploads" / upload).mkdir(parents=True)
        return upload

    def put_part(self, key: str, upload: str, number: int, data: bytes) -> str:
        (self.root / ".uploads" / upload / f"{number:05d}").write_bytes(data)
        return f"{number:05d}"

    def finish_upload(self, key: str, upload: str, parts: list[str]) -> None:
        folder = self.root / ".uploads" / upload
        try:
            if parts:
                self.put(key, b"".join((folder / p).read_bytes() for p in parts))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def read_secret(self, name: str) -> str:
        return secret_path(self.secrets, name).read_text()  # FileNotFoundError until the driver wrote it

    def instance_id(self) -> str:
        return self.machine_id

    def launch_index(self) -> int:
        return self.index


#: what :mod:`prefect_sgpu.launch.node_env` looks up in a transport's module
TRANSPORT = FakeStageTransport
