"""A rank's progress file (``progress/rank-<r>``), sealed: what the driver's straggler watch and
progress report read.

A rank reports its steps through :func:`prefect_sgpu.runtime.progress`; the file crosses the job
store (an EC2 node ships it with its logs), and the driver names stragglers from it, which become
``prefect-sgpu.job.straggler`` events that automations may act on. So whoever can write the store
must not be able to make a rank look slow (or fast): the file holds its plain line, ``pid step
total time`` (what the node's own hang watchdog reads, on the node's disk), and under it that
line sealed (:func:`prefect_sgpu.protocol.jobfolder.seal`, kind ``progress``) with the job's
progress key, bound to the run, the rank and the gang. The key is derived from the job key and
given to the rank's process only (as relayed MLflow records' is): it opens nothing else.

The driver acts only on the sealed line: a file that is unsealed, sealed with another key, for
another job, rank or gang, or older than what it already read of that rank (written back) is
refused, with a warning naming the rank and why.
"""

from __future__ import annotations

import base64
import binascii
import os
from typing import TYPE_CHECKING

from prefect_sgpu.errors import DocumentRefused
from prefect_sgpu.protocol.jobfolder import derive_key, seal, unseal

if TYPE_CHECKING:
    from prefect_sgpu.store import Store

#: the rank's progress key (hex): set by the rank's own process from the job key, never stored
KEY_ENV = "SGPU_PROGRESS_KEY"
#: the folder of the progress files in a job folder
PROGRESS_DIR = "progress"
#: a progress file is two short lines; a larger one is not a rank's and is not read whole
MAX_BYTES = 4096


class ProgressRefused(Exception):
    """A progress file the driver does not act on: why, for the log."""


def progress_key(job_key: str) -> str:
    """The key progress lines are sealed with, derived from the job key (it seals nothing else)."""
    return derive_key(job_key, b"prefect-sgpu rank progress")


def arm(job_key: str) -> None:
    """In a rank, before user code runs: give :func:`prefect_sgpu.runtime.progress` (this process
    and its children) the key its lines are sealed with."""
    os.environ[KEY_ENV] = progress_key(job_key)


def progress_file_key(rank: int) -> str:
    return f"{PROGRESS_DIR}/rank-{rank}"


def file_bytes(line: str, key: str, run_id: str, rank: int, gang: int = 0) -> bytes:
    """A progress file: the plain line, then (with a key) the line sealed, base64, on a line of its own."""
    text = line.strip().encode()
    if not key:
        return text + b"\n"
    return text + b"\n" + base64.b64encode(seal(key, "progress", run_id, text, rank=rank, gang=gang)) + b"\n"


def open_line(data: bytes, key: str, run_id: str, rank: int, gang: int = 0) -> str:
    """The sealed line of a progress file, or ProgressRefused: not sealed with this job's progress
    key for this run, rank and gang."""
    lines = data.split(b"\n")
    if len(lines) < 2 or not lines[1].strip():
        raise ProgressRefused("not sealed (a plain line alone)")
    try:
        blob = base64.b64decode(lines[1].strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ProgressRefused("not sealed (its second line is not a seal)") from None
    try:
        body = unseal(blob, key, "progress", run_id, rank=rank, gang=gang, what=f"progress of rank {rank}")
    except DocumentRefused as exc:
        raise ProgressRefused(str(exc)) from None
    try:
        return body.decode("ascii")
    except UnicodeDecodeError:
        raise ProgressRefused("sealed, but not a progress line") from None


def read_line(store: "Store", run_id: str, rank: int, job_key: str, gang: int = 0) -> str | None:
    """Rank ``rank``'s sealed progress line in the job folder (None while it has none), reading at
    most :data:`MAX_BYTES`; ProgressRefused for a file the driver must not act on."""
    data, whole = store.get_at_most(run_id, progress_file_key(rank), MAX_BYTES)
    if data is None:
        return None
    if not whole:
        raise ProgressRefused(f"larger than the {MAX_BYTES} bytes a progress file holds: not read")
    return open_line(data, progress_key(job_key), run_id, rank, gang)
