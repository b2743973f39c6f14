"""How long nodes wait for a silent driver: the heartbeat TTL both sides read.

A node stops itself when the driver's heartbeat has not moved for its TTL; a sweeper judges a run
dead by the same TTL. Nodes of this machine (the local compute) and a sweeper of a store with no
cloud of its own read it here, below both the driver (which beats the heartbeat) and the computes.
"""

from __future__ import annotations

import os

#: the heartbeat TTL of nodes on this machine, in seconds (the local compute's; a sweeper of a local store's)
HEARTBEAT_TTL_ENV = "PREFECT_SGPU_HEARTBEAT_TTL"


def local_heartbeat_ttl() -> float:
    """Seconds without a driver heartbeat after which nodes on this machine stop themselves, and after
    which a sweeper of a store with no cloud of its own judges a run dead (plus its grace)."""
    return float(os.environ.get(HEARTBEAT_TTL_ENV, 60.0))
