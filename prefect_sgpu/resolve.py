"""One resolver: a job spec and what the caller named -> the (compute, store) it runs on.

Used by every adapter (``@distributed``, ``run_script``, GPU tasks and the task runner,
the compat classes, ``@ray_launch``, the ``sgpu`` worker through its environment), so
the rules are the same everywhere and are checked before anything is spent:

1. compute: the one given (a compute object, a compute block, or ``"slug/name"`` of a
   saved block) > ``PREFECT_SGPU_COMPUTE`` (the work pool's block) >
   ``PREFECT_SGPU_REMOTE_COMPUTE`` for ``remote=True`` > local processes;
2. ``remote=True`` needs a compute that runs on other machines: eight H100s are never
   silently eight CPU processes here;
3. store: the one given > ``PREFECT_SGPU_STORE`` > the compute's own > a local folder,
   and the compute must be able to use it (an EC2 job's nodes only reach its S3 store).
"""

from __future__ import annotations

import os
from typing import Any

from prefect_sgpu.compute.base import Compute
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.spec import JobSpec
from prefect_sgpu.store import LocalStore, Store

COMPUTE_ENV = "PREFECT_SGPU_COMPUTE"
REMOTE_COMPUTE_ENV = "PREFECT_SGPU_REMOTE_COMPUTE"
STORE_ENV = "PREFECT_SGPU_STORE"


def _load_block(ref: str, what: str) -> Any:
    if "/" not in ref:
        raise SGPUConfigError(what, ref, "'<block-type-slug>/<block-name>', for example 'sgpu-ec2-compute/h100-pool'")
    from prefect.blocks.core import Block

    return Block.load(ref)


def _materialize(value: Any, kind: type, getter: str, field: str, allowed: str) -> Any:
    """``value`` itself, or what its block's ``getter`` builds (a saved block named ``slug/name`` is loaded)."""
    if isinstance(value, str):
        value = _load_block(value, field)
    if isinstance(value, kind):
        return value
    get = getattr(type(value), getter, None)  # a block of prefect_sgpu.blocks
    if get is None:
        raise SGPUConfigError(field, repr(value), allowed)
    result = get(value)
    assert isinstance(result, kind)
    return result


def as_compute(compute: Any, field: str = "compute") -> Compute:
    """A compute object from a compute, a compute block, or a saved block's ``slug/name``."""
    return _materialize(compute, Compute, "get_compute", field, "a compute block (LocalCompute, EC2Compute, "
                        "RayCompute), a saved block's '<slug>/<name>', or a prefect_sgpu.compute.Compute")


def as_store(store: Any, field: str = "store") -> Store:
    """A store object from a store, an ``SGPUStore`` block, or a saved block's ``slug/name``."""
    return _materialize(store, Store, "get_store", field, "an SGPUStore block, a saved block's '<slug>/<name>', "
                        "or a prefect_sgpu.store.Store")


def resolve_compute(spec: JobSpec, compute: Any | None = None) -> Compute:
    """The compute for ``spec`` (rules 1 and 2 above)."""
    source = "compute"
    if compute is None and os.environ.get(COMPUTE_ENV):
        compute, source = os.environ[COMPUTE_ENV], COMPUTE_ENV
    if compute is None and spec.remote and os.environ.get(REMOTE_COMPUTE_ENV):
        compute, source = os.environ[REMOTE_COMPUTE_ENV], REMOTE_COMPUTE_ENV
    if compute is None:
        if spec.remote:
            raise SGPUConfigError(
                "remote", True, "only with a remote compute",
                f"pass compute=EC2Compute.load('NAME') (or RayCompute), give the task runner or work pool one, "
                f"or set {REMOTE_COMPUTE_ENV}='<block-type-slug>/<block-name>'; remote=False runs on this machine",
            )
        from prefect_sgpu.compute.local import LocalProcessCompute

        return LocalProcessCompute()
    resolved = as_compute(compute, source)
    if spec.remote and not resolved.remote:
        raise SGPUConfigError(
            "remote", True, f"only with a remote compute, and the compute in use ({source}) is "
            f"{type(resolved).__name__}, which runs on this machine",
            "give an EC2Compute or RayCompute, or set remote=False to run here",
        )
    return resolved


def resolve_store(compute: Compute, store: Any | None = None) -> Store:
    """The store for ``compute`` (rule 3 above), checked to fit it."""
    if store is None and os.environ.get(STORE_ENV):
        store = os.environ[STORE_ENV]
    resolved = as_store(store) if store is not None else (compute.default_store() or LocalStore())
    compute.check_store(resolved)
    return resolved


def resolve(spec: JobSpec, compute: Any | None = None, store: Any | None = None) -> tuple[Compute, Store]:
    """(compute, store) for ``spec``, checked to fit each other. Spends nothing."""
    resolved = resolve_compute(spec, compute)
    return resolved, resolve_store(resolved, store)
