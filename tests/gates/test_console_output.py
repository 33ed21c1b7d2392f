"""What `kvgate run` writes where people look, as a real run writes it to a pipe: text from a target made
printable on the console and in junit.xml (an ESC or a NUL in a /v1/models id shown as its escape, a "[/x]"
shown, not read as markup), and each line whole when the output is not a terminal (no wrap at 80 columns)."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml

from kvcore.printable import printable
from tests.servers import REPO, free_port

HOSTILE = "evil\x1b[31mRED\x00\x01\x02\x03\x04\x05\x06\x07\x08[/x]\x9b\ud800model"
SHOWN = "evil\\x1b[31mRED\\x00\\x01\\x02\\x03\\x04\\x05\\x06\\x07\\x08[/x]\\x9b\\ud800model"


def _kvgate_run_g3(tmp_path: Path, url: str, out: Path) -> subprocess.CompletedProcess:
    """`kvgate run g3` against `url` as both targets, its stdout and stderr pipes (not a terminal)."""
    config = {"targets": {"kind": "external", "baseline": {"url": url, "model": "m"},
                          "candidate": {"url": url, "model": "m"}},
              "storage": {"path": str(tmp_path / "storage")}}
    (tmp_path / "gates.yaml").write_text(yaml.safe_dump(config))
    return subprocess.run([sys.executable, "-m", "gates.cli", "run", "g3", "--config", str(tmp_path / "gates.yaml"),
                           "--out", str(out)], cwd=REPO, capture_output=True, timeout=120)


def test_printable_escapes_controls_and_lone_surrogates_and_keeps_tab_newline_and_text():
    assert printable(HOSTILE) == SHOWN
    assert printable("a\tb\nc é ✓ “q”") == "a\tb\nc é ✓ “q”"
    assert printable("\r\x7f\x0b") == "\\x0d\\x7f\\x0b"


def test_a_hostile_model_id_reaches_the_console_and_junit_as_escapes_and_junit_parses(tmp_path, answering):
    url = answering([HOSTILE])
    run = _kvgate_run_g3(tmp_path, url, tmp_path / "run")
    stdout, stderr = run.stdout.decode("utf-8"), run.stderr.decode("utf-8")
    assert run.returncode == 2, stdout + stderr
    for text in (stdout, stderr):
        assert "\x1b" not in text and "\x00" not in text and "Traceback" not in text
    assert f"pre-flight FAILED baseline {url}: model 'm' not served (serves: {SHOWN})" in stdout
    assert f"kvgate run: pre-flight failed: baseline {url}: model 'm' not served (serves: {SHOWN})" in stderr
    junit = ET.parse(tmp_path / "run" / "junit.xml").getroot()            # parses: no raw control character
    g3 = next(suite for suite in junit.iter("testsuite") if suite.get("name").startswith("g3"))
    assert SHOWN in g3.find("testcase/skipped").get("message")
    assert "(serves: evil" in (tmp_path / "run" / "index.html").read_text(encoding="utf-8")


def test_console_lines_written_to_a_pipe_are_not_broken_at_80_columns(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    out = tmp_path / ("a-run-directory-with-a-name-long-enough-to-pass-eighty-columns-on-its-own" * 2)
    run = _kvgate_run_g3(tmp_path, dead, out)
    lines = run.stdout.decode("utf-8").splitlines()
    assert run.returncode == 2
    assert lines[0].startswith("kvgate run ") and lines[0].endswith(f"→ {out}")
    overall = next(line for line in lines if line.startswith("overall: "))
    assert overall.endswith(f"candidate {dead}: connection refused — G3 not run")
    assert any(line == f"  pre-flight FAILED baseline {dead}: connection refused" for line in lines)
