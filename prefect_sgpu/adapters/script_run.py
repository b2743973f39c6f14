"""``prefect-sgpu run``: a script launched on every rank from a shell, as torchrun does, inside a flow run.

The script runs unmodified (``torchrun``'s environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``...) as the one GPU task of a flow run named ``prefect-sgpu-run``: the GPU quota
(``gpu:<type>``), the ``prefect-sgpu.job.*`` events, the progress and the artifacts, the rank logs
and the MLflow run are those of a ``@gpu_task``. Prefect is imported here only, when the command runs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from prefect_sgpu.protocol import payload as payload_mod
from prefect_sgpu import spec as spec_mod
from prefect_sgpu.adapters.task_runner import run_gpu_call

FLOW_NAME = "prefect-sgpu-run"


@task(name="sgpu-script", task_run_name="{name}", cache_policy=NO_CACHE, persist_result=False)
def script_task(name: str, path: str, argv: list[str], given: dict[str, Any]) -> None:
    """The script on every rank: raises (the rank's exit code, its output) when any rank exits non-zero."""
    source = Path(path).read_bytes()
    call = payload_mod.ScriptCall(path, source, list(argv))
    digest = hashlib.sha256(source + b"\0" + "\0".join(argv).encode()).hexdigest()[:12]
    run_gpu_call(call, spec_mod.layer("task", **given), digest, name)


@flow(name=FLOW_NAME, flow_run_name="{name}", log_prints=True, validate_parameters=False)
def script_flow(name: str, path: str, argv: list[str], given: dict[str, Any]) -> None:
    """One flow run holding the script's job (its task run carries the job's GPU options)."""
    script_task(name, path, argv, given)


def run(path: str, argv: list[str], given: dict[str, Any]) -> None:
    """Check the script and the options (nothing starts when either is wrong), then run the flow."""
    from prefect_sgpu.errors import SGPUConfigError

    script = Path(path)
    if not script.is_file() or script.suffix != ".py":
        raise SGPUConfigError("script", path, "an existing Python file (*.py)")
    spec_mod.build(spec_mod.layer("task", **given))  # every field checked before a flow run exists
    script_flow(script.name, str(script.resolve()), list(argv), given)
