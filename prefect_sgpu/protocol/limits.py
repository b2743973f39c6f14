"""The largest sealed document of each kind the job folder reads, checked before it is read.

Whoever writes the store (a rank, a node, anyone holding a store writer's rights) chooses a
document's size; the reader's memory must not. A control document (heartbeat, stop, a node's
status, ...) is a few KiB; one above its limit is refused as not this job's own, with its key,
its kind and the limit named, after reading at most ``limit + 1`` bytes. Kinds that carry the
user's own data (the payload, results, checkpoints, environment packs) have the user's sizes and
no limit here.
"""

from __future__ import annotations

from typing import Any

from prefect_sgpu.errors import DocumentRefused

#: bytes a control document of each kind may hold (sealed: body, binding and MAC)
CONTROL_LIMIT = 1024 * 1024
LIMITS: dict[str, int] = {kind: CONTROL_LIMIT for kind in (
    "heartbeat", "stop", "alive", "notice", "status", "assign", "rejoin")}
#: a launch bundle holds a sealed document per node
LIMITS["launch"] = 64 * CONTROL_LIMIT


def read_document(store: Any, run_id: str, key: str, kind: str) -> bytes | None:
    """The document's bytes (None when it is not there); raises DocumentRefused when it is larger
    than its kind's limit, having read no more than the limit."""
    limit = LIMITS.get(kind)
    if limit is None:
        return store.get(run_id, key)
    data, whole = store.get_at_most(run_id, key, limit)
    if not whole:
        raise DocumentRefused(f"{ascii(key)} ({kind}) is larger than the {limit} bytes a {kind} document may hold: "
                              "not read")
    return data
