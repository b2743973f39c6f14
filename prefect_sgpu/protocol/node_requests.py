"""A node's own requests to the job store for one job, by kind: what the driver adds to the job's cost.

The driver counts its own S3 requests on its store client; a node's (its logs and metrics appended,
the ranks' progress, its alive documents, the heartbeat and stop it reads, results, and what the
ranks write through the job's store) are counted on the node's store client
(:meth:`prefect_sgpu.store.Store.request_counts`) and written to ``nodes/node-<i>.requests`` just
before the node's status, sealed with the job key (kind ``requests``, bound to the run, the node,
its instance and the gang). The driver reads it once, at release, and prices it with its own. The
figures become the job's shown cost, so a document that is unsealed, from another job, node or
gang, too large, or not of this shape counts as not reported (logged), never as a figure.

What a node does before its bootstrap takes over (the first stage of a bare image fetching the
environment) is not counted here: it goes through the stage's own transport, once per boot.
"""

from __future__ import annotations

import logging
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


__all__ = ["KINDS", "MAX_BYTES", "NodeRequests", "read", "requests_key", "write"]
