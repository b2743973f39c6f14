"""The sweeper as a Prefect flow (``prefect-sgpu-gc``), to deploy on a schedule.

    prefect deploy prefect_sgpu/adapters/sweep_flow.py:gc --name hourly --cron "0 * * * *" \
        --pool <any pool> --param compute_block=sgpu-ec2-compute/h100-pool

Each run sweeps one store (:mod:`prefect_sgpu.compute.remote.sweep`), logs every removal to the flow
run, publishes a table artifact (key ``prefect-sgpu-gc``) and fails when part of the
pass failed, so Prefect's automations and retries apply.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact


@flow(name="prefect-sgpu-gc")
def gc(compute_block: str | None = None, store_block: str | None = None, store: str | None = None,
       tracking_uri: str | None = None, dry_run: bool = False, grace_s: float | None = None) -> dict[str, Any]:
    """Sweep the store of a compute block (``sgpu-ec2-compute/name``, ``sgpu-local-compute/name``), of a
    store block (``sgpu-store/name``), or a local folder (``store``); default: the local job store."""
    from prefect.blocks.core import Block

    from prefect_sgpu.store import LocalStore
    from prefect_sgpu.compute.remote.sweep import sweeper
    from prefect_sgpu.observe.tracking import default_tracking_uri, mlflow_available

    compute = Block.load(compute_block).get_compute() if compute_block else None
    chosen = Block.load(store_block).get_store() if store_block else (LocalStore(store) if store else None)
    uri = tracking_uri or (default_tracking_uri() if mlflow_available() else None)
    report = sweeper(compute, chosen, uri, grace_s=grace_s).sweep(dry_run=dry_run)
    log = get_run_logger()
    for line in report.lines():
        log.info(line)
    shown = report.found if dry_run else report.removed
    create_table_artifact(
        [asdict(x) for x in shown] or [{"run_id": "", "kind": "", "name": "nothing to remove", "why": ""}],
        key="prefect-sgpu-gc", description="What the sweep " + ("would remove" if dry_run else "removed"),
    )
    if report.errors:
        raise RuntimeError("the sweep could not finish: " + "; ".join(report.errors))
    return report.as_dict()
