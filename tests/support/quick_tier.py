"""``./dev test --quick``: the inner loop's tier, and which of the package's modules it touched.

The tier is every test not marked ``e2e`` plus the end-to-end tests marked ``quick`` (one short
job per compute and per entry point). After the run, each test process (each xdist worker, or the
one process) writes the ``prefect_sgpu`` modules it imported to a folder of the session, and the
summary names every module of the package no quick test imported, so a module that only the long
tier reaches is seen. Modules imported only by the processes a test starts (ranks, simulated nodes)
do not count: the tier's own process must reach them.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "prefect_sgpu"
#: the folder the test processes of one session write their imported modules to
FOLDER_ENV = "SGPU_QUICK_MODULES_DIR"


def package_modules() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def add_option(parser: pytest.Parser) -> None:
    parser.addoption("--quick", action="store_true", default=False,
                     help="the inner loop's tier: tests not marked e2e, and the e2e tests marked quick")


def select(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the long end-to-end tests under ``--quick``."""
    if not config.getoption("quick"):
        return
    keep, drop = [], []
    for item in items:
        long = item.get_closest_marker("e2e") and not item.get_closest_marker("quick")
        (drop if long else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def configure(config: pytest.Config) -> None:
    if not config.getoption("quick"):
        return
    if not hasattr(config, "workerinput"):  # the controller (or the one process) names the folder
        os.environ[FOLDER_ENV] = tempfile.mkdtemp(prefix="sgpu-quick-")
    config.pluginmanager.register(ModulesTouched(), "sgpu-quick-modules")


class ModulesTouched:
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        folder = os.environ.get(FOLDER_ENV)
        if folder:
            imported = sorted(m for m in sys.modules if m == "prefect_sgpu" or m.startswith("prefect_sgpu."))
            Path(folder, f"modules-{os.getpid()}.json").write_text(json.dumps(imported))

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if hasattr(terminalreporter.config, "workerinput"):
            return
        folder = os.environ.get(FOLDER_ENV)
        if not folder:
            return
        touched: set[str] = set()
        for path in Path(folder).glob("modules-*.json"):
            touched |= set(json.loads(path.read_text()))
        every = package_modules()
        untouched = sorted(every - touched)
        terminalreporter.section("modules the quick tier touched")
        terminalreporter.write_line(f"{len(every) - len(untouched)} of {len(every)} modules of prefect_sgpu "
                                    "imported by the quick tier's test processes")
        for name in untouched:
            terminalreporter.write_line(f"  not touched: {name}")
