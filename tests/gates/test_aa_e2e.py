"""`kvgate run g2 g3 --aa` from the command line: every side-by-side figure measured against itself, counted.

G2's cold read, model load and checkpoint write put the storage's best job on both sides of every pair;
G3's baseline role is the candidate's own server. Each gate records one A/A row per interval
(kvcore.aa) and the console says how many excluded the null: the harness's own false decisions.
"""

import contextlib
import io
import shutil

import pytest
import yaml

from gates.cli import main
from kvcore.aa import AA_FALSE_DECISION, G2_AA_FALSE_DECISION, false_decisions
from kvcore.rundata import RunStore
from tests.servers import TINY_SWEEP

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (Debian package 'fio')")]

AA = {
    "profile": "quick",
    "targets": {"embedded": {"preset": "tiny", "max_running": 3, "device_capacity_blocks": 8,
                             "host_capacity": "64MiB", "disk_capacity": "256MiB"}},
    "fio": {"size": "32M", "runtime_s": 1, "verify_size": "8M", "sweep": TINY_SWEEP},
    # exactly 3 pairs each (a plain number: min = max)
    "g2": {"contexts": [1100], "rounds": 1, "cold_read_pairs": 3,
           "model_load": {"size": "24MiB", "shard_size": "8MiB", "rounds": 3, "loaders": ["kvgate"],
                          "service": False},
           "checkpoint": {"parameters": 1_000_000, "rounds": 3, "restores": 1}, "no_reuse": {"enabled": False}},
    "g3": {"workload": {"kind": "multi_round_qa", "users": 6, "rounds": 3, "system_prompt_tokens": 256,
                        "document_tokens": 768, "question_tokens": 16, "answer_tokens": 32, "output_tokens": 8},
           "levels": [3], "duration_s": 5, "warmup_s": 1, "min_requests": 3, "blocks": {"min": 3, "max": 3},
           "no_reuse": {"enabled": False}},
}


@pytest.fixture(scope="module")
def aa_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("kvgate-aa")
    (work / "gates.yaml").write_text(yaml.safe_dump({**AA, "storage": {"path": str(work / "storage")}}))
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        code = main(["run", "g2", "g3", "--aa", "--continue-on-fail", "--config", str(work / "gates.yaml"),
                     "--out", str(work / "run")])
    return code, work / "run", console.getvalue()


def test_g2_counts_one_aa_interval_per_side_by_side_figure(aa_run):
    _, run_dir, _ = aa_run
    store = RunStore(run_dir)
    rows = [m for m in store.measurements("g2") if m["metric"] == G2_AA_FALSE_DECISION]
    assert sorted(m["context"]["of"] for m in rows) == [
        "checkpoint_write_vs_storage_best", "cold_read_vs_storage_best", "model_load_vs_storage_best"]
    for row in rows:    # 3 judged pairs each, an interval, and the value says whether it excluded 1
        lo, hi = row["context"]["interval"]
        assert row["context"]["pairs"] == 3 and row["value"] == int(not lo <= 1.0 <= hi)
    # the cold read's pairs really put the best job on both sides: each side read at least the tier's bytes
    pairs = [m for m in store.measurements("g2") if m["metric"] == "cold_read_pair"]
    assert len(pairs) == 3 and all(m["context"]["aa"] and m["context"]["aa_gbps"] > 0 for m in pairs)


def test_g3_counts_one_aa_interval_per_judged_check_with_the_candidate_as_its_own_baseline(aa_run):
    _, run_dir, _ = aa_run
    store = RunStore(run_dir)
    rows = [m for m in store.measurements("g3") if m["metric"] == AA_FALSE_DECISION]
    assert sorted(m["context"]["judged"] for m in rows) == ["throughput_gain", "ttft_p50_reduction"]
    assert all(m["value"] in (0, 1, None) for m in rows)
    blocks = [m for m in store.measurements("g3") if m["metric"] == "g3_block"]
    assert {m["context"]["target"] for m in blocks} == {"baseline", "candidate"}    # no recompute reference
    assert len(blocks) == 6                                                        # 3 pairs of blocks


def test_an_aa_runs_exit_code_judges_the_harness_not_the_subjects_verdicts(aa_run):
    code, run_dir, _ = aa_run
    store = RunStore(run_dir)
    counted = [false_decisions(store.measurements(gate)) for gate in ("g2", "g3")]
    excluded, measured = sum(c[0] for c in counted), sum(c[1] for c in counted)
    assert measured > 0 and code == (0 if excluded == 0 else 1)      # FAIL verdicts of a null subject are no error


def test_the_console_and_the_report_say_each_gates_false_decisions(aa_run):
    _, run_dir, console = aa_run
    store = RunStore(run_dir)
    for gate, metric, null in (("g2", G2_AA_FALSE_DECISION, "a ratio of 1"), ("g3", AA_FALSE_DECISION, "0")):
        rows = [m for m in store.measurements(gate) if m["metric"] == metric]
        measured = [m for m in rows if m["value"] is not None]
        line = f"A/A: {sum(m['value'] for m in measured)} of {len(measured)} intervals excluded {null}"
        assert line in console, console[-2000:]
        assert line in (run_dir / "index.html").read_text()
