"""``ShardSet``: the small description of a complete shard set that GPU tasks take as input.

It has a module of its own, importing nothing but pydantic, because ranks unpickle it
and must not pay for streaming, Prefect or boto3 to do so.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ShardSet(BaseModel):
    """A complete MDS shard set: where it is and what it holds. Cheap to pickle."""

    model_config = ConfigDict(frozen=True)

    uri: str
    rows: int
    shards: int
    columns: dict[str, str]
    fingerprint: str | None
    compression: str | None

    def __str__(self) -> str:
        return self.uri


# Pickles name a class by its module: Prefect persists prepare_mds results, so they keep
# naming the public package (as before it was split into files), not this file.
ShardSet.__module__ = "prefect_sgpu.pipeline.mds"
