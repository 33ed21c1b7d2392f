"""The claims sheet on recorded run data: each vendor figure met, not met, or not measured with the reason;
figures come from judged verdicts only (PASS / FAIL), never from an INCONCLUSIVE one."""

from __future__ import annotations

from kvcore.claims import DEFAULT_CLAIMS, MET, NOT_MEASURED, NOT_MET, Claim, claims_table
from kvcore.rules import Band, Threshold
from kvcore.rundata import RunStore
from kvcore.verdict import judge

RULES = {"ttft_p50_reduction": Threshold("ttft_p50_reduction", ">=", 0.25),
         "throughput_gain": Band("throughput_gain", 0.29, 0.40),
         "disk_hit_ttft_vs_recompute": Threshold("disk_hit_ttft_vs_recompute", "<=", 0.25),
         "cold_read_vs_storage_best": Threshold("cold_read_vs_storage_best", ">=", 0.8),
         "checkpoint_write_vs_storage_best": Threshold("checkpoint_write_vs_storage_best", ">=", 0.7)}


def _claims() -> list[Claim]:
    return [Claim(**c) for c in DEFAULT_CLAIMS]


def _judged(store, gate, metric, value, context=None, **options):
    """A verdict as a gate stores it (kvcore.verdict.judge), and the measurement beside it."""
    store.record(gate, metric, metric, value, **(context or {}), **options.pop("measured", {}))
    store.add_verdict(judge(gate, metric, metric, value, RULES[metric], unit="%", context=context, **options))


def test_recorded_figures_meet_miss_or_cannot_test_each_claim(tmp_path):
    store = RunStore(tmp_path)
    for gate in ("g2", "g3"):
        store.set_status(gate, "passed")
    for level, reduction, gain in ((2, 0.86, 2.04), (4, 0.29, 0.31), (8, 0.96, 3.44)):
        _judged(store, "g3", "ttft_p50_reduction", reduction, {"concurrency": level})
        _judged(store, "g3", "throughput_gain", gain, {"concurrency": level})
    _judged(store, "g2", "disk_hit_ttft_vs_recompute", 0.075, {"context_tokens": 8192})
    _judged(store, "g2", "cold_read_vs_storage_best", 0.93, measured={"tier_gbps": 1.21, "fio_gbps": 1.3})
    _judged(store, "g2", "checkpoint_write_vs_storage_best", 0.76, measured={"save_gbps": 1.28, "fio_gbps": 1.69})
    # the sizing model's figures predicted before G3 ran (and one made before another gate, which must not count)
    store.add_predictions(
        "before g3",
        [
            {"gate": "g3", "metric": "throughput_gain", "value": v, "context": {"concurrency": c}}
            for c, v in ((2, 0.41), (4, 0.35), (8, 0.52))
        ],
    )
    store.add_predictions("before g4", [{"gate": "g3", "metric": "throughput_gain", "value": 0.01}])
    rows = {row["id"]: row for row in claims_table(store, _claims())}
    # the lowest level's reduction (29%) is inside the 26-32% band
    assert rows["ttft_p50_reduction"]["verdict"] == MET and rows["ttft_p50_reduction"]["measured"] == 0.29
    assert rows["throughput_gain"]["measured"] == 0.31 and rows["throughput_gain"]["predicted"] == 0.35
    # 1 / 7.5% = 13.3x: inside 8.6-20x
    assert rows["speedup_over_recompute"]["verdict"] == MET
    assert abs(rows["speedup_over_recompute"]["measured"] - 1 / 0.075) < 1e-9
    # absolute GB/s from the context, not the ratio: 1.21 < 5.23 and 1.28 < 6.40
    assert rows["cold_read_gbps"]["verdict"] == NOT_MET and rows["cold_read_gbps"]["measured"] == 1.21
    assert rows["checkpoint_write_gbps"]["verdict"] == NOT_MET
    # no baseline path: not measured, and the reason says what it needs
    assert rows["model_load_speedup"]["verdict"] == NOT_MEASURED
    assert "g2.model_load.baseline_path" in rows["model_load_speedup"]["note"]


def test_a_figure_above_the_band_is_met_with_a_note_and_a_gate_not_run_is_said(tmp_path):
    store = RunStore(tmp_path)
    store.set_status("g3", "passed")
    _judged(store, "g3", "throughput_gain", 2.1, {"concurrency": 2})
    rows = {row["id"]: row for row in claims_table(store, _claims())}
    assert rows["throughput_gain"]["verdict"] == MET and "better than promised" in rows["throughput_gain"]["note"]
    assert rows["speedup_over_recompute"]["verdict"] == NOT_MEASURED
    assert rows["speedup_over_recompute"]["note"].startswith("G2 did not run")


def test_with_every_g3_verdict_inconclusive_the_claims_are_not_measured_and_say_the_invalid_reason(tmp_path):
    """A run where all four G3 verdicts INCONCLUSIVE, yet the sheet printed "met" at 40.7% and 29.2%."""
    store = RunStore(tmp_path)
    store.set_status("g3", "inconclusive")
    lag = "candidate: client saturated: event-loop lag 212 ms > 50 ms"
    for level, reduction, gain in ((2, 0.407, 0.292), (8, 0.52, 0.41)):
        _judged(store, "g3", "ttft_p50_reduction", reduction, {"concurrency": level}, valid=False, invalid_reason=lag)
        _judged(store, "g3", "throughput_gain", gain, {"concurrency": level}, valid=False, invalid_reason=lag)
    rows = {row["id"]: row for row in claims_table(store, _claims())}
    for claim in ("ttft_p50_reduction", "throughput_gain"):
        assert rows[claim]["verdict"] == NOT_MEASURED and rows[claim]["measured"] is None
        assert rows[claim]["note"] == f"G3 {claim}: invalid: {lag}"


def test_a_level_not_judged_leaves_a_lowest_level_claim_not_measured_and_an_undecided_interval_says_so(tmp_path):
    store = RunStore(tmp_path)
    store.set_status("g3", "inconclusive")
    _judged(store, "g3", "ttft_p50_reduction", 0.30, {"concurrency": 2})                       # PASS
    _judged(store, "g3", "ttft_p50_reduction", 0.27, {"concurrency": 8}, interval=(0.2, 0.33))  # straddles 25%
    rows = {row["id"]: row for row in claims_table(store, _claims())}
    row = rows["ttft_p50_reduction"]                 # the minimum over the levels cannot be known: c=8 undecided
    assert row["verdict"] == NOT_MEASURED and "inconclusive: its interval straddles the rule" in row["note"]


def test_a_claim_whose_check_did_not_apply_says_not_applicable_and_why_not_that_the_gate_did_not_run(tmp_path):
    """G2 ran against a vLLM with no disk tier: no check applied, so the gate is "not run", yet it ran."""
    from gates.run import gate_status
    from kvcore.rundata import Unjudged

    store = RunStore(tmp_path)
    why = "not run: not applicable: the candidate (vllm) has no disk tier (no KV connector)"
    store.add_unjudged(Unjudged("g2", "test_disk_hit", "disk_hit_ttft_vs_recompute", "G2 cold disk hit TTFT", why))
    store.add_unjudged(Unjudged("g2", "test_cold_read", "cold_read_vs_storage_best", "G2 cold read", why))
    status, reason = gate_status([], 0, store.unjudged("g2"))
    store.set_status("g2", status, reason, pytest_exit_code=0)
    rows = {row["id"]: row for row in claims_table(store, _claims())}
    assert rows["speedup_over_recompute"]["note"] == f"G2 disk_hit_ttft_vs_recompute: {why}"
    assert rows["cold_read_gbps"]["note"] == f"G2 cold_read_vs_storage_best: {why}"
    # a claim whose check stored nothing: the gate's own reason, not "did not run"
    assert rows["checkpoint_write_gbps"]["note"] == ("G2: no check applies to the candidate: not applicable: the "
                                                     "candidate (vllm) has no disk tier (no KV connector)")
    assert not any("did not run" in row["note"] for row in rows.values() if row["id"] not in (
        "ttft_p50_reduction", "throughput_gain", "capacity_gain"))          # G3's claims: G3 did not run


def test_a_claim_names_the_check_that_errored_for_its_figure_and_only_that_one(tmp_path):
    from kvcore.rundata import Errored

    store = RunStore(tmp_path)
    room = "G2 checkpoint: /mnt/small: expected room for 0.42 GB, found 0.07 GB free"
    store.add_error(Errored("g2", "test_checkpoint_write", "setup", room, ("checkpoint_write_vs_storage_best",)))
    store.set_status("g2", "error", f"test_checkpoint_write: {room}", pytest_exit_code=1)
    rows = {row["id"]: row for row in claims_table(store, _claims())}
    assert rows["checkpoint_write_gbps"]["note"] == f"G2 test_checkpoint_write errored: {room}"
    # another claim of the gate is not blamed on that check: it says what it needs
    assert rows["model_load_speedup"]["note"] == "needs a baseline storage path (g2.model_load.baseline_path)"
    crashed = RunStore(tmp_path / "crashed")      # the suite crashed storing no errored check: the gate's reason
    crashed.set_status("g2", "error", "a check crashed outside its verdict (pytest exit 2): see pytest.log",
                       pytest_exit_code=2)
    rows = {row["id"]: row for row in claims_table(crashed, _claims())}
    assert rows["checkpoint_write_gbps"]["note"] == ("G2 errored: a check crashed outside its verdict (pytest exit 2): "
                                                     "see pytest.log")


def test_a_claim_of_a_gate_stopped_by_an_earlier_one_says_where_it_stopped(tmp_path):
    from kvcore.claims import run_claims, why_not_measured

    store = RunStore(tmp_path)
    store.set_status("g3", "not run", "not run: stopped at G2")
    claim = next(c for c in run_claims(store) if c.gate == "g3")
    assert why_not_measured(store, claim, None).startswith("G3 not run: stopped at G2")
