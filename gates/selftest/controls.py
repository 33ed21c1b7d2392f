"""The negative and positive controls of `kvgate selftest`, as data.

A control names the servers it needs (mock OpenAI servers: `workloads/servers/reference_server.py` with a
behaviour from flags; or `kvgate serve`), which role each serves, the gates it runs, the gates.yaml
sections beside the targets, and what its verdicts must be (`expectations.py`). The G3 settings of
every mock control come from one dict per profile (`G3_SETTINGS`), so that a G3 key (blocks, budgets)
is added in one place; a control's own `g3` goes over them (the serve A/A: more pairs), and a control with a
`profile` of its own runs that profile's G3 instead (k-embedded-tiered: the quick profile's, as a run makes it).

The mocks stream 8 tokens. Baseline-like timing: TTFT 200 ms, ITL 20 ms (E2E 340 ms at the server); a
candidate "twice as fast to the first token, +50% throughput": TTFT 100 ms, ITL 16 ms (E2E 212 ms at the
server). What the client adds to each request shrinks the gain a closed-loop level measures: on a 2-core
VM, ITL 18 ms gave +38.5% [31.0, 46.4] (near the band's +29% edge) and ITL 15 ms +61.6% [55.6, 67.9].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvcore.settings import repeated

from .expectations import ClaimNotMet, Expectation, MustFail, MustNotPass, MustPass, RefusedAtPreflight

COMPARED = ("ttft_p50_reduction", "throughput_gain")   # G3's side-by-side verdicts at each level
# G2's cold-read ratio against the storage's best (a run of today's G2 is read as cold_read_vs_fio)
COLD_READ = ("cold_read_vs_storage_best",)
MOCK_MODEL = "mock"
TOKENS = 8

# one place for the mocks' G3 settings (P2's blocks add g3.blocks here).
# A matched block serves a slice of the workload's load order: at the first level 8 requests per user (the
# baseline's rate is not known yet), 16 at c=2, so the full profile's min_requests is 12: 20 left every c=2 block
# invalid ("16 completed requests < minimum 20") and each G3 control's c=2 verdicts INCONCLUSIVE
G3_SETTINGS: dict[str, dict] = {
    "quick": {"levels": [2], "duration_s": 5, "warmup_s": 1, "min_requests": 8,
              "blocks": {"min": 3, "max": 6}},
    "full": {"levels": [2, 4], "duration_s": 20, "warmup_s": 3, "min_requests": 12,
             "blocks": {"min": 3, "max": 6}},
}
# the serve A/A's pairs: its blocks' TTFT p50 (16-32 requests of a real model on 2 cores) varies ~0.2 in log ratio
# between pairs, and at 6 pairs its interval stayed across the 25% line (c=4: 6.1% [-36.4, 35.3]); a schedule
# of up to 16 looks decides FAIL at such noise in ~99% of levels (7 pairs on average; simulated)
SERVE_AA_G3 = {"blocks": {"min": 3, "max": 16}}
# G4 for the leak and stable controls: a short soak without faults, windows short enough for a slope to be judged
G4_SETTINGS: dict[str, dict] = {
    "quick": {"duration_s": 30, "window_s": 3, "warmup_s": 3, "concurrency": 2},
    "full": {"duration_s": 120, "window_s": 10, "warmup_s": 10, "concurrency": 2},
}
# G2's model load and checkpoint alone, on kvgate's paths: kvgate's loader and writer, rounds until decided; both
# sized here (512 MiB of weights, 2 ranks of a 20M-parameter training state) whatever the profile: --full took the
# full profile's 8 ranks of 32B parameters and found no room for their 1.4 TB
MODEL_LOAD = ("model_load_vs_storage_best",)
LOADER_AND_WRITER: dict = {
    "cold_read_pairs": 3, "model_load": {"loaders": ["kvgate"], "size": "512MiB", "shard_size": "128MiB",
                                         "service": False, "rounds": {"min": 3, "max": 12, "budget_s": 40}},
    "checkpoint": {"writers": ["kvgate"], "ranks": 2, "parameters": 20_000_000, "thread_count": 1,
                   "rounds": {"min": 3, "max": 12, "budget_s": 45}, "restores": 1}}
# j-serial-loader's reads: one at a time, 16 KiB each. One 2 MiB read in flight is no bad loader on a disk whose
# rate is capped (a VM's token bucket, drained): it read at 97.0% and 87.4% of the storage's best there, where fio
# with one 16 KiB read in flight read 0.35 GB/s against the best job's 0.65 (capped) and 3-4 GB/s (not)
SERIAL_LOADER: dict = {"parallel": 1, "read_size": "16KiB"}
# G2's cold read for i-good-loader-writer's known-good read: the quick profile's own (4 prefixes of 2 sets, 5-40
# pairs in 90 s). The tier's default reader (32 reads in flight) is at the storage's best here (96.7-105.2%; with
# 16 in flight, on a VM whose best read is iodepth 32, 68.5% FAIL and 90.1% INCONCLUSIVE), but its pairs swing
# 0.73-1.53 on this VM's disk: 3 fixed pairs of 2 prefixes left it INCONCLUSIVE at 88.0% [70.4, 110.1], and 45 s
# (12-13 pairs) PASSed with lower ends of 80.4% and 81.4% against the 80% line (simulated at a ratio of 0.97 and
# a log spread of 0.19: PASS in ~70% of runs with 13 pairs, ~97% with 24); with 90 s it PASSed at 105.2% [80.3,
# 137.9] after 6 pairs
GOOD_COLD_READ: dict = {"cold_read_prefixes": 4, "cold_read_sets": 2,
                        "cold_read_pairs": {"min": 5, "max": 40, "budget_s": 90}}
# G2 for the storage controls: the cold-read pairs only (model load, checkpoint and the no-reuse control off)
G2_SETTINGS: dict[str, dict] = {
    "quick": {"contexts": [1024, 8192], "rounds": 1, "cold_read_pairs": 8, "cold_read_prefixes": 2},
    "full": {"contexts": [1024, 8192], "rounds": 2, "cold_read_pairs": 8, "cold_read_prefixes": 2},
}
MOCK_WORKLOAD = {"kind": "multi_round_qa", "users": 8, "rounds": 4, "system_prompt_tokens": 64,
                 "document_tokens": 256, "question_tokens": 16, "answer_tokens": 16, "output_tokens": TOKENS}
SERVE_WORKLOAD = {"kind": "multi_round_qa", "users": 8, "rounds": 4, "system_prompt_tokens": 256,
                  "document_tokens": 1536, "question_tokens": 32, "answer_tokens": 64, "output_tokens": 16}

LOCUST_START_S = 3.0    # what a block's locust process takes to start sending, about, on a 2-core VM
BASELINE_TIMING = ("--ttft-ms", "200", "--itl-ms", "20")
# the capacity controls: a mock of fixed timing with service slots has a known capacity at a TTFT limit between its
# TTFT and a bound below which one user more than its slots misses whatever the users' phases
# (workloads.servers.server_behaviour.Behaviour.capacity_at): 40 ms, then 7 ITLs of 10 ms (110 ms a service), so at p90
# 4 slots' bound is 58.3 ms and 3 slots' 68.5 ms: a limit of 55 ms leaves 15 ms over the TTFT for the machine's
# jitter. The search's probes stop when decided (34 requests when every one meets), the sweep before it is kept
# short (3 pairs)
CAPACITY_TIMING = ("--ttft-ms", "40", "--itl-ms", "10")
CAPACITY_SLO = {"ttft_ms": 55}
CAPACITY_G3 = {"blocks": {"min": 3, "max": 3}, "capacity": {"enabled": True, "most": 16, "probe_requests": 240,
                                             "probe_budget_s": 20}}
FAST_TIMING = ("--ttft-ms", "100", "--itl-ms", "16")


@dataclass(frozen=True)
class Server:
    """A server a control starts: a mock with these reference-server flags, or `kvgate serve` (kind "serve")."""

    kind: str = "mock"                      # "mock" or "serve"
    flags: tuple[str, ...] = ()
    drifts: bool = False                    # its TTFT drifts over the whole G3 run: --drift-s is set from G3's length


@dataclass(frozen=True)
class Control:
    """One control: what it starts, what it runs, what it must get."""

    key: str                                # "a-aa-mock": the control's letter, then a name
    title: str
    gates: tuple[str, ...]
    expectations: tuple[Expectation, ...]
    servers: dict[str, Server] = field(default_factory=dict)   # name -> server
    roles: dict[str, str] = field(default_factory=dict)        # baseline / candidate -> a server's name
    embedded: Optional[dict] = None         # targets.embedded of an embedded-target control
    full_only: bool = False
    workload: dict = field(default_factory=lambda: dict(MOCK_WORKLOAD))
    prime: bool = False                     # g3.prime: pointless for a mock; a real cache is primed as in a run
    g2: Optional[dict] = None               # G2 sections over G2_SETTINGS (default: the cold read alone)
    g3: Optional[dict] = None               # G3 settings over G3_SETTINGS (or over its profile's own G3)
    # the profile its run takes whatever the suite's, with that profile's own G3 (workload, levels, blocks) and
    # targets: the run `kvgate run` makes of it
    profile: Optional[str] = None
    slo: Optional[dict] = None              # gates.yaml's slo (the capacity controls' objective)


def _mock(*flags: str, drifts: bool = False) -> Server:
    return Server("mock", ("--model", MOCK_MODEL, "--tokens", str(TOKENS), *flags), drifts)


def _pair(baseline: Server, candidate: Server) -> dict:
    return {"servers": {"baseline": baseline, "candidate": candidate},
            "roles": {"baseline": "baseline", "candidate": "candidate"}}


def _alone(server: Server) -> dict:
    return {"servers": {"server": server}, "roles": {"baseline": "server", "candidate": "server"}}


NOT_COMPARED = MustNotPass(COMPARED)
# an A/A (no gain at all) must be told from the claimed gain: each compared verdict FAILs, decided, at every level
NULL_GAIN = tuple(MustFail(metric) for metric in COMPARED)
# G4's checks a mock server is judged on: its /metrics (prometheus_client's process collector) gives memory and
# open descriptors, not kvgate's threads, event-loop tasks or temp files (those are "not run" for it); errors and
# probes are judged for every target; the latency and throughput drifts are measured, not judged, in the quick
# profile (g4.measured_only)
G4_JUDGED_ON_A_MOCK = ("error_rate", "probe_identical_fraction", "memory_drift_fraction", "memory_growth_mib",
                       "open_fds_growth")

CONTROLS: tuple[Control, ...] = (
    Control("a-aa-mock", "A/A: one mock server as baseline and candidate", ("g3",), NULL_GAIN,
            **_alone(_mock(*BASELINE_TIMING))),
    Control("a-aa-serve", "A/A: one tiered `kvgate serve` as baseline and candidate", ("g3",), NULL_GAIN,
            **_alone(Server("serve")), full_only=True, workload=dict(SERVE_WORKLOAD),
            prime=True, g3=SERVE_AA_G3),
    Control("b-serial-read", "a tier reading with one worker (targets.embedded.disk_read_workers: 1)", ("g2",),
            (MustNotPass(COLD_READ),), embedded={"disk_read_workers": 1}),
    Control("b-direct-read", "a direct-I/O tier on storage where direct is the slow mode", ("g2",),
            (MustNotPass(COLD_READ),), embedded={"disk_io_mode": "direct"}, full_only=True),
    Control("c-failing", "a candidate failing 40% of its requests (HTTP 500), otherwise faster", ("g3",),
            (NOT_COMPARED, MustFail("error_rate")),
            **_pair(_mock(*BASELINE_TIMING), _mock(*FAST_TIMING, "--error-fraction", "0.4"))),
    Control("d-invalid-only", "a candidate faster only in invalid steps (its usage miscounts the tokens)", ("g3",),
            (NOT_COMPARED, ClaimNotMet("ttft_p50_reduction"), ClaimNotMet("throughput_gain")),
            **_pair(_mock(*BASELINE_TIMING), _mock(*FAST_TIMING, "--usage-token-offset", "1"))),
    Control("e-drift", "one mock server as both, its TTFT falling 400 -> 100 ms over the run", ("g3",),
            (NOT_COMPARED,), **_alone(_mock("--ttft-ms", "400", "--itl-ms", "20", "--ttft-end-ms", "100",
                                            drifts=True))),
    Control("f-known-good", "a true gain: candidate TTFT half the baseline's, throughput +50%", ("g3",),
            (MustPass("ttft_p50_reduction"), MustPass("throughput_gain"), MustPass("error_rate")),
            **_pair(_mock(*BASELINE_TIMING), _mock(*FAST_TIMING))),
    Control("g-wrong-type", "a faster candidate whose usage.prompt_tokens_details.cached_tokens is a string",
            ("g3",), (RefusedAtPreflight("candidate", "bad_response", "usage.prompt_tokens_details.cached_tokens"),),
            full_only=True,
            **_pair(_mock(*BASELINE_TIMING),
                    _mock(*FAST_TIMING, "--cached-tokens", "64", "--cached-tokens-as-string"))),
    Control("h-leak", "a candidate leaking a file descriptor per request", ("g4",),
            (MustFail("open_fds_growth"),), **_alone(_mock(*FAST_TIMING, "--leak-fd-every", "1"))),
    Control("i-good-loader-writer", "kvgate's model loader and checkpoint writer, at the storage's best", ("g2",),
            (MustPass("model_load_vs_storage_best"), MustPass("checkpoint_write_vs_storage_best"),
             MustPass(COLD_READ[0])), embedded={},
            g2={**LOADER_AND_WRITER, **GOOD_COLD_READ}),
    Control("j-serial-loader", "kvgate's model loader with one 16 KiB read in flight (a page-faulting loader's "
            "pattern)", ("g2",), (MustNotPass(MODEL_LOAD),), embedded={},
            g2={**LOADER_AND_WRITER, "model_load": {**LOADER_AND_WRITER["model_load"], **SERIAL_LOADER},
                "checkpoint": {"enabled": False}}),
    Control("k-embedded-tiered", "the embedded default's tiered candidate against its device-only baseline", ("g3",),
            (MustPass("ttft_p50_reduction"), MustPass("throughput_gain"), MustPass("disk_hit_share")), embedded={},
            prime=True, profile="quick", full_only=True),
    Control("l-stable", "a stable server through G4's judged checks", ("g4",),
            tuple(MustPass(metric) for metric in G4_JUDGED_ON_A_MOCK), **_alone(_mock(*FAST_TIMING))),
    Control("m-capacity-aa", "A/A: one server of 3 service slots as baseline and candidate, capacity searched",
            ("g3",), (MustFail("capacity_gain"),), **_alone(_mock(*CAPACITY_TIMING, "--slots", "3")),
            g3=CAPACITY_G3, slo=CAPACITY_SLO),
    Control("n-capacity-double", "a candidate with twice the baseline's service slots (4 against 2)", ("g3",),
            (MustPass("capacity_gain"),), **_pair(_mock(*CAPACITY_TIMING, "--slots", "2"),
                                                  _mock(*CAPACITY_TIMING, "--slots", "4")),
            g3=CAPACITY_G3, slo=CAPACITY_SLO),
)


def controls_for(full: bool, keys: tuple[str, ...] = ()) -> list[Control]:
    """The controls a profile runs (quick: all but the full-only ones), or those named by `keys`."""
    if keys:
        known = {c.key: c for c in CONTROLS}
        unknown = [k for k in keys if k not in known]
        if unknown:
            raise ValueError(f"--control: expected some of {', '.join(known)}, found {', '.join(unknown)}")
        twice = repeated(list(keys))
        if twice:      # a control's second run would overwrite its first's directory and take its verdicts
            raise ValueError(f"--control: expected each control once, found {', '.join(twice)} repeated")
        return [known[k] for k in keys]
    return [c for c in CONTROLS if full or not c.full_only]


def g3_run_seconds(profile: str) -> float:
    """About how long G3 runs at a profile's settings (two targets, each level's blocks at most, each block's
    locust start included): a drifting server drifts over this, so its whole fall lies inside the run."""
    g3 = G3_SETTINGS[profile]
    return 2 * len(g3["levels"]) * g3["blocks"]["max"] * (g3["duration_s"] + LOCUST_START_S) + 10


def gates_yaml(control: Control, profile: str, storage: str, urls: dict[str, str], models: dict[str, str],
               tokenizers: dict[str, Optional[str]]) -> dict:
    """The control's gates.yaml: its targets (external at the servers' URLs, or embedded) and short gate settings."""
    config: dict = {"profile": control.profile or profile, "storage": {"path": storage},
                    **({"slo": dict(control.slo)} if control.slo else {})}
    if control.embedded is not None:
        config["targets"] = {"kind": "embedded", "embedded": dict(control.embedded)}
    else:
        config["targets"] = {"kind": "external", **{
            role: {"url": urls[name], "model": models[name],
                   **({"tokenizer": tokenizers[name]} if tokenizers.get(name) else {})}
            for role, name in control.roles.items()}}
    if "g3" in control.gates:
        # a control with a profile of its own runs that profile's G3 (none of the mocks' short settings)
        settings = {} if control.profile else {**G3_SETTINGS[profile], "workload": dict(control.workload)}
        config["g3"] = {**settings, **(control.g3 or {}), "prime": control.prime, "no_reuse": {"enabled": False}}
    if "g4" in control.gates:
        config["g4"] = {**G4_SETTINGS[profile], "workload": dict(control.workload), "faults": []}
    if "g2" in control.gates:
        config["g2"] = {**G2_SETTINGS[profile], "model_load": {"enabled": False},
                        "checkpoint": {"enabled": False}, "no_reuse": {"enabled": False}, **(control.g2 or {})}
    return config
