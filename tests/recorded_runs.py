"""A run directory as `kvgate run` writes it, with figures that follow known constants exactly: what the sizing
model's calibration, plan and machine tests read back."""

from __future__ import annotations

from kvcore.files import append_jsonl
from kvcore.rundata import RunStore
from sizing.queueing import DecodeCost, EngineModel, ServedRequest, simulate_closed_loop
from sizing.timing import RecomputeCurve, TierBandwidths, TimingModel

KV = 4096   # bytes per token of the small preset's layout: 4 layers × (k, v) × 2 heads × 64 × float32
# the run's constants: fixed overhead, recompute curve (b, c), the disk tier's overhead and bandwidth, decode
F, B_, C_, DISK_OVERHEAD, TIER_GBPS = 0.006, 9e-5, 1.6e-8, 0.012, 1.2
STEP, PER_SEQ = 0.003, 0.0025
BASELINE_STEP, BASELINE_PER_SEQ = 0.005, 0.004     # the baseline's steps, beside its prompts' prefill, cost more


def recorded_run(root, with_g3=True, blocks=0):
    """A run directory as `kvgate run` writes it, with figures that follow known constants exactly; `blocks`: G3
    in matched blocks as it runs now (c4, c4-block2, ...), its first pair a warm-up left out, whose steps were
    five times slower, and a warm-up of 30 s that no block lasts."""
    store = RunStore(root)
    store.write_run_info({"run_id": "recorded", "gates": ["g1", "g2", "g3"]})
    (root / "config.yaml").write_text("g2:\n  contexts: [1024, 4096, 8192]\n  cold_read_prefixes: 2\n"
                                      f"g3:\n  warmup_s: {30.0 if blocks else 0.0}\n"
                                      "targets:\n  embedded:\n    max_running: 8\n")
    store.record("g1", "test_fio", "seq_read_gbps", 1.5, "GB/s")
    for context in (1024, 4096, 8192):
        n = context - 4
        h = n // 256 * 256
        tail = B_ * (n - h) + C_ * (n * n - h * h)
        for mode, seconds in (("recompute", F + B_ * n + C_ * n * n), ("host-hit", F + h * KV / 10e9 + tail),
                              ("disk-cold", F + DISK_OVERHEAD + h * KV / (TIER_GBPS * 1e9) + tail)):
            store.record("g2", "test_ttft", "ttft_ms", seconds * 1e3, "ms", mode=mode, context_tokens=context)
    for i in range(8):
        store.record("g2", "test_cold", "cold_read_pair", 0.8, round=i, tier_bytes=2 * 7936 * KV, tier_gbps=1.2)
    store.record("g2", "test_cold", "cold_read_vs_storage_best", 0.8, tier_gbps=TIER_GBPS, fio_gbps=1.5)
    store.record("g2", "test_load", "model_load_loader", 0.95, "%", loader="kvgate", loader_gbps=1.43)
    store.record("g2", "test_load", "model_load_loader", 0.9, "%", loader="safetensors", loader_gbps=1.35)
    store.record("g2", "test_load", "model_load_loader", 0.6, "%", loader="runai_streamer", loader_gbps=0.9)
    store.record("g2", "test_ckpt", "checkpoint_write_vs_storage_best", 0.75, "%", writer="kvgate", fio_gbps=2.0)
    for start in (3.0, 3.2, 3.4):
        store.record("g2", "test_service", "service_load", start + 0.05, "s", loader="safetensors",
                     weights={"seconds": 0.05})
    if with_g3:
        timing = TimingModel(RecomputeCurve(F, B_, C_), TierBandwidths(disk_gbps=TIER_GBPS), KV, 256, F)
        targets = {"candidate": ("host", 1792, STEP, PER_SEQ), "baseline": ("device", 256, BASELINE_STEP,
                                                                             BASELINE_PER_SEQ)}
        for target, (tier, cached, step, per_sequence) in targets.items():
            replay = [ServedRequest(1830 + 32 * (i % 4), 16, {tier: cached}) for i in range(40)]
            for level in (2, 4, 8):
                for block in range(1, max(1, blocks) + 1):
                    slow = 5.0 if blocks and block == 1 else 1.0
                    engine = EngineModel(timing, DecodeCost(step * slow, per_sequence * slow), 8)
                    directory = f"c{level}" + (f"-block{block}" if block > 1 else "")
                    for r in simulate_closed_loop(replay, level, engine):
                        request = replay[r.index]
                        append_jsonl(store.raw_dir("g3") / "sweep" / target / directory / "records" /
                                     "records-w0-1.jsonl",
                                     {"ok": True, "sent_at": 1000.0 * block + r.sent_s, "ttft_s": r.ttft_s,
                                      "itl_s": list(r.itl_s), "prompt_tokens": request.prompt_tokens,
                                      "completion_tokens": r.output_tokens, "cached_tokens": cached})
        for level in (2, 4, 8) if blocks else ():
            store.record("g3", "test_warm_up", "g3_warmup_pairs", 1, concurrency=level)
    return store
