"""A node's own requests to the job store for one job, by kind: what the driver adds to the job's cost.

The driver counts its own S3 requests on its store client; a node's (its logs and metrics appended,
the ranks' progress, its alive documents, the heartbeat and stop it reads, results, and what the
ranks write through the job's store) are counted on the node's store client
(:meth:`prefect_sgpu.store.Store.request_counts`) and written to ``nodes/node-<i>.requests`` just
before the node's status, sealed with the job key (kind ``requests``, bound to the run, the node,
its instance and the gang). The driver reads it once, at release, and prices it with its own. The
figures become the job's shown cost, so a document that is unsealed, from another job, node or
gang, too large, or not of this shape counts as not reported (logged), never as a figure.

Two more clients of a node talk to S3 for the job, and their requests are added to the node's:

- the first stage of a bare image (the environment's manifest, files or pack, before the bootstrap
  exists) counts on its own transport and hands its counts to the bootstrap it starts in
  :data:`STAGE_ENV`; a boot serves one job, or a lease whose first job the stage's requests are added to;
- each rank counts what every object store it opened sent (its checkpoints, its shard sets:
  :func:`prefect_sgpu.store.process_request_counts`) and leaves them, when it ends, in a file of the
  node's own job folder (:func:`write_rank`), which the node adds up with its own (:func:`read_ranks`).
  A rank killed before its end leaves none: its requests are not counted.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from prefect_sgpu.errors import DocumentRefused
from prefect_sgpu.protocol.jobfolder import NODES, seal, unseal

if TYPE_CHECKING:
    from prefect_sgpu.store import Store

logger = logging.getLogger("prefect_sgpu.protocol.node_requests")

#: the request kinds a node reports (S3's: LIST is a GET that lists; POST starts and ends multipart uploads
#: and deletes in batches)
KINDS = ("GET", "HEAD", "LIST", "PUT", "POST", "DELETE")
#: a requests document is one short JSON object; a larger one is not a node's and is not read whole
MAX_BYTES = 4096
#: the most requests of one kind a document may claim (a node at 1,000 requests a second for 30 years)
MAX_COUNT = 10**12


#: the environment variable in which a node's first stage hands its own S3 requests to the bootstrap:
#: ``KIND=count`` pairs joined by commas (``GET=12,LIST=1``); the stage's transports write it by this name
STAGE_ENV = "SGPU_STAGE_S3_REQUESTS"
#: the folder of a node's local job folder where each rank leaves its requests (never shipped to the store)
RANKS_DIR = "requests"


def parse_counts(text: str) -> dict[str, int]:
    """``KIND=count`` pairs (:data:`STAGE_ENV`'s form), kinds outside :data:`KINDS` and bad counts dropped."""
    counts: dict[str, int] = {}
    for pair in (text or "").split(","):
        kind, _, count = pair.strip().partition("=")
        if kind in KINDS and count.isdigit() and int(count) <= MAX_COUNT:
            counts[kind] = counts.get(kind, 0) + int(count)
    return counts


def added(*parts: dict[str, int]) -> dict[str, int]:
    """The counts of ``parts`` added kind by kind."""
    total: dict[str, int] = {}
    for part in parts:
        for kind, count in part.items():
            total[kind] = total.get(kind, 0) + count
    return total


def write_rank(job_dir: Path, rank: int, counts: dict[str, int]) -> None:
    """A rank's requests for its node (one file per rank process: a restarted rank writes its own)."""
    mine = {k: int(v) for k, v in counts.items() if k in KINDS and v > 0}
    if not mine:
        return
    folder = Path(job_dir) / RANKS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank-{rank}-{os.getpid()}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(mine))
    os.replace(tmp, path)


def read_ranks(job_dir: Path) -> dict[str, int]:
    """Every rank's requests its node's job folder holds, added up; a file that is not counts is skipped
    (logged): a rank's own figures, each kind bounded as a node's document is."""
    total: dict[str, int] = {}
    folder = Path(job_dir) / RANKS_DIR
    for path in sorted(folder.glob("rank-*.json")) if folder.is_dir() else ():
        try:
            if path.stat().st_size > MAX_BYTES:
                raise ValueError(f"over {MAX_BYTES} bytes")
            counts = json.loads(path.read_text())
            if not isinstance(counts, dict):
                raise ValueError("not an object")
            total = added(total, NodeRequests(node=0, counts={k: v for k, v in counts.items()
                                                              if isinstance(v, int)}).counts)
        except (OSError, ValueError, ValidationError) as exc:
            logger.warning("%s is not counted: %s", path.name, exc)
    return total


def requests_key(node: int) -> str:
    return f"{NODES}/node-{node}.requests"


class NodeRequests(BaseModel):
    """Node ``node``'s requests to the job store during its part of the job, by kind."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: int = Field(ge=0)
    counts: dict[str, int] = Field(default_factory=dict)

    def model_post_init(self, _: object) -> None:
        bad = {k: v for k, v in self.counts.items() if k not in KINDS or not 0 <= v <= MAX_COUNT}
        if bad:
            raise ValueError(f"counts: {bad} not allowed: kinds are {', '.join(KINDS)}, each 0..{MAX_COUNT}")


def write(store: "Store", run_id: str, key: str, node: int, counts: dict[str, int], *,
          instance_id: str | None = None, gang: int = 0) -> None:
    """Node ``node``'s counts, sealed and bound (module docstring); kinds outside :data:`KINDS` are dropped."""
    doc = NodeRequests(node=node, counts={k: int(v) for k, v in counts.items() if k in KINDS and v > 0})
    store.put(run_id, requests_key(node), seal(key, "requests", run_id, doc.model_dump_json().encode(), node=node,
                                               instance_id=instance_id, gang=gang))


def read(store: "Store", run_id: str, key: str, node: int, *, instance_id: str | None = None,
         gang: int = 0) -> dict[str, int] | None:
    """Node ``node``'s counts, or None where it wrote none or what is there is refused (logged)."""
    data, whole = store.get_at_most(run_id, requests_key(node), MAX_BYTES)
    if data is None:
        return None
    try:
        if not whole:
            raise DocumentRefused(f"over {MAX_BYTES} bytes")
        body = unseal(data, key, "requests", run_id, node=node, instance_id=instance_id, gang=gang,
                      what=requests_key(node))
        doc = NodeRequests.model_validate_json(body)
        if doc.node != node:
            raise DocumentRefused(f"it names node {doc.node}")
    except (DocumentRefused, ValidationError, ValueError) as exc:
        logger.warning("node %s's S3 request counts of job %s are not counted: %s", node, run_id, exc)
        return None
    return dict(doc.counts)


__all__ = ["KINDS", "MAX_BYTES", "RANKS_DIR", "STAGE_ENV", "NodeRequests", "added", "parse_counts", "read",
           "read_ranks", "requests_key", "write", "write_rank"]
