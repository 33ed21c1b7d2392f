"""What the house keeps out of its code: references a user cannot look up (an issue's number)."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ISSUE_NUMBER = re.compile(r"\bissues? ?#?\d+", re.IGNORECASE)   # the word, then a number (with "#" or not)
CHECKED = ("*.py", "*.yaml", "*.yml", "*.toml", "*.cfg", "*.sh", ".ci/run")
ROOMS = ("kvcore", "cache_impl", "workloads", "sizing", "engines", "reports", "gates")
MAX_DOCSTRING_LINES = 14          # what a module is for and its interface; a method's write-up goes to docs/methods/
METHOD_PAGE = re.compile(r"docs/methods/([a-z-]+\.md) \(([\w/.]+)\)")


def _tracked(*patterns: str) -> list[str]:
    return subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()


def docstring_findings(root: Path, modules: list[str]) -> list[str]:
    """"MODULE: WHY" for a module docstring over MAX_DOCSTRING_LINES lines, or pointing to a methods page that is
    missing or has no section for the module."""
    found = []
    for rel in modules:
        doc = ast.get_docstring(ast.parse((root / rel).read_text()), clean=False) or ""
        if len(doc.splitlines()) > MAX_DOCSTRING_LINES:
            found.append(f"{rel}: a docstring of {len(doc.splitlines())} lines (at most {MAX_DOCSTRING_LINES})")
        for page, named in METHOD_PAGE.findall(doc):
            path = root / "docs" / "methods" / page
            if not path.exists():
                found.append(f"{rel}: points to docs/methods/{page}, which does not exist")
            elif f"## `{named}`" not in path.read_text():
                found.append(f"{rel}: docs/methods/{page} has no section for {named}")
    return found


def issue_numbers(paths: list[Path]) -> list[str]:
    """"FILE:LINE: TEXT" for each line naming an issue by its number."""
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{n}: {line.strip()}"
            for path in paths for n, line in enumerate(path.read_text().splitlines(), 1) if ISSUE_NUMBER.search(line)]


def test_no_issue_numbers_in_the_code_the_tests_or_the_examples():
    files = _tracked(*CHECKED)
    assert files, "git ls-files found nothing to check"
    assert issue_numbers([ROOT / f for f in files]) == []


def test_the_check_finds_an_issue_number(tmp_path):
    sample = tmp_path / "controls.py"
    named = "iss" + "ue 22 §4"                     # spelled apart, so this file passes its own check
    sample.write_text(f'KEY = "a-aa-mock"   # the letter of {named}\nISSUE_FAULTS = []  # no number here\n')
    assert issue_numbers([sample]) == [f'{sample}:1: KEY = "a-aa-mock"   # the letter of {named}']


def test_module_docstrings_are_short_and_their_method_pages_exist():
    modules = [f for f in _tracked("*.py") if f.split("/")[0] in ROOMS]
    assert len(modules) > 100
    assert docstring_findings(ROOT, modules) == []


def test_the_docstring_check_finds_an_essay_and_a_dangling_page(tmp_path):
    (tmp_path / "docs" / "methods").mkdir(parents=True)
    (tmp_path / "docs" / "methods" / "pairs.md").write_text("# Pairs\n\n## `gates/other.py`\n")
    (tmp_path / "essay.py").write_text('"""' + "A line.\n" * 20 + '"""\n')
    (tmp_path / "short.py").write_text('"""Pairs.\n\nHow it works: docs/methods/pairs.md (short.py)."""\n')
    (tmp_path / "gone.py").write_text('"""Gone.\n\nHow it works: docs/methods/gone.md (gone.py)."""\n')
    assert docstring_findings(tmp_path, ["essay.py", "short.py", "gone.py"]) == [
        "essay.py: a docstring of 20 lines (at most 14)",
        "short.py: docs/methods/pairs.md has no section for short.py",
        "gone.py: points to docs/methods/gone.md, which does not exist"]


def test_cis_tests_are_the_readmes_command_and_the_slow_ones_it_leaves_out():
    """.ci/run runs the README's test command verbatim, then the tests that command leaves out (marked slow):
    together every test, each once."""
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    command = re.search(r"Run the tests:\n\n```sh\n(.+)\n```", readme)
    assert command and command.group(1) == 'python3 -m pytest -q -m "not slow"'
    runs = [line.strip() for line in ci.splitlines() if line.strip().startswith("python3 -m pytest")]
    assert runs == [command.group(1), "python3 -m pytest -q -m slow"]
