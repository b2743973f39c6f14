"""What the ``sgpu`` work pool's job variables mean, checked when the worker prepares a flow run.

A deployment (or a flow run, or the pool itself) names the compute and store blocks of
its GPU tasks and may give GPU-task defaults. Everything here runs in the worker before
the flow run's process exists, so a typo in a block name or an unknown GPU type ends
the run as Crashed with an :class:`~prefect_sgpu.errors.SGPUConfigError` naming the job
variable, its value and what is allowed, never at the first GPU task.

The flow run receives what was checked through its environment: the blocks as
``PREFECT_SGPU_COMPUTE`` / ``PREFECT_SGPU_STORE`` (``'<block-type-slug>/<block-name>'``)
and the GPU defaults as ``PREFECT_SGPU_<FIELD>``, the layer that
:func:`prefect_sgpu.spec.environment_layer` reads.
"""

from __future__ import annotations

import re
from typing import Any, Mapping
from uuid import UUID

from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.spec import ENV_PREFIX

COMPUTE_SLUGS = ("sgpu-local-compute", "sgpu-ec2-compute", "sgpu-ray-compute")
STORE_SLUGS = ("sgpu-store",)
#: job variables that become the flow run's GPU-task defaults (fields of ``JobSpec``)
GPU_DEFAULTS = ("gpus", "gpu_type", "nodes", "strategy", "max_recoveries", "hang_timeout", "straggler_factor",
                "straggler_steps", "gang_check", "environment", "max_cost_usd")
_PLACEHOLDER = re.compile(r"^\{\{\s*prefect\.blocks\.([^.\s]+)\.([^.\s]+)\s*\}\}$")


def slug_pattern(slugs: tuple[str, ...]) -> str:
    """JSON-schema pattern of the string form, so the server refuses a wrong block type at deploy time."""
    return "^$|^(" + "|".join(re.escape(s) for s in slugs) + r")/[^/\s]+$"


def _allowed(slugs: tuple[str, ...]) -> str:
    return (f"a saved block of type {' or '.join(slugs)}: picked in the UI, or written as "
            f"'<block-type-slug>/<block-name>' (for example '{slugs[0]}/my-block')")


def variables_with_defaults(base_job_template: Mapping[str, Any],
                            values: Mapping[str, Any]) -> dict[str, Any]:
    """The job variables in effect: the pool's defaults under the deployment's and flow run's values."""
    props = (base_job_template.get("variables") or {}).get("properties") or {}
    merged = {name: attrs["default"] for name, attrs in props.items()
              if isinstance(attrs, dict) and attrs.get("default") is not None}
    merged.update({k: v for k, v in values.items() if "." not in k})
    return merged


async def block_reference(client: Any, field: str, raw: Any, slugs: tuple[str, ...]) -> str | None:
    """``'<slug>/<name>'`` of the saved block ``raw`` names; SGPUConfigError when it is not one.

    ``raw`` is what a deployment holds: ``{"$ref": {"block_document_id": ...}}`` (the UI's
    block picker), the string ``'<slug>/<name>'``, or ``'{{ prefect.blocks.<slug>.<name> }}'``.
    """
    from prefect.exceptions import ObjectNotFound

    if raw is None or raw == "":
        return None
    if isinstance(raw, dict) and isinstance(raw.get("$ref"), dict):
        doc_id = raw["$ref"].get("block_document_id")
        try:
            doc = await client.read_block_document(UUID(str(doc_id)), include_secrets=False)
        except (ObjectNotFound, ValueError):
            raise SGPUConfigError(field, f"block document {doc_id}", _allowed(slugs),
                                  "no such block document exists on this server (was it deleted?)") from None
        slug = doc.block_type.slug if doc.block_type else doc.block_type_name
        if slug not in slugs:
            raise SGPUConfigError(field, f"{slug}/{doc.name}", _allowed(slugs))
        if doc.is_anonymous or not doc.name:
            raise SGPUConfigError(field, f"block document {doc_id}", _allowed(slugs),
                                  "it is an unnamed block: save it under a name")
        return f"{slug}/{doc.name}"
    if not isinstance(raw, str):
        shown = f"a {type(raw).__name__}" if isinstance(raw, dict) else raw
        raise SGPUConfigError(field, shown, _allowed(slugs), "block values written inline are not handed to "
                              "flow runs; name a saved block")
    placeholder = _PLACEHOLDER.match(raw.strip())
    slug, _, name = (placeholder.group(1), "/", placeholder.group(2)) if placeholder else raw.partition("/")
    if slug not in slugs or not name or "/" in name:
        raise SGPUConfigError(field, raw, _allowed(slugs))
    try:
        await client.read_block_document_by_name(name=name, block_type_slug=slug, include_secrets=False)
    except ObjectNotFound:
        raise SGPUConfigError(field, raw, _allowed(slugs), f"no {slug} block named {name!r} is saved on "
                              "this Prefect server: save it first (python blocks/save_blocks.py) or fix "
                              "the name") from None
    return f"{slug}/{name}"


def gpu_defaults(variables: Mapping[str, Any]) -> dict[str, Any]:
    """The GPU-task defaults the job variables give, validated as a spec layer.

    An invalid one raises SGPUConfigError naming the job variable.
    """
    from prefect_sgpu import spec

    given = {name: variables[name] for name in GPU_DEFAULTS if variables.get(name) not in (None, "")}
    try:
        return spec.layer("work pool job variables", **given).given()
    except SGPUConfigError as exc:
        raise SGPUConfigError(f"job variable {exc.field}", exc.value, exc.allowed,
                              "(a job variable of the deployment, flow run or sgpu work pool)") from None


def gpu_defaults_env(defaults: Mapping[str, Any]) -> dict[str, str]:
    """``PREFECT_SGPU_<FIELD>`` for each validated default, as the environment layer parses it back
    (``environment`` as :func:`prefect_sgpu.environment.option_text` writes it)."""
    from prefect_sgpu.environment import option_text

    return {ENV_PREFIX + name.upper(): option_text(value) if name == "environment" else str(value)
            for name, value in defaults.items() if value is not None}
