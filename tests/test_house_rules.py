"""What the house keeps out of its code: references a user cannot look up (an issue's number)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ISSUE_NUMBER = re.compile(r"\bissues? ?#?\d+", re.IGNORECASE)   # the word, then a number (with "#" or not)
CHECKED = ("*.py", "*.yaml", "*.yml", "*.toml", "*.cfg", "*.sh", ".ci/run")


def issue_numbers(paths: list[Path]) -> list[str]:
    """"FILE:LINE: TEXT" for each line naming an issue by its number."""
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{n}: {line.strip()}"
            for path in paths for n, line in enumerate(path.read_text().splitlines(), 1) if ISSUE_NUMBER.search(line)]


def test_no_issue_numbers_in_the_code_the_tests_or_the_examples():
    files = subprocess.run(["git", "ls-files", *CHECKED], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    assert files, "git ls-files found nothing to check"
    assert issue_numbers([ROOT / f for f in files]) == []


def test_the_check_finds_an_issue_number(tmp_path):
    sample = tmp_path / "controls.py"
    named = "iss" + "ue 22 §4"                     # spelled apart, so this file passes its own check
    sample.write_text(f'KEY = "a-aa-mock"   # the letter of {named}\nISSUE_FAULTS = []  # no number here\n')
    assert issue_numbers([sample]) == [f'{sample}:1: KEY = "a-aa-mock"   # the letter of {named}']
