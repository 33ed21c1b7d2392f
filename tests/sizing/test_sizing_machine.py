"""The sizing model before any G2, against kvgate's own engine: the prefill probe just before G2 (the recompute
server's first tokens at a few lengths) becomes the recompute curve, the machine probe (matmul and attention
FLOP/s at the embedded model's shapes, its decode step, its host copy) the decode cost, the host tier's GB/s and,
without a prefill probe, a roofline; a calibration file or the run's own G2 still come first; a real
`kvgate run g2` shows G2 predicted beside measured, each TTFT's error split over its terms."""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
from dataclasses import replace
from typing import Optional

import pytest
import yaml

from gates.config import load_config
from gates.machine_probe import (
    PREFILL_ROUNDS,
    prefill_lengths,
    prefill_probe,
    probe_client,
    run_machine_probe,
    window_gaps,
)
from gates.targets import Endpoint
from kvcore.rundata import RunStore
from kvcore.sampling import RoundsConfig
from kvcore.settings import ConfigError
from sizing.calibration import Calibration
from sizing.in_run import stage_plan
from sizing.machine import (
    hit_points,
    machine_words,
    prefill_points,
    probe_calibration,
    probe_decode,
    server_probe_words,
)
from sizing.plan import make_plan
from sizing.queueing import DecodeCost
from sizing.timing import RecomputeCurve, TierBandwidths, TimingModel
from tests.recorded_runs import recorded_run
from workloads.traffic.client import StreamingClient
from workloads.traffic.datasets import BYTE_TOKENIZER_ID, context_request

SERVER = RecomputeCurve(0.004, 7.5e-5, 1.5e-8)   # a server's first-token seconds (the prefill probe's points)


def _prefill(curve: RecomputeCurve, longest: int = 8192) -> dict:
    """The prefill probe's figures as a server whose first tokens follow `curve` would give them."""
    points = [{"context_tokens": n, "prompt_tokens": n - 4, "seconds": curve.seconds(n - 4)}
              for n in prefill_lengths(longest)]
    return {"role": "recompute", "points": points, "seconds": 1.0}


@pytest.fixture(scope="module")
def config():
    return load_config(None, "quick")


@pytest.fixture(scope="module")
def probe(config):
    """The real probe, on this machine, for the quick profile's embedded preset (and a prefill probe's points)."""
    return {**run_machine_probe(config.targets.embedded), "prefill": _prefill(SERVER)}


def _g2_ttfts(plan) -> dict[tuple[str, int], float]:
    return {(p.context["mode"], p.context["context_tokens"]): p.value / 1e3 for p in plan.predictions
            if p.gate == "g2" and p.metric == "ttft_ms"}


def test_the_probe_measures_this_machine_at_the_embedded_models_own_shapes(config, probe):
    import torch

    from cache_impl.engine.model import build_model

    assert "error" not in probe and probe["preset"] == config.targets.embedded.preset
    model = build_model(probe["preset"], 0, torch.device("cpu"))
    # the weights a prompt token is multiplied by: every layer's matrices (not the embedding, not the head)
    assert probe["matmul_params"] == sum(p.numel() for p in model.layers.parameters() if p.dim() == 2)
    assert (probe["layers"], probe["attention_dim"]) == (model.args.n_layers, model.args.dim)
    assert probe["matmul_flops"] > 0 and probe["attention_flops"] > 0 and probe["host_copy_gbps"] > 0
    decode = probe["decode"]
    assert decode["max_batch"] == config.targets.embedded.max_running and decode["batch_1_s"] > 0
    assert decode["step_s"] >= 0 and decode["per_sequence_s"] >= 0


def test_before_any_run_g2_is_predicted_from_the_servers_own_prefill_and_the_probes_host_copy(config, probe):
    machine = probe_calibration(probe)
    plan = make_plan(config, machine=machine)
    ttft = _g2_ttfts(plan)
    contexts = sorted(config.g2.contexts)
    assert set(ttft) == {(mode, c) for mode in ("recompute", "host-hit", "disk-cold") for c in contexts}
    # the curve is the server's, fitted to the prefill probe's lengths (none of them G2's)
    assert not set(prefill_lengths(max(contexts))) & set(contexts) - {256}
    for context in contexts:
        assert ttft[("recompute", context)] == pytest.approx(SERVER.seconds(context - 4), rel=1e-6)
    assert machine.curve.source.startswith("the prefill probe: fit of 5 recompute TTFTs")
    roofline = next(note for note in plan.notes if "the model's FLOPs alone" in note)
    assert "the rest is the engine's work beyond its matmuls" in roofline
    # what the probe measured goes where a calibration's constants would
    assert machine.decode == DecodeCost(probe["decode"]["step_s"], probe["decode"]["per_sequence_s"])
    assert machine.host_gbps == probe["host_copy_gbps"]
    assert any(note.startswith(("machine probe (cpu", "machine probe (cuda")) for note in plan.notes)
    # a hit: the fixed overhead, the uncached tail's share of the curve and the load, each with its source
    longest = contexts[-1]
    hit = next(p for p in plan.predictions if p.label == f"G2 TTFT host-hit at {longest} tokens")
    terms = {t["term"]: t for t in hit.terms}
    assert set(terms) == {"fixed", "per-token", "attention", "load host"}
    assert sum(t["seconds"] for t in terms.values()) * 1e3 == pytest.approx(hit.value)
    prompt = longest - 4
    cached = prompt // 256 * 256
    assert terms["fixed"]["seconds"] == pytest.approx(SERVER.a, rel=1e-6)
    assert terms["per-token"]["seconds"] + terms["attention"]["seconds"] == pytest.approx(
        SERVER.compute(prompt) - SERVER.compute(cached), rel=1e-6)
    assert "prefill probe" in terms["per-token"]["source"] and "machine probe" in terms["load host"]["source"]
    # and from its host copy: twice the GB/s, half a host hit's load
    host = probe_calibration({**probe, "host_copy_gbps": 2 * probe["host_copy_gbps"]})
    quicker = _g2_ttfts(make_plan(config, machine=host))
    load = ttft[("host-hit", longest)] - quicker[("host-hit", longest)]
    assert (
        load == pytest.approx(terms["load host"]["seconds"] / 2)
        and quicker[("recompute", longest)] == ttft[("recompute", longest)]
    )
    # G3's decode cost is the probe's, not a lower bound estimated from the curve
    assert not any("estimated from G2's recompute curve" in note for note in plan.notes)


def _hits(model: TimingModel, longest: int = 8192) -> dict:
    """The hit probe's figures as a tiered server whose hits follow `model` would give them."""
    points = []
    for n in (n for n in prefill_lengths(longest) if n > 256):
        prompt = n - 4
        cached = prompt // 256 * 256
        for mode, tier in (("host-hit", "host"), ("disk-cold", "disk")):
            points.append({"mode": mode, "context_tokens": n, "prompt_tokens": prompt, "cached_tokens": cached,
                           "seconds": model.ttft(prompt, {tier: cached})})
    return {"role": "candidate", "points": points, "seconds": 2.0}


def test_the_hit_probe_gives_the_fixed_cost_and_the_disk_hits_overhead_before_g2(config, probe):
    disk_gbps = make_plan(config, machine=probe_calibration(probe)).figures["disk_gbps"]["value"]
    tiers = TierBandwidths(host_gbps=probe["host_copy_gbps"], disk_gbps=disk_gbps, overhead_s={"disk": 0.003})
    server = TimingModel(SERVER, tiers, probe["kv_bytes_per_token"])     # a hit's fixed cost: the curve's intercept
    probed = {**probe, "hits": _hits(server)}
    machine = probe_calibration(probed, disk_gbps)
    assert machine.tier_overhead_s["disk"] == pytest.approx(0.003, rel=1e-3)
    assert machine.fixed_overhead_s == pytest.approx(SERVER.a, rel=1e-3)
    assert machine.curve.source.startswith("the prefill and hit probes: joint fit of 11 first tokens")
    ttft = _g2_ttfts(make_plan(config, machine=machine))
    for context in config.g2.contexts:       # none of the probes' lengths: G2's figures, predicted
        prompt = context - 4
        cached = prompt // 256 * 256
        assert ttft[("disk-cold", context)] == pytest.approx(server.ttft(prompt, {"disk": cached}), rel=1e-3)
        assert ttft[("host-hit", context)] == pytest.approx(server.ttft(prompt, {"host": cached}), rel=1e-3)
    # control: without the prefill probe's curve or the disk's GB/s the hits do not stand alone
    assert probe_calibration(probed).tier_overhead_s == {}
    assert "disk hits left out" in probe_calibration(probed).notes[1]
    assert probe_calibration({**probe, "hits": {"role": "candidate", "error": "boom"}}).fixed_overhead_s is None


def test_the_hit_probes_hits_come_from_their_placed_tier_though_its_prefixes_outgrow_the_host_tier(tmp_path):
    # a real tiered server whose host tier holds 8 blocks; the probe's prefixes (1, 4 and 7 blocks) hold 12: asked
    # for first, a host hit found its prefix pushed out of the host tier by the others' and was served from disk
    from gates.machine_probe import hit_probe
    from gates.targets import Endpoint
    from tests.servers import ADMIN_TOKEN, ServerProcess

    server = ServerProcess(tmp_path, mode="tiered", admin=True, engine={"cache": {"host_capacity_bytes": "1MiB"}})
    try:
        server.wait_healthy()
        endpoint = Endpoint("candidate", f"{server.base_url}/v1", "kvgate-tiny", admin=True, mode="tiered",
                            tokenizer="kvgate-byte-v1")
        found = hit_probe(endpoint, 2048, admin_token=ADMIN_TOKEN)
    finally:
        server.stop()
    assert "points" in found, found
    served = {(p["mode"], p["context_tokens"]): p["tiers"] for p in found["points"]}
    rounds = {(p["mode"], p["context_tokens"]): len(p["rounds"]) for p in found["points"]}
    blocks = {384: 1, 1152: 4, 1920: 7}
    assert served == {(mode, n): {tier: rounds[(mode, n)] * blocks[n]} for n in blocks
                      for mode, tier in (("host-hit", "host"), ("disk-cold", "disk"))}      # every round whole
    assert all(PREFILL_ROUNDS.min <= r <= PREFILL_ROUNDS.max for r in rounds.values())
    assert all(rounds[("host-hit", n)] == rounds[("disk-cold", n)] for n in blocks)      # a length's round: both
    assert all(p["from_placed_tier"] for p in found["points"])
    # a point served from elsewhere stays out of the fit
    stray = {**found, "points": [{**p, "from_placed_tier": p["mode"] != "host-hit"} for p in found["points"]]}
    assert {mode for mode, *_ in hit_points({"hits": stray})} == {"disk-cold"}
    said = server_probe_words({"hits": stray})
    assert "host-hit at 384 tokens" in said and "(served by host: left out of the fit)" in said


def test_without_a_prefill_probe_the_models_flops_stand_in_and_twice_the_rate_halves_the_compute(config, probe):
    bare = {key: value for key, value in probe.items() if key != "prefill"}
    machine = probe_calibration(bare)
    assert machine.curve.source.startswith("the pre-flight's machine probe: roofline")
    ttft = _g2_ttfts(make_plan(config, machine=machine))
    faster = {**bare, "matmul_flops": 2 * bare["matmul_flops"], "attention_flops": 2 * bare["attention_flops"]}
    twice = _g2_ttfts(make_plan(config, machine=probe_calibration(faster)))
    for context in config.g2.contexts:
        assert twice[("recompute", context)] == pytest.approx(ttft[("recompute", context)] / 2)


def test_the_decode_window_is_where_every_stream_decodes():
    # three streams: the last one's first token at 0.30, the first to finish at 0.50
    streams = [[0.10, 0.20, 0.30, 0.32, 0.40, 0.50], [0.15, 0.31, 0.33, 0.45, 0.60], [0.30, 0.34, 0.36, 0.52]]
    gaps = window_gaps(streams)
    assert gaps == pytest.approx([0.02, 0.08, 0.10, 0.02, 0.12, 0.04, 0.02])
    # control: a stream that ends before another's first token leaves no step where all of them decoded
    assert window_gaps([[0.0, 0.1, 0.2], [0.3, 0.4, 0.5]]) == []


def test_the_decode_probe_times_each_token_by_its_own_chunk_where_the_record_kept_them():
    from gates.machine_probe import token_times
    from workloads.traffic.client import RequestRecord

    # a vLLM stream of 4 tokens, the second's bytes not decodable yet (empty text): its text chunks' gaps skip it
    record = RequestRecord("r", "s", 0, "candidate", 100.0, 100.0, 0.0, ok=True, ttft_s=0.30, itl_s=[0.10],
                           token_times_s=[0.30, 0.35, 0.40, 0.45])
    assert token_times(record) == pytest.approx([100.30, 100.35, 100.40, 100.45])
    # control: a record without them (kvgate serve streams text at every token) is timed by its text chunks
    record.token_times_s = None
    assert token_times(record) == pytest.approx([100.30, 100.40])


def test_the_servers_decode_gaps_stand_in_for_the_models_decode_pass(config, probe):
    server = {"role": "recompute", "context_tokens": 1536, "batch_1_s": 0.002, "batch_max_s": 0.0076,
              "max_batch": 8, "step_s": 0.0012, "per_sequence_s": 0.0008, "gaps": {"1": 79, "8": 282},
              "seconds": 2.4}
    decode, note = probe_decode({**probe, "server_decode": server})
    assert decode == DecodeCost(0.0012, 0.0008) and "the decode probe before G3" in note
    assert probe_calibration({**probe, "server_decode": server}).decode == decode
    # without it (or when it failed) the model's own decode pass, said so
    for missing in ({}, {"server_decode": {"role": "recompute", "error": "boom"}}):
        decode, note = probe_decode({**probe, **missing})
        assert decode == DecodeCost(probe["decode"]["step_s"], probe["decode"]["per_sequence_s"])
        assert note.startswith("decode from the model's decode pass alone")



def _before_g3(root, probe: dict) -> RunStore:
    """A recorded run as it stands just before its G3: G1 and G2 passed, the probes recorded, no G3 yet."""
    run = recorded_run(root)
    shutil.rmtree(run.raw_dir("g3"))
    for gate in ("g1", "g2"):
        run.set_status(gate, "passed")
    run.write_machine_probe(probe)
    return run


def _load_probe(timing: TimingModel, decode: DecodeCost, levels=(2, 8), prompts: int = 16,
                role: str = "candidate", tier: str = "device") -> dict:
    """The load probe's figures as a server whose steps follow `timing` and `decode` would give them: each level a
    closed loop, simulated, over the candidate's cycle of returning prompts (every whole block cached, in `tier`),
    or the baseline's new prompts (none cached)."""
    from sizing.queueing import EngineModel, ServedRequest, simulate_closed_loop

    engine = EngineModel(timing, decode, 8)
    cached = 1792 if role == "candidate" else 0
    cycle = [ServedRequest(1920 + 4 * i, 16, {tier: cached}) for i in range(prompts)] * 4
    found = {str(level): [{"prompt_tokens": cycle[r.index].prompt_tokens, "cached_tokens": cached,
                           "completion_tokens": r.output_tokens, "ttft_s": r.ttft_s, "itl_s": list(r.itl_s)}
                          for r in simulate_closed_loop(cycle, level, engine)] for level in levels}
    return {"role": role, "context_tokens": 1920, "output_tokens": 16, "prompts": prompts,
            "returns": role == "candidate", "levels": found, "seconds": 6.0}


def test_the_load_probe_gives_each_targets_decode_cost_of_steps_where_requests_come_and_go():
    """A candidate server whose steps cost 1.0 ms + 1.3 ms a sequence while returning prompts come and go, and a
    baseline whose steps cost 2.0 ms + 2.1 ms beside its new prompts' prefill: the fit to each one's load probe gaps
    between tokens, each level simulated with its prefill chunks, finds each cost again (the decode probe's steps,
    which only decode, said beside it); a run recorded with the candidate's probe alone still reads; without the
    probe, or when a target's failed, none for it, and why."""
    from sizing.machine import load_costs, load_words

    timing = TimingModel(SERVER, TierBandwidths(), 1024, 256)
    costs = {"candidate": DecodeCost(0.0010, 0.0013), "baseline": DecodeCost(0.0020, 0.0021)}
    decode_probe = {"role": "recompute", "context_tokens": 1920, "batch_1_s": 0.002, "batch_max_s": 0.0076,
                    "max_batch": 8, "step_s": 0.0012, "per_sequence_s": 0.0008, "gaps": {}, "seconds": 1}
    loads = {role: _load_probe(timing, cost, role=role) for role, cost in costs.items()}
    found, words = load_costs({"server_load": loads, "server_decode": decode_probe}, timing, 8)
    assert sorted(found) == ["baseline", "candidate"]
    for role, cost in costs.items():
        assert found[role].decode.seconds(8) == pytest.approx(cost.seconds(8), rel=0.03), role
        assert found[role].decode.seconds(2) == pytest.approx(cost.seconds(2), rel=0.05), role
    assert any(w.startswith("the baseline's G3 decode cost from the load probe before G3") for w in words), words
    assert all("the decode probe's 7.60 ms" in w for w in words)
    assert "at 8 users" in load_words(loads["candidate"]) and "16 prompts of 1,920 tokens" in \
        load_words(loads["candidate"])
    assert "16 new prompts of 1,920 tokens" in load_words(loads["baseline"])
    # returns from the disk: fitted with their loads charged as G3's simulation charges its hits', the cost is found
    # again; taken as resident, the loads land in the decode cost (and G3's simulation would charge them twice)
    slow_disk = TimingModel(SERVER, TierBandwidths(disk_gbps=0.25), 1024, 256)
    from_disk = {"server_load": {"candidate": _load_probe(slow_disk, costs["candidate"], tier="disk")}}
    found, _ = load_costs(from_disk, slow_disk, 8, returns_from="disk")
    assert found["candidate"].decode.seconds(8) == pytest.approx(costs["candidate"].seconds(8), rel=0.03)
    resident, _ = load_costs(from_disk, slow_disk, 8)
    assert resident["candidate"].decode.seconds(8) > 1.2 * costs["candidate"].seconds(8)
    # a run recorded before the baseline was probed: the candidate's probe alone, as it was recorded
    found, _ = load_costs({"server_load": loads["candidate"]}, timing, 8)
    assert list(found) == ["candidate"]
    failed = {**loads, "baseline": {"role": "baseline", "error": "boom"}}
    for missing, role, why in (({}, None, "no load probe ran"), ({"server_load": failed}, "baseline", "boom")):
        found, words = load_costs(missing, timing, 8)
        assert role not in found and words[-1].endswith(why) and "decode probe alone" in words[-1]


def test_the_candidates_returns_give_a_requests_fixed_cost_under_load():
    """G2 times each hit alone on a new connection after the caches were dropped; G3's returns come one after another
    on kept connections. A candidate whose requests cost 1 ms each beyond their loads and prefill under load, where
    the TTFT model (from idle requests) says 6 ms: the fit to the load probe's first tokens finds 1 ms, with the decode
    cost still found; G3's candidate is simulated with it. A probe recorded without first-token times fits none."""
    from sizing.machine import load_costs

    idle = TimingModel(SERVER, TierBandwidths(), 1024, 256, fixed_overhead_s=0.006)
    under_load, cost = replace(idle, fixed_overhead_s=0.001), DecodeCost(0.0010, 0.0013)
    probe = {"server_load": {"candidate": _load_probe(under_load, cost),
                             "baseline": _load_probe(under_load, cost, role="baseline")}}
    found, words = load_costs(probe, idle, 8)
    candidate = found["candidate"]
    assert candidate.fixed_overhead_s == pytest.approx(0.001, abs=3e-4)
    assert candidate.decode.seconds(8) == pytest.approx(cost.seconds(8), rel=0.03)
    assert candidate.timing(idle).overhead == candidate.fixed_overhead_s
    assert found["baseline"].fixed_overhead_s is None and found["baseline"].timing(idle) is idle
    said = f"a request's fixed cost {candidate.fixed_overhead_s * 1e3:.2f} ms under load (the TTFT model's 6.00 ms"
    assert any(said in w for w in words), words
    # with a calibration's decode costs (a G3's): those kept, the fixed cost fitted with them
    kept, words = load_costs(probe, idle, 8, decodes={"candidate": cost, "baseline": cost})
    assert kept["candidate"].decode == cost and kept["candidate"].fixed_overhead_s == pytest.approx(0.001, abs=3e-4)
    assert words == [f"the candidate's G3 steps from the load probe before G3: a request's fixed cost "
                     f"{kept['candidate'].fixed_overhead_s * 1e3:.2f} ms under load (the TTFT model's 6.00 ms, from "
                     "idle requests; its first tokens' trimmed mean), the server's stalls "
                     f"{kept['candidate'].stall_s * 1e3:.2f} ms a request (their mean beyond it)"]
    assert kept["candidate"].stall_s < 3e-4            # a server that never stalls
    for records in probe["server_load"]["candidate"]["levels"].values():
        for record in records:
            del record["ttft_s"]
    assert load_costs(probe, idle, 8)[0]["candidate"].fixed_overhead_s is None


def test_a_servers_stalls_cost_the_closed_loop_their_time_and_leave_the_fixed_cost_and_median_first_token():
    """vLLM stalled two requests at once for 200-500 ms, 4 of 50 at the load probe's 2 users (vB6): fitted to the
    mean first token, the fixed cost took 49 ms where G3's candidate answered its median in 24. The fixed cost comes
    from the trimmed mean, the stalls from the mean beyond it, held by the user after each answer: throughput loses
    their time, the median first token stays."""
    from sizing.machine import load_costs
    from sizing.queueing import EngineModel, ServedRequest, simulate_closed_loop

    idle = TimingModel(SERVER, TierBandwidths(), 1024, 256, fixed_overhead_s=0.006)
    under_load, cost = replace(idle, fixed_overhead_s=0.001), DecodeCost(0.0010, 0.0013)
    probe = {"server_load": {"candidate": _load_probe(under_load, cost)}}
    lowest = probe["server_load"]["candidate"]["levels"]["2"]
    for record in lowest[5:7] + lowest[40:42]:          # two requests at once, twice: +0.3 s
        record["ttft_s"] += 0.3
    found = load_costs(probe, idle, 8, decodes={"candidate": cost})[0]["candidate"]
    stalls = 4 * 0.3 / len(lowest)                      # 18.75 ms a request: a fit to the mean puts 19.75 ms fixed
    assert 0.001 <= found.fixed_overhead_s < 0.005      # the stalled requests' own times trimmed with them
    assert found.fixed_overhead_s + found.stall_s == pytest.approx(0.001 + stalls, rel=0.1)
    cycle = [ServedRequest(1920 + 4 * i, 16, {"device": 1792}) for i in range(16)] * 4
    steady, stalled = (simulate_closed_loop(cycle, 2, EngineModel(under_load, cost, 8, stall_s=stall))
                       for stall in (0.0, found.stall_s))
    assert statistics.median(r.ttft_s for r in stalled) == pytest.approx(statistics.median(r.ttft_s for r in steady),
                                                                       abs=0.0015)   # within a step
    span = {name: max(r.done_s for r in rows) for name, rows in (("steady", steady), ("stalled", stalled))}
    assert span["stalled"] == pytest.approx(span["steady"] + len(cycle) / 2 * found.stall_s, rel=0.05)
    with pytest.raises(ConfigError, match="stall_s"):
        EngineModel(under_load, cost, stall_s=-1.0)


def test_g3_is_predicted_with_each_targets_load_probe_decode_cost_until_a_g3_of_the_run_gives_its_own(
        tmp_path, config, probe):
    run = _before_g3(tmp_path / "recorded", probe)
    idle, _ = stage_plan(config, run, "g3")
    timing = TimingModel(SERVER, TierBandwidths(), 1024, 256)
    slow, fast = DecodeCost(0.004, 0.006), DecodeCost(0.0010, 0.0013)  # 52 ms a step of 8: slower than any decode pass
    run.write_machine_probe({**probe, "server_load": {"candidate": _load_probe(timing, slow)}})
    plan, problem = stage_plan(config, run, "g3")
    assert not problem and any("G3 decode cost from the load probe before G3" in n for n in plan.notes), plan.notes
    assert any("the candidate server under load: " in n for n in plan.notes)   # the probe's own line says its gaps

    def throughput(p, role: str) -> float:
        return next(x.value for x in p.predictions if x.metric == "output_tokens_per_s"
                    and x.context == {"target": role, "concurrency": 8})

    assert throughput(plan, "candidate") < 0.6 * throughput(idle, "candidate")
    assert throughput(plan, "baseline") < throughput(idle, "baseline")   # no baseline probe: the candidate's cost
    # each target its own: a baseline slow under load, beside a candidate that is not
    run.write_machine_probe({**probe, "server_load": {"candidate": _load_probe(timing, fast),
                                                      "baseline": _load_probe(timing, slow, role="baseline")}})
    own, _ = stage_plan(config, run, "g3")
    assert any(n.startswith("the baseline's G3 decode cost from the load probe") for n in own.notes), own.notes
    assert throughput(own, "candidate") > 1.5 * throughput(plan, "candidate")
    assert throughput(own, "baseline") == pytest.approx(throughput(plan, "baseline"), rel=0.1)
    # a run whose G3 has run: its decode costs are its own G3's (the probe gives the candidate's fixed cost alone)
    whole = recorded_run(tmp_path / "whole")
    whole.write_machine_probe({**probe, "server_load": {"candidate": _load_probe(timing, fast)}})
    after = make_plan(config, whole)
    assert not any("decode cost from the load probe" in n for n in after.notes), after.notes
    assert any(n.startswith("the candidate's G3 steps from the load probe before G3: a request's fixed cost")
               for n in after.notes), after.notes


def test_a_g3_workload_that_cannot_be_built_leaves_the_decode_probe_an_error_not_the_run(tmp_path, config, probe,
                                                                                         monkeypatch):
    import io

    from rich.console import Console

    import gates.run
    from gates.targets import Endpoint

    def unbuildable(_config):
        raise ValueError("no such trace")

    monkeypatch.setattr(gates.run, "g3_decode_context", unbuildable)
    runner = gates.run.GateRunner(config, tmp_path, "r", ["g3"], False, Console(file=io.StringIO(), width=200))
    runner.store.write_machine_probe(probe)
    runner.endpoints = {"recompute": Endpoint("recompute", "http://127.0.0.1:9/v1", "kvgate-small")}
    runner._probe_decode()
    decode = runner.store.machine_probe()["server_decode"]
    assert decode == {"role": "recompute", "error": "G3's workload: ValueError: no such trace"}
    assert probe_decode(runner.store.machine_probe())[1].startswith("decode from the model's decode pass alone")
    # the load probe's share of the workload unbuildable: each target's probe an error, no request sent (dead URLs)
    monkeypatch.setattr(gates.run, "g3_output_tokens", unbuildable)
    runner.endpoints = {role: Endpoint(role, "http://127.0.0.1:9/v1", "kvgate-small")
                        for role in ("candidate", "baseline")}
    loads: dict = {}
    runner._probe_load(loads, 1920)
    assert loads["server_load"] == {role: {"role": role, "error": "G3's workload: ValueError: no such trace"}
                                    for role in ("candidate", "baseline")}


def test_a_failed_probe_leaves_the_plan_as_it_was(config):
    assert probe_calibration({"error": "the machine probe exited 1: boom"}) is None
    assert probe_calibration({}) is None
    assert not make_plan(config, machine=None).predictions


def test_a_calibration_file_and_the_runs_own_g2_come_before_the_probe(tmp_path, config, probe):
    file = tmp_path / "calibration.json"
    Calibration(curve=RecomputeCurve(0.05, 3e-4, 2e-8, "an earlier run"), fixed_overhead_s=0.05,
                source="an earlier run").save(file)
    (tmp_path / "gates.yaml").write_text(yaml.safe_dump({"sizing": {"calibration": str(file)}}))
    configured = load_config(tmp_path / "gates.yaml", "quick")
    store = RunStore(tmp_path / "run")
    store.write_machine_probe(probe)
    plan, problem = stage_plan(configured, store, "g2")
    assert problem == ""
    recorded = {(r["context"]["mode"], r["context"]["context_tokens"]): r["value"] / 1e3
                for r in store.predictions() if r["stage"] == "before g2" and r["metric"] == "ttft_ms"}
    for context in configured.g2.contexts:          # the file's curve, not the probe's
        assert recorded[("recompute", context)] == pytest.approx(RecomputeCurve(0.05, 3e-4, 2e-8).seconds(context - 4))
    assert any("from this run's probes of the machine" in note and "curve" not in note.split(" from ")[0]
               for note in plan.notes)          # the probe fills only what the file lacks (its decode, the host)

    # after G2, the run's own fit of its G2 TTFTs; the probe gives what G3 has not measured yet (the decode)
    run = _before_g3(tmp_path / "recorded", probe)
    plan, problem = stage_plan(config, run, "g3")
    taken = next(note for note in plan.notes if note.endswith("(no gate of this run measured them)"))
    assert taken.startswith("decode") and "curve" not in taken and "this run's probes of the machine" in taken


# --------------------------------------------------------------------------- a real run

needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (Debian package 'fio')")


@needs_fio
@pytest.mark.slow
def test_a_default_run_of_g2_predicts_it_from_the_probe_and_shows_predicted_beside_measured(g1_g2_run):
    """The session's `kvgate run g1 g2` on the tiny preset (tests/gate_runs.py, shared with test_run_e2e)."""
    code, run_dir = g1_g2_run.code, g1_g2_run.run_dir
    assert code in (0, 1)
    store = RunStore(run_dir)
    probe = store.machine_probe()
    assert probe["preset"] == "tiny" and probe["matmul_flops"] > 0        # what the predictions rest on, recorded
    prefill = probe["prefill"]          # the recompute server's own first tokens, across G2's range
    assert "points" in prefill, prefill     # a probe that failed says why
    assert [p["context_tokens"] for p in prefill["points"]] == prefill_lengths(1100) == [16, 256, 640, 1024]
    assert all(p["seconds"] > 0 and PREFILL_ROUNDS.min <= len(p["rounds"]) <= PREFILL_ROUNDS.max
               for p in prefill["points"])
    assert len(prefill["points"][0]["rounds"]) > PREFILL_ROUNDS.min     # milliseconds each: repeated within budget
    assert [p["prompt_tokens"] for p in prefill["points"]] == [12, 252, 636, 1020]   # as its usage counted them
    hits = probe["hits"]                # the tiered server's own hits, placed in host and on disk, at 640 and 1024
    assert "points" in hits, hits
    assert {(p["mode"], p["context_tokens"]) for p in hits["points"]} == {
        (mode, n) for mode in ("host-hit", "disk-cold") for n in (640, 1024)}
    assert all(p["cached_tokens"] >= 512 and p["seconds"] > 0 for p in hits["points"])   # every one really a hit
    assert "server_decode" not in probe      # the decode is timed just before G3, which this run does not run
    before = [r for r in store.predictions() if r["stage"] == "before g2"]
    disk = next(r for r in before if r["metric"] == "ttft_ms" and r["context"]["mode"] == "disk-cold")
    assert any("prefill and hit probes" in t["source"] for t in disk["terms"]), disk["terms"]
    fixed = next(t for t in disk["terms"] if t["term"] == "fixed")     # the probes' too, not the run's own
    assert "probes" in fixed["source"] and str(run_dir) not in fixed["source"], fixed
    assert {(r["context"]["mode"], r["context"]["context_tokens"]) for r in before if r["metric"] == "ttft_ms"} == {
        (mode, context) for mode in ("recompute", "host-hit", "disk-cold") for context in (600, 1100)}
    sizing = json.loads((run_dir / "sizing.json").read_text())
    rows = {(r["metric"], r["context"].get("mode"), r["context"].get("context_tokens")): r
            for r in sizing["comparison"] if r["gate"] == "g2"}
    for context in (600, 1100):
        row = rows[("ttft_ms", "recompute", context)]
        measured = next(m["value"] for m in store.measurements("g2") if m["metric"] == "ttft_ms"
                        and m["context"] == {**m["context"], "mode": "recompute", "context_tokens": context})
        assert row["measured"] == measured and row["predicted"] > 0
        assert row["error"] == pytest.approx((row["predicted"] - measured) / measured)
    mape = next(a for a in sizing["accuracy"] if a["label"] == "G2 TTFT MAPE")
    assert mape["sample"].startswith("in sample") and mape["text"].endswith(mape["sample"])
    # each TTFT's error split over its terms (the constants refitted to the run's own G2), adding up to it
    for row in (r for r in sizing["comparison"] if r["metric"] == "ttft_ms"):
        assert sum(t["error_s"] for t in row["terms"]) * 1e3 == pytest.approx(row["predicted"] - row["measured"])
        assert {t["term"] for t in row["terms"]} >= {"fixed", "per-token", "attention", "form"}
    assert any(note.startswith("machine probe (") for note in sizing["notes"])
    out = " ".join(g1_g2_run.console.split())
    assert "machine probe (" in out and "G2 TTFT recompute at 1100 tokens" in out
    # the machine probed in the pre-flight; the servers' first tokens and hits just before G2, after G1 ran
    assert "the recompute server's first token" not in out[:out.index("G1 arrival acceptance:")]
    assert out.index("G1 arrival acceptance:") < out.index("before G2: the recompute server's first token: ")
    assert out.index("before G2: the recompute server's first token: ") < out.index("the candidate server's hits: ")


def test_the_accuracy_says_whether_its_constants_came_from_this_run_or_another(config):
    from pathlib import Path

    from sizing.in_run import constants_sample

    assert constants_sample(config, "g2") == "in sample: constants from this run's probes of its servers"
    assert constants_sample(config, "g3").endswith("probes of its servers and its G2")
    assert constants_sample(config, "g3", g2_ran=False).endswith("probes of its servers")     # G3 run without G2
    # an external engine is not probed: its G3 rests on its G2 alone
    assert constants_sample(config, "g3", probed=False) == "in sample: constants from this run's G2"
    filed = config.model_copy(update={"sizing": config.sizing.model_copy(update={"calibration": Path("small.json")})})
    assert constants_sample(filed, "g2") == "out of sample: constants from small.json"
    assert constants_sample(filed, "g3").startswith("out of sample where this run's G2 fits none")
    assert constants_sample(filed, "g3", g2_ran=False) == "out of sample: constants from small.json"


@contextlib.contextmanager
def _served(engine, role: str, tokenizer: Optional[str] = None):
    """`engine` served by kvgate's real app on a loopback port in this process: its Endpoint as `role` (prompts
    sized by `tokenizer`)."""
    import threading
    import time

    import uvicorn

    from cache_impl.server.server import create_app
    from tests.servers import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, f"the {role} server did not start"
    try:
        yield Endpoint(role, f"http://127.0.0.1:{port}/v1", f"kvgate-{engine.config.preset}", tokenizer=tokenizer)
    finally:
        server.should_exit = True
        thread.join(60)


def _tiny_engine(tmp_path, mode: str):
    from cache_impl.engine.engine import Engine, EngineConfig

    return Engine(EngineConfig.from_dict({"mode": mode, "preset": "tiny",
                                          "cache": {"device": "cpu", "disk": {"path": str(tmp_path / "kv")}}}))


@pytest.fixture
def end_of_text_server(tmp_path):
    """kvgate's engine (tiny preset, recompute) whose model answers end-of-text as every next token, served by
    the real app on loopback: each answer stops before its first visible token."""
    from cache_impl.engine.tokenizer import ByteTokenizer

    engine = _tiny_engine(tmp_path, "recompute")
    engine.runner.allowed.fill_(float("-inf"))
    engine.runner.allowed[ByteTokenizer().eos_id] = 0.0
    with _served(engine, "recompute") as endpoint:
        yield endpoint


def test_the_prefill_probe_times_a_server_whose_answers_stop_at_end_of_text_first(end_of_text_server):
    # a run's pre-flight probe once failed ("None: None") when the tiny model's first token for one prompt was
    # end-of-text: the chat stream's finish chunk carried no content, so the answer had no first-token time
    found = prefill_probe(end_of_text_server, 600, rounds=RoundsConfig(min=1, max=1))
    assert "points" in found, found
    assert [p["context_tokens"] for p in found["points"]] == prefill_lengths(600)
    assert all(p["seconds"] > 0 for p in found["points"])
    client = StreamingClient(end_of_text_server.url, end_of_text_server.model, "chat")
    try:
        record = client.send(context_request(300, "eot", None, 4, "test"), keep_text=True)
    finally:
        client.close()
    # the path under test ran: the answer stopped at end-of-text before any token, and still has its first token
    assert (record.finish_reason, record.completion_tokens, record.text) == ("stop", 0, "")
    assert record.ok and record.ttft_s is not None and record.ttft_s > 0


def test_external_targets_are_predicted_from_their_own_servers_probes(tmp_path):
    """Against external targets (no machine probe: their model is not kvgate's) the prefill probe times the
    endpoint G2 takes recompute's first tokens from (the candidate's own misses when there is no recompute
    target) and the decode probe its steps; G2 and G3 are then predicted from those alone, said so."""
    import io

    from rich.console import Console

    import gates.run

    path = tmp_path / "gates.yaml"
    path.write_text(yaml.safe_dump({
        "profile": "quick",
        "targets": {"kind": "external",
                    "baseline": {"url": "http://127.0.0.1:9/v1", "model": "kvgate-tiny"},
                    "candidate": {"url": "http://127.0.0.1:9/v1", "model": "kvgate-tiny"}},
        "g2": {"contexts": [512, 1024, 2048]}, "g3": {"levels": [2, 4]}}))
    config = load_config(path)
    runner = gates.run.GateRunner(config, tmp_path / "run", "r", ["g2", "g3"], False,
                                  Console(file=io.StringIO(), width=200))
    engine = _tiny_engine(tmp_path, "tiered")
    with _served(engine, "candidate", BYTE_TOKENIZER_ID) as candidate:
        runner.endpoints = {"baseline": replace(candidate, role="baseline"), "candidate": candidate}
        runner._probe_machine()                       # external: nothing of the machine's is probed
        assert runner.store.machine_probe() == {}
        runner._probe_servers("g2")
        runner._probe_decode()
    probe = runner.store.machine_probe()
    assert probe["prefill"]["role"] == "candidate" and "error" not in probe["prefill"], probe["prefill"]
    assert [p["context_tokens"] for p in probe["prefill"]["points"]] == prefill_lengths(2048)
    assert "hits" not in probe and "matmul_flops" not in probe
    decode = probe["server_decode"]
    assert decode["role"] == "candidate" and decode["max_batch"] == 4, decode   # G3's highest level, not 8
    # the load probe: each target in a closed loop at G3's lowest and highest levels, of G3's median context, each
    # answer G3's 16 tokens: the candidate over 2 x 4 returning prompts (an external engine's tiers unknown), the
    # baseline a new prompt each time
    load = probe["server_load"]
    assert sorted(load) == ["baseline", "candidate"], load
    assert load["candidate"]["prompts"] == 8 and load["candidate"]["returns"], load["candidate"]
    assert not load["baseline"]["returns"]
    for role, found in load.items():
        assert found["role"] == role and sorted(found["levels"]) == ["2", "4"], found
        records = [r for level in found["levels"].values() for r in level]
        assert records and all(r["completion_tokens"] == 16 and len(r["itl_s"]) == 15 for r in records), \
            [(r["completion_tokens"], len(r["itl_s"])) for r in records]
        assert all(r["ttft_s"] > 0 for r in records)
        # the candidate's every send a return of a prompt computed before; the baseline's never
        assert all(bool(r["cached_tokens"]) == (role == "candidate") for r in records), (role, records)
    assert load["baseline"]["prompts"] == sum(len(level) for level in load["baseline"]["levels"].values())
    assert "machine probe: none (external targets" in machine_words(probe)

    calibration = probe_calibration(probe)
    fitted = RecomputeCurve.fit(prefill_points(probe))
    assert calibration.curve.seconds(2000) == pytest.approx(fitted.seconds(2000))
    assert calibration.curve.source.startswith("the prefill probe")
    assert calibration.decode == DecodeCost(decode["step_s"], decode["per_sequence_s"])
    assert calibration.host_gbps is None and calibration.source == "this run's probes of its servers"

    plan, problem = stage_plan(config, runner.store, "g2")
    assert not problem
    recompute = {p.context["context_tokens"]: p.value for p in plan.predictions
                 if p.gate == "g2" and p.metric == "ttft_ms" and p.context["mode"] == "recompute"}
    assert set(recompute) == {512, 1024, 2048}
    assert any("recompute from the prefill probe" in note for note in plan.notes), plan.notes
    throughput = [p for p in plan.predictions if p.gate == "g3" and p.metric == "output_tokens_per_s"]
    assert throughput, "G3's throughput is predicted: the decode probe gave the decode cost"
    plan, _ = stage_plan(config, runner.store, "g3")
    for role in ("candidate", "baseline"):
        assert any(note.startswith(f"the {role}'s G3 decode cost from the load probe before G3")
                   for note in plan.notes), plan.notes
    # and without the prefill probe's three lengths there is nothing to fit: no constants, said by the plan
    assert probe_calibration({"prefill": {**probe["prefill"], "points": probe["prefill"]["points"][:2]}}) is None


def test_the_decode_probes_client_asks_a_server_to_generate_past_end_of_text(end_of_text_server):
    # vLLM serving kvgate's model stopped the decode probe's sequences at end-of-text ("0 gaps with every sequence
    # decoding"): the probe's client asks each to generate to its max_tokens (ignore_eos, vLLM's field, which
    # kvgate serve takes too); here every token is end-of-text, so the request stops at once without it
    request = context_request(300, "eot", None, 8, "test")
    records = {}
    for name, client in (("plain", StreamingClient(end_of_text_server.url, end_of_text_server.model, "chat")),
                         ("probe", probe_client(end_of_text_server, extra_body={"ignore_eos": True}))):
        try:
            records[name] = client.send(request)
        finally:
            client.close()
    assert records["plain"].ok and records["plain"].finish_reason == "stop", records["plain"]
    assert records["plain"].completion_tokens == 0
    assert records["probe"].ok and records["probe"].finish_reason == "length", records["probe"]
    assert records["probe"].completion_tokens == 8
