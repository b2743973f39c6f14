"""Every job shape the README and docs show is one the library accepts.

Each ``@distributed(...)``, ``@gpu_task(...)``, ``@ray_launch(...)``, ``GPUTaskRunner(...)`` and
``.with_options(...)`` written in them (code blocks, comments and inline code alike) is parsed, its
literal job settings go through the same validation a call does, and a shape that names a
``gpu_type`` must split into whole instances of the catalog, as it would when launched remotely.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from prefect_sgpu import spec
from prefect_sgpu.errors import SGPUConfigError

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CALLS = re.compile(r"(@distributed|@gpu_task|@ray_launch|GPUTaskRunner|\.with_options)\(")


def _arguments(text: str, start: int) -> str | None:
    """The text between the parenthesis at ``start`` and its match; None when it does not close."""
    depth = 0
    for index in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[index], 0)
        if depth == 0:
            return text[start + 1:index]
    return None


def _examples() -> list[tuple[str, str, dict]]:
    found = []
    for document in DOCUMENTS:
        text = document.read_text()
        for match in CALLS.finditer(text):
            inner = _arguments(text, match.end() - 1)
            if inner is None or "..." == inner.strip():
                continue
            try:
                call = ast.parse(f"f({inner})", mode="eval").body
            except SyntaxError:
                continue  # prose such as "GPUTaskRunner(...)" with words inside
            settings = {}
            for keyword in call.keywords:
                if keyword.arg in spec.FIELDS:
                    try:
                        value = ast.literal_eval(keyword.value)
                    except ValueError:
                        continue  # a name or an expression: nothing to check statically
                    if value is not Ellipsis:  # "environment=..." in prose
                        settings[keyword.arg] = value
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{document.name}:{line}", f"{match.group(1)}({inner})", settings))
    return found


EXAMPLES = _examples()


def _validate(settings: dict) -> spec.Plan:
    job = spec.merge(spec.layer("example", **settings))
    if job.gpu_type is not None:
        return spec.plan_remote(job)
    return spec.plan_local(job, local_gpus=0)


def test_the_documents_show_every_kind_of_call() -> None:
    kinds = {call.split("(")[0] for _, call, _ in EXAMPLES}
    assert kinds >= {"@distributed", "@gpu_task", "@ray_launch", "GPUTaskRunner", ".with_options"}, kinds
    assert sum(1 for _, _, settings in EXAMPLES if settings.get("gpu_type")) >= 5


@pytest.mark.parametrize("where, call, settings", EXAMPLES, ids=[where for where, _, _ in EXAMPLES])
def test_each_example_validates(where: str, call: str, settings: dict) -> None:
    try:
        plan = _validate(settings)
    except SGPUConfigError as exc:
        pytest.fail(f"{where}: {call} is refused: {exc}")
    assert plan.world_size == settings.get("gpus", 1)


def test_the_check_refuses_a_shape_no_instance_of_the_gpu_type_has() -> None:
    # A10 instances carry 1, 4 or 8 GPUs: 2 nodes x 2 GPUs is none of them
    with pytest.raises(SGPUConfigError, match=r"gpus=4 is not allowed.*\[1, 4, 8\] GPUs per node"):
        _validate({"gpus": 4, "nodes": 2, "gpu_type": "A10", "remote": True})


def _first_job() -> str:
    found = re.search(r"<!-- ten-lines:begin -->\s*```python\n(.*?)```\s*<!-- ten-lines:end -->",
                      (ROOT / "README.md").read_text(), re.S)
    assert found, "README.md has no first-job block (ten-lines markers)"
    return found.group(1)


def test_the_readmes_first_job_runs_as_written(prefect_server: None, tmp_path: Path) -> None:
    """Saved as a file and run with Python against the suite's Prefect server: it prints what its comment says."""
    import os
    import subprocess
    import sys

    from prefect.settings import PREFECT_API_URL

    code = _first_job()
    script = tmp_path / "hello.py"
    script.write_text(code)
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    promised = re.search(r"print\(hello\(\)\)\s*#\s*(\[.*\])", code).group(1)
    assert done.stdout.strip().splitlines()[-1] == promised, done.stdout[-2000:]


def _ec2_section_blocks() -> list[tuple[str, str]]:
    """The README's "A first EC2 job" code blocks, (language, dedented text)."""
    import textwrap

    text = (ROOT / "README.md").read_text()
    start = text.index("## A first EC2 job")
    end = text.index("\n## ", start + 1)
    blocks = re.findall(r"^( *)```(\w+)\n(.*?)^\1```", text[start:end], re.S | re.M)
    return [(language, textwrap.dedent(body)) for _, language, body in blocks]


def test_the_readmes_ec2_section_is_aws_setups_path_with_the_same_commands() -> None:
    """setup aws -> block -> doctor -> first job: every command and code block of the README's EC2
    section is written, verbatim, in docs/aws-setup.md's steps, in the same order."""
    guide = (ROOT / "docs" / "aws-setup.md").read_text()
    blocks = _ec2_section_blocks()
    assert [language for language, _ in blocks] == ["bash", "python", "bash", "python"], blocks
    at = 0
    for language, body in blocks:
        pieces = [line for line in body.splitlines() if line.strip()] if language == "bash" else [body]
        for piece in pieces:
            found = guide.find(piece, at)
            assert found >= 0, f"not in docs/aws-setup.md after offset {at}: {piece!r}"
            at = found
    assert "prefect-sgpu setup aws" in blocks[0][1] and "prefect-sgpu doctor" in blocks[2][1]
