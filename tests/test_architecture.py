"""The package's shape, read from its own source: the rules of docs/architecture.md, checked.

Every import statement of ``prefect_sgpu/`` (at a module's top or inside a function alike) is an
arrow from one module to another. The rules:

- no circles between modules;
- nothing under ``compute/`` imports ``launch/`` (the driver's side never imports the node's);
- a module whose name does not say which cloud it serves imports nothing whose name does, nor
  boto3/botocore, and holds none of AWS's wire protocol (the composing ``adapters/blocks.py`` and
  ``cli.py`` may name every cloud);
- no module imports another module's private (``_``) name;
- no file over 600 lines; at most 12 modules at the package's top level;
- docs/architecture.md names every module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "prefect_sgpu"
#: where a name says the module serves AWS
AWS_NAMED = re.compile(r"(^|[./_])(aws|ec2|s3)([./_]|$)")
#: modules that compose every cloud (what users configure), exempt from the seam rule
COMPOSERS = {"prefect_sgpu.adapters.blocks", "prefect_sgpu.cli"}
#: AWS's wire protocol, as it would appear in code that speaks it
WIRE = re.compile(r"169\.254\.169\.254|/latest/meta-data|/latest/api/token|AWS4-HMAC-SHA256|"
                  r"X-Amz-Target|AmazonSSM\.|x-amz-security-token", re.I)


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str | None]]:
    """(module imported, name imported from it or None) for every import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.append((full, None) if full in MODULES else (base, alias.name))
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        targets = set()
        for module, _ in _imports(name, path):
            while module and module not in MODULES and "." in module:
                module = module.rpartition(".")[0]
            if module in MODULES and module != name:
                targets.add(module)
        graph[name] = targets
    return graph


def _aws_named(name: str) -> bool:
    return bool(AWS_NAMED.search(name.removeprefix("prefect_sgpu.")))


def test_no_circles_between_modules() -> None:
    graph = _graph()
    # a package's __init__ re-exporting its own modules is not a circle of meaning
    edges = {m: {t for t in ts if not (m.startswith(t + ".") and MODULES[t].name == "__init__.py")}
             for m, ts in graph.items()}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert cycles == [], f"modules that import each other, directly or in a circle: {cycles}"


def test_the_driver_side_never_imports_the_node_side() -> None:
    wrong = sorted((m, t) for m, ts in _graph().items() if m.startswith("prefect_sgpu.compute")
                   for t in ts if t.startswith("prefect_sgpu.launch"))
    assert wrong == [], wrong


def test_only_modules_named_for_aws_know_aws() -> None:
    wrong = []
    for name, path in MODULES.items():
        if _aws_named(name) or name in COMPOSERS:
            continue
        for module, _ in _imports(name, path):
            top = module.split(".")[0]
            if top in ("boto3", "botocore") or (module.startswith("prefect_sgpu") and _aws_named(module)):
                wrong.append(f"{name} imports {module}")
        if WIRE.search(path.read_text(encoding="utf-8")):
            wrong.append(f"{name} holds AWS's wire protocol ({WIRE.search(path.read_text()).group(0)})")
    assert wrong == [], "\n".join(wrong)


def test_no_module_imports_another_modules_private_names() -> None:
    wrong = [f"{name} imports {module}.{imported}" for name, path in MODULES.items()
             for module, imported in _imports(name, path)
             if imported and imported.startswith("_") and not imported.startswith("__")
             and module.startswith("prefect_sgpu")]
    assert wrong == [], "\n".join(wrong)


def test_files_stay_small_and_the_top_level_shows_the_architecture() -> None:
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600}
    assert long == {}, long
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top


def _named_in(text: str) -> set[str]:
    """Module paths a document names: written whole (``launch/node_env.py``), or in the module table
    as a package row (``| launch/ | `node_env.py`, `stage_uv.py` | ...``; ``top`` for the package's root)."""
    named = set(re.findall(r"[A-Za-z0-9_/]+\.py", text))
    for row in re.finditer(r"^\| *(top|[a-z0-9_/]+/) *\| *([^|]+)\|", text, re.M):
        folder = "" if row.group(1) == "top" else row.group(1)
        named.add(folder + "__init__.py")  # a package with a row of its own is named
        named |= {folder + name for name in re.findall(r"`([a-z0-9_]+\.py)`", row.group(2))}
        named |= {folder + name + "/__init__.py" for name in re.findall(r"`([a-z0-9_]+)/`", row.group(2))}
    return named


def test_the_architecture_doc_names_every_module() -> None:
    named = _named_in((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    missing = [rel for rel in (str(p.relative_to(PACKAGE)) for p in MODULES.values())
               if rel not in named and not (rel.endswith("/__init__.py") and rel[: -len("__init__.py")] in named)]
    assert missing == [], f"docs/architecture.md does not name: {missing}"


def test_a_moved_module_still_imports_from_its_old_place_with_a_warning() -> None:
    import importlib
    import sys
    import warnings

    import prefect_sgpu

    for old, new in prefect_sgpu.MOVED.items():
        sys.modules.pop(f"prefect_sgpu.{old}", None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(f"prefect_sgpu.{old}")
        assert module is importlib.import_module(f"prefect_sgpu.{new}"), old
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught), old
        sys.modules.pop(f"prefect_sgpu.{old}", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from prefect_sgpu.driver import Job
    from prefect_sgpu.driver.job import Job as moved

    assert Job is moved and any("prefect_sgpu.driver.job" in str(w.message) for w in caught)
