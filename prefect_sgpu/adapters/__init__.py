"""What users import: the decorators, the Prefect task runner, blocks, the work pool, compat classes.

Thin by design: each adapter turns its caller's arguments into a validated ``JobSpec``,
resolves compute and store through :mod:`prefect_sgpu.resolve`, and hands a job to the
driver. Nothing here talks to a compute directly.
"""
