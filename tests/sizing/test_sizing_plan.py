"""`kvgate plan`: the quick profile's plan from its config alone, refined by a recorded run (predicted beside
measured, with the errors), and the calibration written by one run and read by a later plan."""

from __future__ import annotations

import json

import pytest
import yaml

from gates.cli import main
from gates.config import load_config
from kvcore.claims import claims_table, run_claims
from kvcore.rundata import RunStore
from kvcore.settings import ConfigError
from sizing.plan import make_plan
from tests.recorded_runs import B_, recorded_run


def test_a_plan_from_the_config_alone_gives_the_layout_the_tiers_and_the_workloads_hits(capsys):
    assert main(["plan", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # the small preset: 2 (K, V) x 4 layers x 2 KV heads x 64 dims x 4 bytes = 4 KiB per token, 1 MiB per block
    assert plan["figures"]["layout"]["bytes_per_token"] == 4096
    assert plan["figures"]["tiers"]["candidate"] == {"device": 64 * 256, "host": 48 * 256,
                                                      "disk": (8 << 30) // ((1 << 20) + 4096) * 256}
    hits = plan["figures"]["g3_hit_ratio"]
    # the quick profile's 48 MiB host tier is below the 16 histories: the disk serves the candidate's lower hits
    assert hits["candidate"]["per_tier"]["disk"] > hits["candidate"]["per_tier"]["host"]
    # the device tier alone keeps only the shared system prompt: the 16 interleaved histories outgrow it
    assert hits["baseline"]["overall"] < 0.2 < 0.9 < hits["candidate"]["overall"]
    assert hits["candidate"]["overall"] <= hits["candidate"]["infinite_cache_bound"]
    assert plan["predictions"] == [] and any("recompute curve" in note for note in plan["notes"])


def test_a_plan_from_a_run_predicts_g2_judges_it_and_sets_it_beside_the_measurement(tmp_path):
    store = recorded_run(tmp_path)
    ttft = {m["context"]["mode"]: m["value"] for m in store.measurements("g2")
            if m["metric"] == "ttft_ms" and m["context"]["context_tokens"] == 8192}
    store.record("g2", "test_ratio", "disk_hit_ttft_vs_recompute", ttft["disk-cold"] / ttft["recompute"],
                 context_tokens=8192)                                   # as G2's check records it
    plan = make_plan(load_config(None, "quick"), store)
    g2 = {p.metric: p for p in plan.predictions if p.gate == "g2"}
    assert g2["disk_hit_ttft_vs_recompute"].status == "PASS" and "≤ 25%" in g2["disk_hit_ttft_vs_recompute"].reason
    assert g2["cold_read_vs_storage_best"].value == pytest.approx(0.8)             # the run's measured tier efficiency
    # G3 per level from the replayed hits and the fitted decode cost, each judged by G3's rules
    g3 = [p for p in plan.predictions if p.metric == "ttft_p50_reduction"]
    assert [p.context["concurrency"] for p in g3] == [2, 4, 8] and all(p.status for p in g3)
    # the recorded run follows the fitted constants exactly: its G2 ratio is predicted with no error
    row = next(r for r in plan.comparison if r["metric"] == "disk_hit_ttft_vs_recompute")
    assert row["error"] == pytest.approx(0.0, abs=1e-6)
    assert any(a["label"] == "G2 TTFT MAPE" for a in plan.accuracy)
    assert any("fitted to this same run" in note for note in plan.notes)


def test_calibrate_writes_the_constants_a_later_plan_reads(tmp_path, capsys):
    recorded_run(tmp_path / "run")
    out = tmp_path / "calibration.json"
    assert main(["plan", "--calibrate", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out and json.loads(out.read_text())["decode"]["step_s"] > 0
    assert main(["plan", "--calibration", str(out)]) == 0
    text = capsys.readouterr().out
    assert "predicted G2 cold disk hit / recompute at 8192 tokens" in text and "G3 TTFT p50 reduction at c=8" in text


def test_a_run_directory_that_is_not_one_is_a_clear_error(tmp_path, capsys):
    assert main(["plan", "--from", str(tmp_path / "nowhere")]) == 2
    assert "--from: expected a run directory (with run.json)" in capsys.readouterr().err
    assert RunStore(tmp_path).run_info() == {}


def test_in_a_run_g3_is_predicted_from_g1_and_g2_before_it_runs_then_held_to_its_measurements(tmp_path):
    from sizing.in_run import final_sizing, stage_plan

    store = recorded_run(tmp_path)
    for gate in ("g1", "g2"):
        store.set_status(gate, "passed")
    # the recorded run's G3 raw records would let the plan fit the decode cost; before G3 it must not have them
    import shutil

    shutil.rmtree(store.raw_dir("g3"))
    config = load_config(None, "quick")
    stage_plan(config, store, "g2")          # G2 from the run's own G2: recorded under "before g2"
    plan, problem = stage_plan(config, store, "g3")
    assert problem == "" and any("estimated from G2's recompute curve" in note for note in plan.notes)
    recorded = [r for r in store.predictions() if r["stage"] == "before g3"]
    # the decode cost is only estimated before a G3: the throughput is not predicted, the TTFT p50 is
    assert {r["metric"] for r in recorded} == {"hit_ratio", "ttft_p50_reduction", "ttft_p50_ms"}
    predicted = {(r["metric"], r["context"].get("target"), r["context"]["concurrency"]): r["value"] for r in recorded}
    # G3 then measures: a hit ratio 3 points under the candidate's prediction, a reduction 2 points above,
    # the candidate's TTFT p50 10% above
    store.set_status("g3", "passed")
    candidate_hits = predicted[("hit_ratio", "candidate", 2)]
    store.record("g3", "test_hits", "hit_ratio", candidate_hits - 0.03, target="candidate", concurrency=2)
    reduction = predicted[("ttft_p50_reduction", None, 2)]
    store.record("g3", "test_ttft", "ttft_p50_reduction", reduction + 0.02, concurrency=2)
    ttft = predicted[("ttft_p50_ms", "candidate", 2)]
    store.record("g3", "test_ttft", "ttft_p50_ms", ttft / 0.9, "ms", target="candidate", concurrency=2)
    # the step's measured blocks (sizing/noise.py): 20% either side of the figure and one, invalid, left out
    for block, share in enumerate((0.8, 1.0, 1.2, 50.0), start=1):
        store.record("g3", "test_ttft", "g3_block", block, target="candidate", concurrency=2, block=block,
                     ttft_p50_ms=ttft / 0.9 * share, valid=share < 10)
    # the baseline's TTFT p50 at c=4 measured in a step recorded invalid: not compared, and the notes say so
    store.record("g3", "test_ttft", "ttft_p50_ms", 1.0, "ms", target="baseline", concurrency=4)
    store.record("g3", "test_ttft", "step_valid", False, target="baseline", concurrency=4,
                 reasons="client saturated")
    sizing = final_sizing(store, plan, config)
    assert ("ttft_p50_ms", "baseline") not in {(r["metric"], r["context"].get("target")) for r in sizing["comparison"]
                                                if r["context"].get("concurrency") == 4}
    assert any(n.startswith("1 predicted figures not compared: measured in invalid steps") for n in sizing["notes"])
    rows = {(r["metric"], r["context"].get("target")): r for r in sizing["comparison"]}
    assert rows[("hit_ratio", "candidate")]["error"] == pytest.approx(0.03)
    assert rows[("ttft_p50_reduction", None)]["error"] == pytest.approx(-0.02)
    assert rows[("ttft_p50_ms", "candidate")]["error"] == pytest.approx(-0.1)
    assert rows[("ttft_p50_ms", "candidate")]["spread"] == pytest.approx(0.4 / 3)
    assert rows[("hit_ratio", "candidate")]["spread"] is None        # a figure with no samples of its own
    # the claims' predicted column: each figure as predicted before its gate ran, read by the claim's rule
    claims = {row["id"]: row for row in claims_table(store, run_claims(store))}
    assert claims["ttft_p50_reduction"]["predicted"] == pytest.approx(min(
        v for (metric, _, _), v in predicted.items() if metric == "ttft_p50_reduction"))
    g2 = next(
        r for r in store.predictions() if r["stage"] == "before g2" and r["metric"] == "disk_hit_ttft_vs_recompute"
    )
    assert claims["speedup_over_recompute"]["predicted"] == pytest.approx(1 / g2["value"])
    accuracy = {a["label"]: a for a in sizing["accuracy"]}
    assert "within 5" in accuracy["G3 hit ratio / TTFT reduction error"]["text"]
    # the throughput is not predicted before a G3 (its decode only estimated): the TTFT p50s are held apart
    assert "G3 throughput MAPE" not in accuracy
    assert accuracy["G3 TTFT p50 MAPE"]["text"].startswith("10.0% over 1 figures (within 15%); the gate's own "
                                                            "blocks lie 13.3% from their figures; ")


def test_a_runs_own_constants_come_first_and_an_earlier_calibration_fills_what_it_has_not_measured():
    from sizing.calibration import Calibration
    from sizing.queueing import DecodeCost
    from sizing.timing import RecomputeCurve

    own = Calibration(curve=RecomputeCurve(0.01, 2e-4, 1e-8), tier_efficiency={"disk": 0.83}, source="this run")
    earlier = Calibration(curve=RecomputeCurve(0.02, 3e-4, 0.0), decode=DecodeCost(0.0063, 0.0022), jitter=0.3,
                          tier_efficiency={"disk": 0.5}, source="/tmp/earlier")
    filled = own.filled_from(earlier)
    assert filled.curve == own.curve and filled.tier_efficiency == {"disk": 0.83}     # measured here: kept
    assert filled.decode == earlier.decode and filled.jitter == 0.3                   # not measured yet: taken
    assert filled.notes[-1] == "decode, jitter from /tmp/earlier (no gate of this run measured them)"
    assert earlier.filled_from(earlier) is earlier                                    # nothing to fill


def test_a_flops_roofline_stands_in_for_the_recompute_curve_before_any_run(tmp_path):
    from sizing.timing import RecomputeCurve

    path = tmp_path / "gates.yaml"
    path.write_text("sizing:\n  roofline: {device_tflops: 0.05, params: 3e6, attention_dim: 256}\n")
    plan = make_plan(load_config(path))
    # (2 x 3e6 x n + 2 x 4 layers x n^2 x 256) / 5e10 FLOP/s: 3.73 s at n = 8192 (the small preset has 4 layers)
    curve = RecomputeCurve.roofline(3e6, 4, 256, 0.05e12)
    assert curve.compute(8192) == pytest.approx((2 * 3e6 * 8192 + 2 * 4 * 8192 ** 2 * 256) / 5e10)
    g2 = {p.metric: p for p in plan.predictions if p.gate == "g2"}
    assert "disk_hit_ttft_vs_recompute" in g2 and g2["disk_hit_ttft_vs_recompute"].status in ("PASS", "FAIL")
    assert any(
        note.startswith("recompute from sizing.roofline (roofline: 3e+06 params, 4 layers") for note in plan.notes
    )
    path.write_text("sizing:\n  roofline: {device_tflops: 0.05, params: eight, attention_dim: 256}\n")
    with pytest.raises(ConfigError, match=r"sizing.roofline.params: .*expected a parameter count \(8.03e9, 8B\), "
                                          r"found 'eight'"):
        load_config(path)
    path.write_text("sizing:\n  roofline: {device_tflops: 0.05, params: 8.03B, attention_dim: 4096}\n")
    assert load_config(path).sizing.roofline.params == pytest.approx(8.03e9)


def test_an_external_plan_models_what_the_engines_said_at_pre_flight(tmp_path):
    # a live vLLM pair (tests/engines/test_live_vllm.py): the baseline without prefix caching, the candidate with
    # 262,144 tokens of device KV and no tier below it; the plan had predicted 0% G3 reduction and a G2 cold-read PASS
    path = tmp_path / "gates.yaml"
    path.write_text("targets:\n  kind: external\n"
                    "  baseline: {url: 'http://127.0.0.1:1/v1', model: m, engine: vllm}\n"
                    "  candidate: {url: 'http://127.0.0.1:2/v1', model: m, engine: vllm}\n"
                    "sizing:\n  roofline: {device_tflops: 0.05, params: 3e6, attention_dim: 256}\n")
    config = load_config(path, "quick")
    said = {"baseline": {"device_kv_tokens": 0, "device_kv_source": "vllm:cache_config_info "
                                                                       "enable_prefix_caching=False: no reusable KV",
                         "absent_tiers": {"device": "enable_prefix_caching=False"}},
            "candidate": {"device_kv_tokens": 262144, "device_kv_source": "vllm:cache_config_info "
                                                                           "kv_cache_size_tokens 262144",
                          "absent_tiers": {"host": "kv_offloading_size=None", "disk": "no connector"}}}
    plan = make_plan(config, engines=said)
    assert plan.figures["tiers"]["baseline"] == {"device": 0}
    assert plan.figures["tiers"]["candidate"]["device"] == 262144
    hits = plan.figures["g3_hit_ratio"]
    assert hits["baseline"]["overall"] == 0 and hits["candidate"]["overall"] > 0.5
    assert not [p for p in plan.predictions if p.metric in ("cold_read_vs_storage_best", "disk_hit_ttft_vs_recompute")]
    assert any("no disk tier in the model" in note for note in plan.notes)
    assert any(note.startswith("the baseline reuses no prefix") for note in plan.notes)
    reduction = [p for p in plan.predictions if p.metric == "ttft_p50_reduction"]
    assert reduction and all(p.value > 0.25 for p in reduction)        # it had predicted 0%
    # without what the engines said: the old model, both sides the same device, no gain predicted
    plain = make_plan(config).figures["g3_hit_ratio"]
    assert plain["baseline"]["overall"] == pytest.approx(plain["candidate"]["overall"])


def test_a_plan_from_a_run_without_g2_says_so(tmp_path, capsys):
    store = RunStore(tmp_path)
    store.write_run_info({"run_id": "g3-only", "gates": ["g3"]})
    (tmp_path / "config.yaml").write_text("g3:\n  levels: [2]\n")
    assert main(["plan", "--from", str(tmp_path), "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert "no recompute curve: this run has no G2 TTFTs (G2 did not run, or measured none)" in notes
    assert not any("fewer than 3 context lengths" in note for note in notes)


def test_a_constant_taken_from_an_earlier_calibration_drops_the_note_that_it_was_missing():
    from sizing.calibration import Calibration
    from sizing.queueing import DecodeCost
    from sizing.timing import RecomputeCurve

    missing = ("no recompute curve: this run has no G2 TTFTs (G2 did not run, or measured none)",
               "no decode cost: fitting it replays G3's requests, which needs the recompute curve and the KV bytes "
               "per token", "G2's hits reused 90% of the blocks at least, not every one: the fit takes every whole "
               "block as cached")
    own = Calibration(notes=missing, source="this run")
    probe = Calibration(curve=RecomputeCurve(0.02, 3e-4, 0.0), source="the pre-flight's machine probe")
    filled = own.filled_from(probe)          # the curve answers its note; the decode cost is still missing
    assert filled.notes == (missing[1], missing[2],
                            "curve from the pre-flight's machine probe (no gate of this run measured them)")
    both = own.filled_from(Calibration(curve=probe.curve, decode=DecodeCost(0.0063, 0.0022), source="earlier"))
    assert both.notes == (missing[2], "curve, decode from earlier (no gate of this run measured them)")


def test_a_term_taken_from_an_earlier_calibration_is_said_to_come_from_it():
    """Before G2 the run's own calibration (G1's figures) has no fixed overhead: the machine probe's is used, and the
    G2 terms' sources say so, not the run directory (m1 of 2026-12-07 said its fixed term came from the run)."""
    from sizing.calibration import Calibration
    from sizing.plan import term_sources
    from sizing.timing import RecomputeCurve, TierBandwidths

    own = Calibration(tier_efficiency={"disk": 0.9}, source="/runs/m1")
    probes = Calibration(curve=RecomputeCurve(0.02, 3e-4, 0.0, source="the prefill probe"), fixed_overhead_s=0.007,
                         source="this run's probes")
    filled = own.filled_from(probes)
    assert filled.source_of("fixed_overhead_s") == "this run's probes"
    assert filled.source_of("tier_efficiency") == "/runs/m1"           # its own: not taken
    again = Calibration(source="another").filled_from(filled)           # taken twice: still where it came from
    assert again.source_of("fixed_overhead_s") == again.source_of("curve") == "this run's probes"
    sources = term_sources(filled, filled.tiers(TierBandwidths(disk_gbps=2.0)), "G1's storage sweep")
    assert sources["fixed"] == "this run's probes" and "(/runs/m1)" in sources["load disk"]


def test_model_load_and_checkpoint_seconds_come_from_the_judged_paths_figures(tmp_path):
    store = recorded_run(tmp_path)
    plan = make_plan(load_config(None), store)
    load, save = plan.figures["model_load_s"], plan.figures["checkpoint_save_s"]
    assert load["loader"] == "kvgate" and "× 0.95, the kvgate loader (G2's side-by-side ratio)" in load["basis"]
    assert save["writer"] == "kvgate" and save["basis"].endswith("× 0.75, the kvgate writer")
    assert save["value"] == pytest.approx(load_config(None).g2.checkpoint.spec().total_bytes / (2.0e9 * 0.75))


def test_each_g2_ttfts_error_is_split_over_its_terms_and_the_shares_add_up_to_it():
    from sizing.in_run import error_shares
    from sizing.plan import Plan, Prediction

    label = "G2 TTFT host-hit at 1024 tokens"
    terms = ({"term": "fixed", "seconds": 0.004, "source": "probe"}, {"term": "per-token", "seconds": 0.020,
             "source": "probe"}, {"term": "load host", "seconds": 0.001, "source": "machine"})
    before = Plan(predictions=[Prediction("g2", "ttft_ms", 25.0, "ms", label, "", {"mode": "host-hit"}, terms=terms)])
    before.comparison = [{"gate": "g2", "metric": "ttft_ms", "label": label, "unit": "ms", "predicted": 25.0,
                          "measured": 30.0}]
    refitted = ({"term": "fixed", "seconds": 0.005, "source": "G2"}, {"term": "per-token", "seconds": 0.023,
                "source": "G2"}, {"term": "load host", "seconds": 0.001, "source": "G2"})
    after = Plan(predictions=[Prediction("g2", "ttft_ms", 29.0, "ms", label, "", {"mode": "host-hit"}, terms=refitted)])
    error_shares(before, after)
    split = {t["term"]: t for t in before.comparison[0]["terms"]}
    assert split["fixed"]["error_s"] == pytest.approx(-0.001) and split["per-token"]["error_s"] == pytest.approx(-0.003)
    assert split["load host"]["error_s"] == pytest.approx(0.0) and split["form"]["error_s"] == pytest.approx(-0.001)
    assert sum(t["error_s"] for t in split.values()) == pytest.approx(-0.005)      # the error, 25 − 30 ms
    assert sum(t["share"] for t in split.values()) == pytest.approx(1.0)
    assert split["per-token"]["share"] == pytest.approx(0.6) and split["fixed"]["source"] == "probe"
    assert "per-token -3.0 ms" in before.comparison[0]["terms_text"]
    # a figure with no refitted counterpart (or not in ms) is left whole
    other = Plan(predictions=[], comparison=[{"gate": "g2", "metric": "ttft_ms", "label": "x", "unit": "ms",
                                              "predicted": 1.0, "measured": 2.0}])
    error_shares(other, after)
    assert "terms" not in other.comparison[0]


def test_the_seeds_deployment_class_example_plans_with_its_own_layout_and_claims(tmp_path):
    """examples/plan/seed-480b-tp8.yaml (a 480B-class MoE, TP8, an NVMe-oF array): its KV layout and its figures
    judged by the seed's claims (fewer users than the example's 384, for the suite's time)."""
    from pathlib import Path

    example = yaml.safe_load((Path(__file__).parents[2] / "examples" / "plan" / "seed-480b-tp8.yaml").read_text())
    example["g3"]["workload"]["users"] = 24
    example["g3"]["levels"] = [4, 8]
    (tmp_path / "gates.yaml").write_text(yaml.safe_dump(example))
    plan = make_plan(load_config(tmp_path / "gates.yaml", "full"))
    assert plan.figures["layout"]["bytes_per_token"] == 62 * 2 * 8 * 128 * 2          # 248 KiB of bf16 KV
    g2 = {p.label: p for p in plan.predictions if p.gate == "g2"}
    longest = "at 131072 tokens"
    assert g2[f"G2 TTFT disk-cold {longest}"].value < g2[f"G2 TTFT recompute {longest}"].value
    ratio = next(p for p in plan.predictions if p.metric == "disk_hit_ttft_vs_recompute")
    assert ratio.status == "PASS" and "≤ 25%" in ratio.reason          # judged by the seed's "8-20x" claim's rule
    assert any(p.metric == "ttft_p50_reduction" and p.status for p in plan.predictions)


def _damage(run, rows_first: str) -> None:
    measurements = run / "gates" / "g2" / "measurements.jsonl"
    measurements.write_text(rows_first + measurements.read_text())


@pytest.mark.parametrize("bad_rows, said", [
    ('{"gate": "g2", "metric": "ttft_ms", "value": "x", "context": {"mode": "recompute", "context_tokens": 1024}}\n',
     None),                                                             # text is no figure: not fitted, not damage
    ('{"gate": "g2", "metric": "ttft_ms", "value": NaN, "context": {"mode": "recompute", "context_tokens": 1024}}\n'
     '{"gate": "g2", "metric": "ttft_ms", "value": -Infinity, "context": {}}\n',
     None),                                     # a figure a gate could not compute: no figure, not damage either
    ('[1, 2]\n"text"\n{"metric": 5}\n{"metric": "ttft_ms", "context": [1]}\n{"metric": "ttft_ms", "val\n',
     "5 rows of"),
])
def test_plan_and_calibrate_read_a_damaged_run_as_far_as_it_is_whole_and_say_what_they_left_out(tmp_path, capsys,
                                                                                              bad_rows, said):
    run = tmp_path / "run"
    recorded_run(run)
    _damage(run, bad_rows)
    out = tmp_path / "calibration.json"
    assert main(["plan", "--calibrate", str(run), "--out", str(out)]) == 0
    calibrated = capsys.readouterr().out
    assert main(["plan", "--from", str(run)]) == 0
    planned = capsys.readouterr().out
    assert json.loads(out.read_text())["curve"]["b"] == pytest.approx(B_, rel=1e-6)    # the whole rows, fitted
    for text in (calibrated, planned):
        assert (said is None and "left out, damaged" not in text) or (said is not None and said in text), text


@pytest.mark.parametrize("name, damage, said", [
    ("machine_probe.json", lambda text: text[: len(text) // 2], "expected a JSON object, found unreadable JSON"),
    ("preflight.json", lambda text: "{}", "expected a JSON list, found a dict"),
])
def test_a_damaged_json_file_of_the_run_is_exit_2_naming_it(tmp_path, capsys, name, damage, said):
    run = tmp_path / "run"
    recorded_run(run)
    path = run / name
    path.write_text(damage(json.dumps({"host_copy_gbps": 5.0, "preset": "small"}) if name != "preflight.json"
                           else "[]"))
    assert main(["plan", "--from", str(run)]) == 2
    error = capsys.readouterr().err
    assert str(path) in error and said in error


def test_calibrate_leaves_out_a_constant_its_own_file_could_not_hold_and_says_so(tmp_path, capsys):
    run = tmp_path / "run"
    store = recorded_run(run)
    store.record("g2", "test_model_load", "model_load_loader", -0.5, loader="safetensors")   # odd rows: a ratio < 0
    for _ in range(9):                                                      # and starts < 0 (the median is one)
        store.record("g2", "test_service", "service_load", 1.0, "s", weights={"seconds": 3.0})
    out = tmp_path / "calibration.json"
    assert main(["plan", "--calibrate", str(run), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "loader_efficiency.safetensors left out: expected a finite number > 0, found -0.5" in text
    assert "service_start_s left out: expected a finite number >= 0, found -2.0" in text
    assert main(["plan", "--calibration", str(out)]) == 0                    # the file it wrote reads back
    saved = json.loads(out.read_text())
    assert "safetensors" not in saved["loader_efficiency"] and saved["service_start_s"] is None
    assert saved["curve"]["b"] == pytest.approx(B_, rel=1e-6)                # the sound constants kept


def test_calibrate_into_a_place_it_cannot_write_is_exit_2_and_leaves_no_temp_file(tmp_path, capsys):
    recorded_run(tmp_path / "run")
    (tmp_path / "taken").mkdir()
    assert main(["plan", "--calibrate", str(tmp_path / "run"), "--out", str(tmp_path / "taken")]) == 2
    assert f"--out: expected a file kvgate can write, found {str(tmp_path / 'taken')!r} refused" in \
        capsys.readouterr().err
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("value", [0, -1])
def test_a_g1_read_threshold_of_zero_or_less_is_taken_by_plan_as_by_run(tmp_path, capsys, value):
    (tmp_path / "gates.yaml").write_text(yaml.safe_dump(
        {"g1": {"thresholds": [{"metric": "seq_read_gbps", "op": ">=", "value": value}]}}))
    load_config(tmp_path / "gates.yaml")                                    # what kvgate run takes
    assert main(["plan", "--config", str(tmp_path / "gates.yaml")]) == 0     # kvgate plan takes it too
    assert "disk_gbps" not in capsys.readouterr().err


def test_a_run_with_nothing_to_fit_is_refused_by_calibrate_and_from_it_claims_no_fit(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    RunStore(tmp_path / "run").write_run_info({"run_id": "empty"})
    assert main(["plan", "--calibrate", str(tmp_path / "run"), "--out", str(tmp_path / "c.json")]) == 2
    assert "--calibrate: expected a run with measurements to fit" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()
    assert main(["plan", "--from", str(tmp_path / "run")]) == 0
    assert "fitted to this same run" not in capsys.readouterr().out


def test_a_directory_where_a_runs_rows_should_be_is_exit_2_naming_it(tmp_path, capsys):
    run = tmp_path / "run"
    recorded_run(run)
    rows = run / "gates" / "g2" / "measurements.jsonl"
    rows.unlink()
    rows.mkdir()
    assert main(["plan", "--from", str(run)]) == 2
    assert f"{rows}: expected a JSON-lines file, found a directory" in capsys.readouterr().err
    assert main(["report", str(run)]) == 2
    assert f"{rows}: expected a JSON-lines file, found a directory" in capsys.readouterr().err


def test_g3s_throughputs_and_its_ttft_p50s_are_each_held_to_the_mape_limit_apart():
    from sizing.plan import accuracy

    def row(metric: str, error: float) -> dict:
        return {"gate": "g3", "metric": metric, "label": metric, "context": {}, "error": error}

    rows = [row("output_tokens_per_s", 0.10), row("output_tokens_per_s", -0.06), row("ttft_p50_ms", 0.40),
            row("ttft_p50_ms", -0.20), row("hit_ratio", 0.01)]
    found = {a["label"]: a for a in accuracy(rows)}
    assert found["G3 throughput MAPE"]["value"] == pytest.approx(0.08)
    assert found["G3 throughput MAPE"]["text"] == "8.0% over 2 figures (within 15%)"
    assert found["G3 TTFT p50 MAPE"]["text"] == "30.0% over 2 figures (beyond 15%)"
    assert found["G3 hit ratio / TTFT reduction error"]["value"] == pytest.approx(0.01)


def test_a_g2_of_recompute_alone_takes_its_fixed_cost_with_the_prefill_probes_short_prompts(tmp_path):
    """A live vLLM's G2 measures recompute alone, at lengths thousands of tokens apart: least squares put the
    curve's intercept, the fixed cost every hit pays, at 0 (its G3 hits predicted at 3 ms against 81). The same
    server's prefill probe, when the run has one, gives the fit its short prompts."""
    from sizing.calibration import calibrate

    def server(n: int) -> float:          # a server with a 40-ms fixed cost
        return 0.040 + 2.0e-4 * n + 5.0e-8 * n * n

    store = RunStore(tmp_path)
    store.write_run_info({"run_id": "vllm", "gates": ["g2"]})
    # G2's medians as the server gave them, the shortest slow by a tenth (a noisy minute)
    for context, noise in ((1024, 0.9), (2048, 1.0), (4096, 1.0)):
        store.record("g2", "test_ttft", "ttft_ms", server(context - 16) * noise * 1e3, "ms", mode="recompute",
                     context_tokens=context)
    alone = calibrate(tmp_path)
    assert alone.curve.a == pytest.approx(0.0, abs=1e-3)        # the intercept lost: what the issue saw
    store.write_machine_probe({"prefill": {"role": "candidate", "seconds": 3.0, "points": [
        {"context_tokens": n, "prompt_tokens": n - 4, "seconds": server(n - 4), "rounds": [server(n - 4)]}
        for n in (16, 256, 768, 2304, 3840)]}})
    pooled = calibrate(tmp_path)
    assert pooled.curve.a == pytest.approx(0.040, rel=0.15)
    assert pooled.fixed_overhead_s == pooled.curve.a
    assert pooled.curve.source.endswith("G2's 3 and the prefill probe's 5")


def test_each_g3_target_steps_at_its_own_decode_cost_from_a_calibration(tmp_path):
    """A calibration fits each G3 target's steps apart (the baseline's also compute its prompts): a plan from it
    steps the baseline at the baseline's cost and the candidate at the candidate's; from a file that holds one cost
    (written before), both step at it."""
    from dataclasses import replace

    from sizing.calibration import calibrate
    from sizing.queueing import DecodeCost

    recorded_run(tmp_path)
    config = load_config(None, "quick")
    calibration = calibrate(tmp_path)
    assert calibration.baseline_decode.seconds(8) > 1.5 * calibration.decode.seconds(8)

    def throughputs(cal) -> dict:
        plan = make_plan(config, calibration=cal)
        return {(p.context["target"], p.context["concurrency"]): p.value for p in plan.predictions
                if p.metric == "output_tokens_per_s"}

    own, shared = throughputs(calibration), throughputs(replace(calibration, baseline_decode=None))
    slower = throughputs(replace(calibration, baseline_decode=DecodeCost(0.02, 0.01)))
    for (role, level), value in own.items():
        if role == "candidate":     # its blocks as long as the baseline's at the level before: near, not equal
            assert value == pytest.approx(shared[(role, level)], rel=0.05)
            assert value == pytest.approx(slower[(role, level)], rel=0.05)
        else:
            assert value < shared[(role, level)] and slower[(role, level)] < 0.8 * value, (role, level)


def test_the_reduction_error_says_whether_each_prediction_lies_inside_the_gates_own_interval():
    """G3 judges a TTFT reduction with a 95% interval (3 pairs at c=2: 49 to 97% in a quick run); the accuracy line
    says how many predicted reductions it holds beside the worst error in points, which stays judged by its limit."""
    from sizing.plan import accuracy

    def row(metric, predicted, measured, interval=None, level=2):
        return {"gate": "g3", "metric": metric, "label": f"G3 {metric} at c={level}", "predicted": predicted,
                "measured": measured, "error": predicted - measured, "interval": interval,
                "context": {"concurrency": level}}

    rows = [row("ttft_p50_reduction", 0.794, 0.867, (0.49, 0.97)),
            row("ttft_p50_reduction", 0.90, 0.93, (0.92, 0.96), 4), row("hit_ratio", 0.17, 0.19)]
    line = next(a for a in accuracy(rows) if a["label"] == "G3 hit ratio / TTFT reduction error")
    assert line["value"] == pytest.approx(0.073) and "beyond 5" in line["text"]
    assert line["text"].endswith("; 1 of 2 predicted reductions inside the gate's own 95% intervals (the widest, "
                                 "G3 ttft_p50_reduction at c=2: 49 to 97%)"), line["text"]
    without = next(a for a in accuracy([row("hit_ratio", 0.17, 0.19)]) if a["gate"] == "g3")
    assert "intervals" not in without["text"]


def test_g2s_accuracy_line_says_how_many_predicted_ttfts_lie_inside_their_medians_own_interval(tmp_path):
    """A G2 TTFT is the median of its rounds; on the tiny preset they lay 25-42% from it (hits of 6-12 ms, one round
    in three stalled 2-3x), so the line says which predictions the gate itself could not tell from its figure."""
    from kvcore.rundata import RunStore
    from sizing.plan import Plan, Prediction, compare

    store = RunStore(tmp_path)
    rounds = {("host-hit", 1024): [5.8, 6.1, 6.2, 7.1, 27.9, 15.2, 5.2], ("recompute", 1024): [12.1, 12.3, 14.4]}
    for (mode, tokens), values in rounds.items():
        for i, value in enumerate(values):
            store.record("g2", "test_ttft", "ttft_round_ms", value, "ms", mode=mode, context_tokens=tokens, round=i)
        store.record("g2", "test_ttft", "ttft_ms", sorted(values)[len(values) // 2], "ms", mode=mode,
                     context_tokens=tokens)
    plan = Plan(predictions=[Prediction("g2", "ttft_ms", 6.5, "ms", "G2 TTFT host-hit at 1024 tokens", "",
                                        context={"mode": "host-hit", "context_tokens": 1024}),
                             Prediction("g2", "ttft_ms", 9.7, "ms", "G2 TTFT recompute at 1024 tokens", "",
                                        context={"mode": "recompute", "context_tokens": 1024})])
    compare(plan, store)
    host, recompute = plan.comparison
    assert host["interval"][0] <= 6.2 <= host["interval"][1] and host["interval"][1] > 7.0
    assert recompute["interval"][0] > 9.7          # below every round: outside
    line = next(a for a in plan.accuracy if a["gate"] == "g2")
    assert "; 1 of 2 predicted TTFTs inside the gate's own 95% intervals (the widest, G2 TTFT host-hit at 1024 " \
           "tokens: " in line["text"], line["text"]
