"""Where a job's checkpoints live: a folder, or a prefix on S3, behind one small API.

The driver hands every rank ``SGPU_CHECKPOINT_URI``: the job store's ``checkpoints``
folder by default (``<store>/<run id>/checkpoints``), or a folder a GPU task keys by
flow run, task and inputs so a Prefect retry finds it. A local URI is used in place
(every simulated node of the local compute sees the same folder). An ``s3://`` URI
is staged: ranks write into a node-local folder and :class:`Location` uploads each
node's files (boto3's managed transfer: multipart for large shards), downloads a step
to a node that lacks it, and lists and deletes steps on S3. The ranks reach S3 with
the node's own credentials (the instance profile); the store's region and endpoint
travel in ``SGPU_STORE_REGION`` / ``SGPU_STORE_ENDPOINT_URL``.

What makes a checkpoint *count* (its ``COMPLETE`` marker, written last) is the
:class:`~prefect_sgpu.pipeline.checkpoint.Checkpointer`'s protocol; this module only
moves folders.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

URI_ENV = "SGPU_CHECKPOINT_URI"
#: the older name of the same setting, a local folder
DIR_ENV = "SGPU_CHECKPOINT_DIR"
REGION_ENV = "SGPU_STORE_REGION"
ENDPOINT_ENV = "SGPU_STORE_ENDPOINT_URL"
MARKER = "COMPLETE"
STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def location_uri() -> str:
    """This rank's checkpoint location: the launcher's, else ``<job dir>/checkpoints``, else ``./checkpoints``."""
    uri = os.environ.get(URI_ENV) or os.environ.get(DIR_ENV)
    if uri:
        return uri
    return str(Path(os.environ.get("SGPU_JOB_DIR", ".")) / "checkpoints")


def is_remote(uri: str) -> bool:
    return uri.startswith("s3://")


def _stage_root() -> Path:
    job_dir = os.environ.get("SGPU_JOB_DIR")
    return Path(job_dir) / "checkpoint-stage" if job_dir else Path(tempfile.gettempdir()) / "sgpu-checkpoint-stage"


class Location:
    """One checkpoint location: ``local`` is the folder ranks read and write on this node."""

    def __init__(self, uri: str | os.PathLike[str] | None = None, stage: Path | None = None) -> None:
        self.uri = str(uri) if uri is not None else location_uri()
        self.remote = is_remote(self.uri)
        if self.remote:
            digest = hashlib.sha256(self.uri.encode()).hexdigest()[:16]
            self.local = Path(stage) if stage is not None else _stage_root() / digest
        else:
            self.local = Path(self.uri).expanduser()
        self._store: Any = None

    def __repr__(self) -> str:
        return f"Location({self.uri!r})"

    # -- S3 ------------------------------------------------------------------------

    @property
    def store(self) -> Any:
        """The S3 store rooted at this location (keys are relative to it)."""
        if self._store is None:
            from prefect_sgpu.store_s3 import S3Store

            self._store = S3Store.from_env(self.uri, region=os.environ.get(REGION_ENV) or None,
                                           endpoint_url=os.environ.get(ENDPOINT_ENV) or None)
        return self._store

    def _keys(self, under: str = "") -> list[str]:
        """Every object key below the location (or ``under`` it), relative to the location."""
        store = self.store
        root = store._key("") + "/" if store.prefix else ""
        prefix = root + (under.strip("/") + "/" if under else "")
        keys: list[str] = []
        for page in store.client.get_paginator("list_objects_v2").paginate(Bucket=store.bucket, Prefix=prefix,
                                                                            **store.owner_args()):
            keys += [obj["Key"][len(root):] for obj in page.get("Contents", [])]
        return keys

    # -- what is there -------------------------------------------------------------

    def complete_steps(self) -> list[int]:
        """Steps whose ``COMPLETE`` marker exists at the location, oldest first."""
        steps: set[int] = set()
        if self.remote:
            for key in self._keys():
                head, _, name = key.partition("/")
                match = STEP_DIR.match(head)
                if match and name == MARKER:
                    steps.add(int(match.group(1)))
        elif self.local.is_dir():
            for child in self.local.iterdir():
                match = STEP_DIR.match(child.name)
                if match and (child / MARKER).is_file():
                    steps.add(int(match.group(1)))
        return sorted(steps)

    def step_dirs(self) -> list[int]:
        """Every step folder at the location, complete or not."""
        if self.remote:
            return sorted({int(m.group(1)) for k in self._keys() if (m := STEP_DIR.match(k.partition("/")[0]))})
        if not self.local.is_dir():
            return []
        return sorted(int(m.group(1)) for c in self.local.iterdir() if (m := STEP_DIR.match(c.name)))

    # -- moving folders ------------------------------------------------------------

    def upload(self, name: str) -> int:
        """Every file of this node's ``local/name`` (the marker excepted) to the location; bytes sent."""
        if not self.remote:
            return 0
        source = self.local / name
        sent = 0
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            rel = path.relative_to(self.local).as_posix()
            if path.name == MARKER or path.name.endswith(".tmp"):
                continue
            self.store.client.upload_file(str(path), self.store.bucket, self.store._key("", rel),
                                          ExtraArgs=self.store.write_args())
            sent += path.stat().st_size
        return sent

    def put_marker(self, name: str, data: bytes) -> None:
        """The step's marker: written locally (atomically) and, remotely, last of all its objects."""
        from prefect_sgpu.store import atomic_write

        atomic_write(self.local / name / MARKER, data)
        if self.remote:
            self.store.put("", f"{name}/{MARKER}", data)

    def marker(self, step: int) -> bytes | None:
        """The ``COMPLETE`` marker of ``step`` as written (its JSON says when), or None."""
        name = f"{step_dir_name(step)}/{MARKER}"
        if self.remote:
            return self.store.get("", name)
        try:
            return (self.local / name).read_bytes()
        except FileNotFoundError:
            return None

    def fetch(self, name: str) -> Path:
        """``name`` as a complete local folder: downloaded (marker last) unless this node has it already."""
        target = self.local / name
        if not self.remote or (target / MARKER).is_file():
            return target
        if target.exists():
            shutil.rmtree(target)
        keys = self._keys(name)
        for key in sorted(keys, key=lambda k: k.endswith("/" + MARKER)):
            dest = self.local / key
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + ".part")
            self.store.client.download_file(self.store.bucket, self.store._key("", key), str(tmp),
                                            ExtraArgs=self.store.owner_args() or None)
            os.replace(tmp, dest)
        return target

    def delete(self, name: str) -> None:
        """A step folder, at the location and in this node's stage."""
        if self.remote:
            self.store.delete("", name)
        shutil.rmtree(self.local / name, ignore_errors=True)

    def prune_stage(self, keep: str) -> None:
        """Drop every staged step folder but ``keep`` (the location holds the others)."""
        if not self.remote or not self.local.is_dir():
            return
        for child in self.local.iterdir():
            if STEP_DIR.match(child.name) and child.name != keep:
                shutil.rmtree(child, ignore_errors=True)
