"""Test modules share code through helper modules under tests/ (servers.py, blocks.py, ...), never by importing
another test module or conftest.py: a test module is collected by pytest, not imported as a library."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imported_modules(path: Path) -> list[str]:
    """Every module `path` imports, relative imports written out from the tests package."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(part for part in ("tests" if node.level else "", node.module or "") if part)
            found += [base] + [f"{base}.{alias.name}" for alias in node.names]   # `from tests import test_x`
    return found


def _is_test_module(module: str) -> bool:
    parts = module.split(".")
    return len(parts) >= 2 and parts[0] == "tests" and (parts[-1].startswith("test_") or parts[-1] == "conftest")


def test_no_module_under_tests_imports_a_test_module_or_conftest():
    edges = sorted(f"{path.name} imports {module}" for path in TESTS.rglob("*.py")
                   for module in _imported_modules(path) if _is_test_module(module))
    assert edges == []


def test_the_rule_sees_each_way_of_importing_a_test_module(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import tests.cache_impl.test_keys\nfrom tests.kvcore.test_stats import x\n"
                     "from tests.reports import test_plots\nfrom .conftest import BLOCK\n"
                     "from tests.servers import REPO\nimport tests.blocks\n")
    assert [m for m in _imported_modules(probe) if _is_test_module(m)] == [
        "tests.cache_impl.test_keys", "tests.kvcore.test_stats", "tests.reports.test_plots", "tests.conftest"]
