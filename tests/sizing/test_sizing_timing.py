"""The sizing model's timing half: recompute curve, TTFT per request, G2's figures, the G3 closed-loop
simulation, load and checkpoint seconds, and the calibration from a run directory in the run-store format."""

from __future__ import annotations

import json

import pytest

from kvcore.block_pairs import level_looks
from kvcore.rundata import RunStore
from kvcore.settings import ConfigError
from sizing.calibration import Calibration, calibrate
from sizing.g3_figures import pairs_prediction, predict_g3, summarize
from sizing.queueing import DecodeCost, EngineModel, ServedRequest, SimulatedRequest, simulate_closed_loop
from sizing.timing import (
    RecomputeCurve,
    TierBandwidths,
    TimingModel,
    checkpoint_seconds,
    cold_read_vs_storage_best,
    model_load_seconds,
    predict_g2,
)
from tests.recorded_runs import (
    B_,
    BASELINE_PER_SEQ,
    BASELINE_STEP,
    C_,
    DISK_OVERHEAD,
    KV,
    PER_SEQ,
    STEP,
    F,
    recorded_run,
)


def _model(**tiers) -> TimingModel:
    curve = RecomputeCurve(a=0.01, b=1e-4, c=1e-8)
    settings = {"host_gbps": 10.0, "disk_gbps": 2.0, "efficiency": {"disk": 0.5}, "overhead_s": {"disk": 0.005}}
    return TimingModel(curve, TierBandwidths(**{**settings, **tiers}), KV, block_size=256)


# --------------------------------------------------------------------------- recompute curve


def test_the_curve_fit_recovers_known_coefficients():
    a, b, c = 0.02, 9e-5, 1.6e-8
    points = [(n, a + b * n + c * n * n) for n in (1020, 2044, 4092, 8188) for _ in range(2)]
    curve = RecomputeCurve.fit(points)
    assert (curve.a, curve.b, curve.c) == pytest.approx((a, b, c), rel=1e-9)
    assert curve.seconds(16384) == pytest.approx(a + b * 16384 + c * 16384 ** 2, rel=1e-9)


def test_the_curve_fit_keeps_every_coefficient_non_negative():
    # these points lie on -0.05 + 2e-4·n + 1e-9·n²: an unconstrained fit would give a negative intercept
    points = [(n, -0.05 + 2e-4 * n + 1e-9 * n * n) for n in (1024, 4096, 8192)]
    curve = RecomputeCurve.fit(points)
    assert curve.a == 0.0 and curve.b > 0 and curve.c >= 0
    assert all(abs(curve.seconds(n) - s) / s < 0.25 for n, s in points)


def test_a_curve_needs_three_context_lengths():
    with pytest.raises(ConfigError, match=r"recompute points: expected at least 3 distinct context lengths.*found 2"):
        RecomputeCurve.fit([(1024, 0.1), (1024, 0.11), (4096, 0.6)])
    with pytest.raises(ConfigError, match=r"recompute points\[1\]\.seconds: expected a finite number > 0, found -1"):
        RecomputeCurve.fit([(1024, 0.1), (2048, -1), (4096, 0.6)])


def test_the_roofline_by_hand():
    # an 8B model (32 layers, dim 4096) on a device doing 1e15 FLOP/s, a 1000-token prompt:
    # 2 · 8e9 · 1000 = 1.6e13 FLOPs of weights, 2 · 32 · 1000² · 4096 = 2.62144e11 of attention
    curve = RecomputeCurve.roofline(params=8e9, layers=32, dim=4096, device_flops=1e15)
    assert curve.seconds(1000) == pytest.approx((1.6e13 + 2.62144e11) / 1e15, rel=1e-12)
    assert curve.a == 0.0
    with pytest.raises(ConfigError, match="device_flops: expected a finite number > 0, found 0"):
        RecomputeCurve.roofline(params=8e9, layers=32, dim=4096, device_flops=0)


# --------------------------------------------------------------------------- TTFT per request


def test_ttft_of_a_host_hit_by_hand():
    # 2100-token prompt, 2048 (8 blocks) from host: overhead 0.01 + 2048·4096 B / 10 GB/s
    # + the tail 1e-4·(2100 − 2048) + 1e-8·(2100² − 2048²)
    expected = 0.01 + 2048 * 4096 / 10e9 + 1e-4 * 52 + 1e-8 * (2100 ** 2 - 2048 ** 2)
    assert _model().ttft(2100, {"host": 2048}) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.0181958208, rel=1e-9)


def test_ttft_of_a_disk_hit_by_hand():
    # the same from disk: its 0.005 s hit overhead, 8 MiB at 2 GB/s × 0.5 efficiency
    expected = 0.01 + 0.005 + 2048 * 4096 / (2e9 * 0.5) + 1e-4 * 52 + 1e-8 * (2100 ** 2 - 2048 ** 2)
    assert _model().ttft(2100, {"disk": 2048}) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.030745568, rel=1e-9)


def test_ttft_of_a_miss_and_of_a_full_hit_by_hand():
    assert _model().ttft(2100) == pytest.approx(0.01 + 1e-4 * 2100 + 1e-8 * 2100 ** 2, rel=1e-12)   # 0.2641
    # all 8 blocks of a 2048-token prompt cached: the loads and a one-token pass, 1e-4 + 1e-8·(2048² − 2047²)
    full = 0.01 + 2048 * 4096 / 10e9 + 1e-4 + 1e-8 * (2048 ** 2 - 2047 ** 2)
    assert _model().ttft(2048, {"host": 2048}) == pytest.approx(full, rel=1e-12)
    # a prefix split over tiers loads from each
    split = 0.01 + 1024 * 4096 / 10e9 + 0.005 + 1024 * 4096 / 1e9 + 1e-4 * 52 + 1e-8 * (2100 ** 2 - 2048 ** 2)
    assert _model().ttft(2100, {"host": 1024, "disk": 1024}) == pytest.approx(split, rel=1e-12)


def test_bad_cached_counts_and_a_missing_tier_bandwidth_name_the_field():
    with pytest.raises(ConfigError, match="cached: expected at most the prompt's 100 tokens in all, found 256"):
        _model().ttft(100, {"host": 256})
    with pytest.raises(ConfigError, match=r"cached: expected tiers among .*found 'ssd'"):
        _model().ttft(1000, {"ssd": 256})
    with pytest.raises(ConfigError, match="tiers.remote_gbps: expected the remote tier's read GB/s"):
        _model().ttft(1000, {"remote": 256})
    with pytest.raises(ConfigError, match="tiers.efficiency.disk: expected a finite number > 0, found 0"):
        TierBandwidths(efficiency={"disk": 0})


def test_g2_predictions_by_hand():
    model = TimingModel(RecomputeCurve(0.02, 2e-4, 1e-8), TierBandwidths(host_gbps=10.0, disk_gbps=1.0), KV)
    # context 1028: the suite's prompt is 1024 tokens, all 4 blocks cached: a one-token pass after the load
    (g2,) = predict_g2(model, [1028])
    assert (g2.prompt_tokens, g2.cached_tokens) == (1024, 1024)
    recompute = 0.02 + 2e-4 * 1024 + 1e-8 * 1024 ** 2
    disk = 0.02 + 1024 * 4096 / 1e9 + 2e-4 + 1e-8 * (1024 ** 2 - 1023 ** 2)
    assert g2.recompute_s == pytest.approx(recompute, rel=1e-12)
    assert g2.disk_hit_vs_recompute == pytest.approx(disk / recompute, rel=1e-12)
    assert cold_read_vs_storage_best(TierBandwidths(disk_gbps=1.0, efficiency={"disk": 0.82})) == 0.82
    assert cold_read_vs_storage_best(TierBandwidths(disk_gbps=1.0)) == 1.0


def test_the_disk_bandwidth_comes_from_g1s_fio(tmp_path):
    store = RunStore(tmp_path)
    assert TierBandwidths.from_run(store, disk_gbps=3.0).disk_gbps == 3.0
    store.record("g1", "test_fio", "seq_read_gbps", 1.25, "GB/s")
    assert TierBandwidths.from_run(store, disk_gbps=3.0).disk_gbps == 1.25


def test_model_load_and_checkpoint_seconds_by_hand():
    # 16 GB of weights at fio's 2 GB/s, the loader reaching 80% of it, a service that takes 3 s besides
    assert model_load_seconds(16e9, 2.0, loader_efficiency=0.8, service_start_s=3.0) == pytest.approx(3 + 10)
    assert model_load_seconds(16e9, 2.0) == pytest.approx(8.0)
    assert checkpoint_seconds(7e9, 1.4, efficiency=0.5) == pytest.approx(10.0)
    with pytest.raises(ConfigError, match="efficiency: expected a finite number > 0, found -0.5"):
        checkpoint_seconds(7e9, 1.4, efficiency=-0.5)


# --------------------------------------------------------------------------- G3


def _engine(decode=DecodeCost(0.004, 0.001), max_running=8, **timing) -> EngineModel:
    return EngineModel(_model(**timing), decode, max_running)


def test_one_user_waits_for_its_service_time_and_makes_outputs_per_cycle():
    engine = _engine()
    request = ServedRequest(prompt_tokens=1000, output_tokens=16, cached={"host": 768})
    figures = summarize(simulate_closed_loop([request] * 5, 1, engine))
    ttft = 0.01 + 768 * 4096 / 10e9 + 1e-4 * 232 + 1e-8 * (1000 ** 2 - 768 ** 2)    # service time
    decode = 15 * (0.004 + 0.001 * 1)                                                # 15 more tokens, alone
    assert figures.ttft_p50_s == pytest.approx(ttft, rel=1e-9)
    assert ttft == pytest.approx(engine.timing.ttft(1000, {"host": 768}), rel=1e-12)
    assert figures.output_tokens_per_s == pytest.approx(16 / (ttft + decode), rel=1e-9)
    assert figures.requests == 5 and figures.itl_mean_s == pytest.approx(0.005)


def test_prefills_go_one_chunk_per_step_first_come_first_served():
    # two users, two full hits of 2 output tokens, no fixed overhead: a one-token pass costs p, a load
    # from the device tier L = 512 · 4096 B / 50 GB/s, a decode step d
    engine = EngineModel(TimingModel(RecomputeCurve(0.0, 1e-3, 0.0), TierBandwidths(), KV), DecodeCost(0.002, 0.0))
    p, d, L = 1e-3, 0.002, 512 * 4096 / 50e9
    hit = ServedRequest(512, 2, {"device": 512})
    # step 1: both admitted (2L), A's pass (its first token at 2L + p), A decodes alone: done at 2L + p + d
    # step 2: B's pass (first token at 2L + 2p + d), B decodes: done at 2L + 2p + 2d
    first, second = simulate_closed_loop([hit, hit], 2, engine)
    assert (first.ttft_s, first.done_s) == pytest.approx((2 * L + p, 2 * L + p + d), rel=1e-12)
    assert (second.ttft_s, second.done_s) == pytest.approx((2 * L + 2 * p + d, 2 * L + 2 * p + 2 * d), rel=1e-12)
    # one running at a time, 3 output tokens: step 1 admits A (L), its pass, a decode; step 2 decodes A;
    # step 3 admits B (L) and runs its pass: B's first token at 2L + 2p + 2d
    three = ServedRequest(512, 3, {"device": 512})
    _, waited = simulate_closed_loop([three, three], 2, EngineModel(engine.timing, engine.decode, max_running=1))
    assert waited.ttft_s == pytest.approx(2 * L + 2 * p + 2 * d, rel=1e-12)


def test_a_long_prefill_is_cut_in_block_chunks_that_add_up_to_its_tail():
    engine = _engine()
    chunks = engine.chunks(1000, 100)        # [100, 256), [256, 512), [512, 768), [768, 1000)
    assert len(chunks) == 4
    assert sum(chunks) == pytest.approx(engine.timing.curve.tail(1000, 100), rel=1e-12)
    assert engine.chunks(512, 512) == [pytest.approx(1e-4 + 1e-8 * (512 ** 2 - 511 ** 2))]


def test_an_engine_with_a_token_budget_prefills_up_to_it_a_step():
    """vLLM's chunked prefill takes up to its token budget of a prompt a step (2,048 on its CPU server), where
    kvgate's engine takes one block: a 1,920-token prompt is one step there, eight here; the chunks add up alike."""
    from dataclasses import replace

    engine = _engine()
    budgeted = replace(engine, prefill_budget=2048)
    assert len(engine.chunks(1920, 0)) == 8 and len(budgeted.chunks(1920, 0)) == 1
    assert len(budgeted.chunks(5000, 100)) == 3               # [100, 2148), [2148, 4196), [4196, 5000)
    assert sum(budgeted.chunks(5000, 100)) == pytest.approx(sum(engine.chunks(5000, 100)), rel=1e-12)
    with pytest.raises(ConfigError, match="prefill_budget"):
        replace(engine, prefill_budget=0)


def test_g3_prediction_of_a_hit_against_a_miss_at_one_user():
    engine = _engine()
    miss = ServedRequest(1000, 16)
    hit = ServedRequest(1000, 16, {"host": 768})
    (level,) = predict_g3({"baseline": [miss] * 4, "candidate": [hit] * 4}, [1], engine)
    base_ttft, cand_ttft = engine.timing.ttft(1000), engine.timing.ttft(1000, {"host": 768})
    decode = 15 * 0.005
    assert level.ttft_p50_reduction == pytest.approx(1 - cand_ttft / base_ttft, rel=1e-9)
    assert level.throughput_gain == pytest.approx((base_ttft + decode) / (cand_ttft + decode) - 1, rel=1e-9)
    with pytest.raises(ConfigError, match=r"replays: expected a baseline and a candidate replay.*\['baseline'\]"):
        predict_g3({"candidate": [hit]}, [1], engine)


def _block(requests: int, ttft_s: float, seconds: float, tokens: int = 10) -> list[SimulatedRequest]:
    """A simulated block from its 0: `requests` answered evenly over `seconds`, each with `tokens` output tokens."""
    step = seconds / requests
    return [SimulatedRequest(i, i * step, i * step + ttft_s, (i + 1) * step, tokens, (), ()) for i in range(requests)]


def test_g3s_matched_blocks_are_judged_over_their_pairs_ratios_as_g3_judges_them():
    """G3 judges a level's reduction and gain over its block pairs (kvcore/block_pairs.py): the geometric mean of each
    pair's candidate ÷ baseline. On blocks shorter than 2 s the 2-second windows over the blocks laid end to end said
    another figure (here +60% for the blocks' +100%; the tiny preset: +26% against its blocks' +156%)."""
    lengths = (0.8, 0.7, 0.9, 0.8)           # each pair's baseline block, seconds; the candidate's twice as fast
    pairs = [{"baseline": _block(6, 0.2, s), "candidate": _block(6, 0.05, s / 2)} for s in lengths]
    level = pairs_prediction(2, pairs, 3, level_looks(5))
    assert level.g3.throughput_gain == pytest.approx(1.0) and level.g3.ttft_reduction == pytest.approx(0.75)
    assert level.g3.valid and level.g3.pairs == 4 and level.g3.throughput_interval[0] > 0
    # each target's own figures are over its blocks laid end to end, as G3 pools them
    assert level.targets["baseline"].output_tokens_per_s == pytest.approx(4 * 60 / sum(lengths))
    assert level.targets["candidate"].requests == 24
    # a pair with a block below G3's least requests is left out and counted; under 3 such pairs: no figure, and why
    short = pairs[:2] + [{"baseline": _block(2, 0.2, 1.0), "candidate": _block(2, 0.05, 0.5)}]
    judged = pairs_prediction(2, short, 3, level_looks(5)).g3
    assert (judged.valid, judged.pairs, judged.left_out) == (False, 2, 1)
    assert "2 valid block pairs of 3" in judged.invalid_reason and "2 completed requests" in judged.left_out_reasons


def test_a_duration_cycles_the_replay_and_a_warm_up_is_left_out():
    engine = _engine()
    simulated = simulate_closed_loop([ServedRequest(300, 4)], 2, engine, duration_s=1.0)
    assert len(simulated) > 10 and max(r.sent_s for r in simulated) < 1.0
    assert summarize(simulated, warmup_s=0.5).requests < len(simulated)


# --------------------------------------------------------------------------- calibration


def test_calibration_recovers_the_constants_of_arecorded_run(tmp_path):
    recorded_run(tmp_path)
    calibration = calibrate(tmp_path)
    assert calibration.kv_bytes_per_token == KV                        # 2 prefixes × 31 blocks of 1 MiB per round
    assert (calibration.curve.b, calibration.curve.c) == pytest.approx((B_, C_), rel=1e-6)
    assert calibration.fixed_overhead_s == pytest.approx(F, rel=1e-6)
    assert calibration.tier_efficiency == {"disk": 0.8}
    assert calibration.tier_overhead_s["disk"] == pytest.approx(DISK_OVERHEAD, rel=1e-6)
    assert (calibration.decode.step_s, calibration.decode.per_sequence_s) == pytest.approx((STEP, PER_SEQ), rel=1e-3)
    baseline = calibration.baseline_decode                             # each target's steps its own
    assert (baseline.step_s, baseline.per_sequence_s) == pytest.approx((BASELINE_STEP, BASELINE_PER_SEQ), rel=1e-3)
    assert calibration.target_decode("baseline") == baseline and calibration.target_decode("candidate") == \
        calibration.decode
    assert calibration.loader_efficiency == {"kvgate": 0.95, "safetensors": 0.9, "runai_streamer": 0.6}
    assert calibration.checkpoint_efficiency == 0.75
    assert calibration.service_start_s == pytest.approx(3.2)
    assert calibration.notes == ()
    # a plan then predicts G2's ratio at the longest context as recorded
    model = calibration.timing_model(TierBandwidths.from_run(RunStore(tmp_path)), KV)
    longest = predict_g2(model, [1024, 4096, 8192])[-1]
    recorded = {m["context"]["mode"]: m["value"] / 1e3 for m in RunStore(tmp_path).measurements("g2")
                if m["metric"] == "ttft_ms" and m["context"]["context_tokens"] == 8192}
    assert longest.disk_hit_vs_recompute == pytest.approx(recorded["disk-cold"] / recorded["recompute"], rel=1e-6)


def test_calibration_fits_the_decode_cost_to_g3s_blocks_after_their_warm_up_pairs(tmp_path):
    """G3 runs each level in matched blocks (c4, c4-block2, ...), none as long as g3.warmup_s: the decode cost is
    fitted to the blocks after the warm-up pairs G3 left out (here one, whose steps were five times slower)."""
    recorded_run(tmp_path, blocks=3)
    calibration = calibrate(tmp_path)
    assert (calibration.decode.step_s, calibration.decode.per_sequence_s) == pytest.approx((STEP, PER_SEQ), rel=1e-3)
    baseline = calibration.baseline_decode
    assert (baseline.step_s, baseline.per_sequence_s) == pytest.approx((BASELINE_STEP, BASELINE_PER_SEQ), rel=1e-3)
    assert calibration.notes == ()


def test_calibration_says_what_it_could_not_fit(tmp_path):
    recorded_run(tmp_path, with_g3=False)
    calibration = calibrate(tmp_path)
    assert calibration.decode is None and calibration.baseline_decode is None
    assert calibration.notes == ("no decode cost: no G3 records of the candidate with gaps between tokens",)
    with pytest.raises(ConfigError, match="run_dir: expected a run directory"):
        calibrate(tmp_path / "nothing")


def test_a_saved_calibration_loads_back_equal(tmp_path):
    recorded_run(tmp_path)
    calibration = calibrate(tmp_path)
    calibration.save(tmp_path / "calibration.json")
    assert Calibration.load(tmp_path / "calibration.json") == calibration
    assert calibration.baseline_decode is not None and calibration.baseline_jitter is not None
    # a file written before the baseline had its own steps: the candidate's stand in for both
    data = json.loads((tmp_path / "calibration.json").read_text())
    del data["baseline_decode"], data["baseline_jitter"]
    (tmp_path / "older.json").write_text(json.dumps(data))
    older = Calibration.load(tmp_path / "older.json")
    assert older.target_decode("baseline") == older.decode == calibration.decode
    assert older.target_jitter("baseline") == calibration.jitter


def test_a_bad_calibration_file_names_the_field(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"format": 1, "curve": {"a": 0.0, "b": "fast", "c": 0.0}}))
    with pytest.raises(ConfigError, match="calibration.curve.b: expected a finite number >= 0, found 'fast'"):
        Calibration.load(path)
    path.write_text(json.dumps({"format": 1, "curve": {"a": 0.0, "b": 1e-4}}))
    with pytest.raises(ConfigError, match="calibration.curve.c: expected a number, found nothing"):
        Calibration.load(path)
    path.write_text(json.dumps({"format": 1, "tier_efficiency": {"ssd": 0.9}}))
    with pytest.raises(ConfigError, match=r"calibration.tier_efficiency: expected tiers among .*found 'ssd'"):
        Calibration.load(path)
    path.write_text(json.dumps({"format": 2}))
    with pytest.raises(ConfigError, match="calibration.format: expected 1, found 2"):
        Calibration.load(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="calibration: expected a JSON file, found unreadable JSON"):
        Calibration.load(path)
