"""One run per run directory: a second `kvgate run` into a directory a run holds is refused, naming the holder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gates.run_claim import claim_run_dir
from kvcore.rundata import RUN_LOCK
from kvcore.settings import ConfigError


def test_a_second_claim_of_a_held_directory_is_refused_naming_the_run_that_holds_it(tmp_path):
    with claim_run_dir(tmp_path / "run", "first-run"):
        with pytest.raises(ConfigError, match=r"^--out: expected a directory no other run is using, found .* held by "
                                              rf"run first-run \(pid {os.getpid()} on "):
            claim_run_dir(tmp_path / "run", "second-run")
    with claim_run_dir(tmp_path / "run", "third-run") as claim:          # released: free again, nothing was written
        assert json.loads((claim.run_dir / RUN_LOCK).read_text())["run_id"] == "third-run"


def test_a_directory_a_run_wrote_into_is_refused_once_the_lock_is_free_and_a_resume_takes_it(tmp_path):
    with claim_run_dir(tmp_path / "run", "first-run"):
        (tmp_path / "run" / "run.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"holding files \(run.json\): another run wrote there"):
        claim_run_dir(tmp_path / "run", "second-run")
    with claim_run_dir(tmp_path / "run", "first-run", "--resume", new=False):   # the same run, resumed
        with pytest.raises(ConfigError, match=r"^--resume: expected a directory no other run is using"):
            claim_run_dir(tmp_path / "run", "first-run", "--resume", new=False)


def test_a_lock_a_killed_run_left_does_not_hold_the_directory(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from gates.run_claim import claim_run_dir; "
        f"claim = claim_run_dir({str(tmp_path / 'run')!r}, 'killed-run'); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"held by run killed-run \(pid {holder.pid} on "):
            claim_run_dir(tmp_path / "run", "next-run")
    finally:
        holder.kill()
        holder.wait()
    with claim_run_dir(tmp_path / "run", "next-run"):          # the kernel let the lock go with the process
        pass


def test_kvgate_run_into_a_directory_another_run_holds_exits_2_naming_it(tmp_path):
    with claim_run_dir(tmp_path / "run", "holding-run"):
        done = subprocess.run([sys.executable, "-m", "gates.cli", "run", "g1", "--out", str(tmp_path / "run")],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "held by run holding-run" in done.stderr and "give another --out" in done.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [RUN_LOCK]        # the refused run wrote nothing
