"""A Prefect global concurrency limit that exists only for the length of a test."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


@contextmanager
def global_limit(name: str, limit: int) -> Iterator[str]:
    """Create ``name`` with ``limit`` slots on the current Prefect API (one an earlier run left is
    replaced); delete it on the way out. Yields the name."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.delete_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            pass
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
    try:
        yield name
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(name)
