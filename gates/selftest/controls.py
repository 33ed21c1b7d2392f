"""The negative and positive controls of `kvgate selftest` (issue 22 §4), as data.

A control names the servers it needs (mock OpenAI servers: `workloads/reference_server.py` with a
behaviour from flags; or `kvgate serve`), which role each serves, the gates it runs, the gates.yaml
sections beside the targets, and what its verdicts must be (`expectations.py`). The G3 settings of
every mock control come from one dict per profile (`G3_SETTINGS`), so that a G3 key (blocks, budgets)
is added in one place.

The mocks stream 8 tokens. Baseline-like timing: TTFT 200 ms, ITL 20 ms (E2E 340 ms at the server); a
candidate "twice as fast to the first token, +50% throughput": TTFT 100 ms, ITL 16 ms (E2E 212 ms at the
server). What the client adds to each request shrinks the gain a closed-loop level measures: on a 2-core
VM, ITL 18 ms gave +38.5% [31.0, 46.4] (near the band's +29% edge) and ITL 15 ms +61.6% [55.6, 67.9].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .expectations import ClaimNotMet, Expectation, MustFail, MustNotPass, MustPass

COMPARED = ("ttft_p50_reduction", "throughput_gain")   # G3's side-by-side verdicts at each level
# G2's cold-read ratio against the storage's best (issue 22 §1; a run of today's G2 is read as cold_read_vs_fio)
COLD_READ = ("cold_read_vs_storage_best",)
MOCK_MODEL = "mock"
TOKENS = 8

# one place for the mocks' G3 settings (P2's blocks add g3.min_blocks / max_blocks / level_budget_s here)
G3_SETTINGS: dict[str, dict] = {
    "quick": {"levels": [2], "duration_s": 5, "warmup_s": 1, "min_requests": 8, "min_blocks": 3, "max_blocks": 6},
    "full": {"levels": [2, 4], "duration_s": 20, "warmup_s": 3, "min_requests": 20, "min_blocks": 3,
             "max_blocks": 6},
}
# G4 for the leak control: a short soak without faults, windows short enough for a slope to be judged
G4_SETTINGS: dict[str, dict] = {
    "quick": {"duration_s": 30, "window_s": 3, "warmup_s": 3, "concurrency": 2},
    "full": {"duration_s": 120, "window_s": 10, "warmup_s": 10, "concurrency": 2},
}
# G2's model load and checkpoint alone, on kvgate's paths: kvgate's loader and writer, rounds until decided
MODEL_LOAD = ("model_load_vs_storage_best",)
LOADER_AND_WRITER: dict = {
    "cold_read_pairs": 3, "model_load": {"loaders": ["kvgate"], "size": "512MiB", "shard_size": "128MiB",
                                         "service": False, "rounds": {"min": 3, "max": 12, "budget_s": 40}},
    "checkpoint": {"writers": ["kvgate"], "rounds": {"min": 3, "max": 12, "budget_s": 45}, "restores": 1}}
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

    key: str                                # "a-aa-mock": the letter of issue 22 §4, then a name
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


def _mock(*flags: str, drifts: bool = False) -> Server:
    return Server("mock", ("--model", MOCK_MODEL, "--tokens", str(TOKENS), *flags), drifts)


def _pair(baseline: Server, candidate: Server) -> dict:
    return {"servers": {"baseline": baseline, "candidate": candidate},
            "roles": {"baseline": "baseline", "candidate": "candidate"}}


def _alone(server: Server) -> dict:
    return {"servers": {"server": server}, "roles": {"baseline": "server", "candidate": "server"}}


NOT_COMPARED = MustNotPass(COMPARED)

CONTROLS: tuple[Control, ...] = (
    Control("a-aa-mock", "A/A: one mock server as baseline and candidate", ("g3",), (NOT_COMPARED,),
            **_alone(_mock(*BASELINE_TIMING))),
    Control("a-aa-serve", "A/A: one tiered `kvgate serve` as baseline and candidate", ("g3",), (NOT_COMPARED,),
            **_alone(Server("serve")), full_only=True, workload=dict(SERVE_WORKLOAD),
            prime=True),
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
            (MustPass("ttft_p50_reduction"), MustPass("throughput_gain")),
            **_pair(_mock(*BASELINE_TIMING), _mock(*FAST_TIMING))),
    Control("g-wrong-type", "a faster candidate whose usage.prompt_tokens_details.cached_tokens is a string",
            ("g3",), (NOT_COMPARED,), full_only=True,
            **_pair(_mock(*BASELINE_TIMING),
                    _mock(*FAST_TIMING, "--cached-tokens", "64", "--cached-tokens-as-string"))),
    Control("h-leak", "a candidate leaking a file descriptor per request", ("g4",),
            (MustFail("open_fds_growth"),), **_alone(_mock(*FAST_TIMING, "--leak-fd-every", "1"))),
    Control("i-good-loader-writer", "kvgate's model loader and checkpoint writer, at the storage's best", ("g2",),
            (MustPass("model_load_vs_storage_best"), MustPass("checkpoint_write_vs_storage_best")), embedded={},
            g2=LOADER_AND_WRITER),
    Control("j-serial-loader", "kvgate's model loader with one read in flight (g2.model_load.parallel: 1)", ("g2",),
            (MustNotPass(MODEL_LOAD),), embedded={},
            g2={**LOADER_AND_WRITER, "model_load": {**LOADER_AND_WRITER["model_load"], "parallel": 1},
                "checkpoint": {"enabled": False}}),
)


def controls_for(full: bool, keys: tuple[str, ...] = ()) -> list[Control]:
    """The controls a profile runs (quick: all but the full-only ones), or those named by `keys`."""
    if keys:
        known = {c.key: c for c in CONTROLS}
        unknown = [k for k in keys if k not in known]
        if unknown:
            raise ValueError(f"--control: expected some of {', '.join(known)}, found {', '.join(unknown)}")
        return [known[k] for k in keys]
    return [c for c in CONTROLS if full or not c.full_only]


def g3_run_seconds(profile: str) -> float:
    """About how long G3 runs at a profile's settings (two targets, each level's blocks at most, each block's
    locust start included): a drifting server drifts over this, so its whole fall lies inside the run."""
    g3 = G3_SETTINGS[profile]
    return 2 * len(g3["levels"]) * g3["max_blocks"] * (g3["duration_s"] + LOCUST_START_S) + 10


def gates_yaml(control: Control, profile: str, storage: str, urls: dict[str, str], models: dict[str, str],
               tokenizers: dict[str, Optional[str]]) -> dict:
    """The control's gates.yaml: its targets (external at the servers' URLs, or embedded) and short gate settings."""
    config: dict = {"profile": profile, "storage": {"path": storage}}
    if control.embedded is not None:
        config["targets"] = {"kind": "embedded", "embedded": dict(control.embedded)}
    else:
        config["targets"] = {"kind": "external", **{
            role: {"url": urls[name], "model": models[name],
                   **({"tokenizer": tokenizers[name]} if tokenizers.get(name) else {})}
            for role, name in control.roles.items()}}
    if "g3" in control.gates:
        config["g3"] = {**G3_SETTINGS[profile], "workload": dict(control.workload), "prime": control.prime,
                        "no_reuse": {"enabled": False}}
    if "g4" in control.gates:
        config["g4"] = {**G4_SETTINGS[profile], "workload": dict(control.workload), "faults": []}
    if "g2" in control.gates:
        config["g2"] = {**G2_SETTINGS[profile], "model_load": {"enabled": False},
                        "checkpoint": {"enabled": False}, "no_reuse": {"enabled": False}, **(control.g2 or {})}
    return config
