"""The suite's own imports, read from its source: a name one test file takes from another file of the
suite exists there, wherever the import statement stands (an import inside a test function is only
run when that test runs, so a renamed helper would otherwise fail one long test at the end of a run),
and no test file takes another test module's private names (shared helpers live in ``support/``).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _defined(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            names |= _defined(ast.Module(body=node.body + getattr(node, "orelse", []), type_ignores=[]))
    return names


def _suite_file(module: str) -> Path | None:
    path = TESTS.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_every_name_taken_from_another_file_of_the_suite_is_there_and_public_in_test_modules() -> None:
    problems = []
    defined: dict[Path, set[str]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            target = _suite_file(node.module)
            if target is None:
                continue
            if target not in defined:
                defined[target] = _defined(ast.parse(target.read_text(), str(target)))
            where = f"{path.relative_to(TESTS)}:{node.lineno}"
            for alias in node.names:
                submodule = target.name == "__init__.py" and _suite_file(f"{node.module}.{alias.name}")
                if alias.name != "*" and alias.name not in defined[target] and not submodule:
                    problems.append(f"{where}: {node.module} has no {alias.name!r}")
                if target.name.startswith("test_") and alias.name.startswith("_"):
                    problems.append(f"{where}: takes the private {alias.name!r} of the test module "
                                    f"{node.module}; shared helpers belong in support/")
    assert not problems, "\n".join(problems)


def test_the_suites_group_hook_runs_before_xdists_reads_the_groups() -> None:
    """``conftest.pytest_collection_modifyitems`` adds the Ray group's marker; xdist names a grouped
    test ``…@group`` in its own hook, so ours must run first (``tryfirst``). Without it every worker
    refuses its collection (``pytest_collection_finish``) and xdist reports an INTERNALERROR. Read
    from the source: a worker's ``conftest`` module may be another folder's."""
    tree = ast.parse((TESTS / "conftest.py").read_text())
    (hook,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "pytest_collection_modifyitems"]
    assert any(isinstance(d, ast.Call) and ast.unparse(d.func) == "pytest.hookimpl"
               and any(k.arg == "tryfirst" and ast.literal_eval(k.value) is True for k in d.keywords)
               for d in hook.decorator_list), "pytest_collection_modifyitems lost @pytest.hookimpl(tryfirst=True)"
