"""Every gate's declared checks: what it judges, what the figure means, which way is better, the default rule.

The config is validated against these tables (a threshold naming a metric its gate does not
judge is a configuration error), and a gate judges only declared metrics. A check's rule is
the gate's configured threshold for its metric, else its default here (a typed rule, kvcore/rules.py,
made once at import like the config's thresholds at load); with neither, the
figure is measured but not judged, and the report says so at the top of the gate's section.
A check whose rule comes from another section of the config (`rule_from`) cannot be named
in `thresholds`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from .rules import Band, Rule, Threshold

Better = Literal["higher", "lower", "in band"]


@dataclass(frozen=True)
class Check:
    metric: str
    meaning: str
    better: Better
    unit: str = ""
    default: Optional[Rule] = None       # the rule used when the gate's thresholds do not name the metric
    rule_from: Optional[str] = None      # the config field that sets the rule instead of thresholds

    @property
    def configurable(self) -> bool:
        return self.rule_from is None


def _at_least(metric: str, value: float) -> Threshold:
    return Threshold(metric, ">=", value)


def _at_most(metric: str, value: float) -> Threshold:
    return Threshold(metric, "<=", value)


def _exactly(metric: str, value: float) -> Threshold:
    return Threshold(metric, "==", value)


G1_CHECKS = (
    Check("cpu_cores", "logical CPU cores of the host", "higher", rule_from="inventory.min_cpu_cores"),
    Check("memory_gib", "host memory", "higher", "GiB", rule_from="inventory.min_memory_gib"),
    Check("free_gib", "free space at storage.path", "higher", "GiB", rule_from="inventory.min_free_gib"),
    Check("gpus", "GPUs the host sees", "higher", rule_from="inventory.min_gpus"),
    Check("nics", "network interfaces other than loopback", "higher", rule_from="inventory.min_nics"),
    Check("rdma_devices", "RDMA/RoCE devices", "higher", rule_from="inventory.rdma_required"),
    Check("seq_read_gbps", "fio sequential read, 1 MiB requests", "higher", "GB/s"),
    Check("seq_write_gbps", "fio sequential write, 1 MiB requests", "higher", "GB/s"),
    Check("rand_read_iops", "fio random read, 4 KiB requests", "higher", "IOPS"),
    Check("rand_write_iops", "fio random write, 4 KiB requests", "higher", "IOPS"),
    Check("rand_read_p99_ms", "fio random read 4 KiB, p99 completion latency", "lower", "ms"),
    Check("mixed_70_30_iops", "fio mixed 70% read / 30% write, 4 KiB requests", "higher", "IOPS"),
    # the storage's best (fio.sweep): measured, not judged unless the spec sheet gives a threshold; G2's yardstick
    Check("storage_best_read_gbps", "the fastest sequential read of the storage sweep (block size, queue depth, "
          "jobs, engine, direct or buffered)", "higher", "GB/s"),
    Check("storage_best_write_gbps", "the fastest fsync'd sequential write of the storage sweep", "higher", "GB/s"),
    Check("fio_verify_errors", "fio crc32c verify errors on written data", "lower",
          default=_exactly("fio_verify_errors", 0)),
)

# the no-reuse controls (g2.no_reuse, g3.no_reuse): prompts sharing no prefix, tiered candidate beside the
# baseline; what offload costs when nothing comes back (gates/no_reuse.py). No default rule: the full profile
# holds them to 5% (a joint test's steps are long enough to resolve that); the quick profile's few pairs and
# 14-s steps swing +-15-50% on a small machine, so there they are measured and shown, not judged
NO_REUSE_CHECKS = tuple(Check(metric, meaning, "lower", "%") for metric, meaning in (
    ("no_reuse_ttft_cost", "tiered TTFT p50 over the baseline's − 1 on prompts that share no prefix, side by side"),
    ("no_reuse_throughput_cost", "1 − tiered output throughput over the baseline's on prompts that share no prefix, "
     "side by side")))

G2_CHECKS = (
    Check(
        "cached_fraction_min",
        "least share of a placed prefix served from the cache",
        "higher",
        "%",
        default=_at_least("cached_fraction_min", 0.99),
    ),
    Check(
        "placed_tier_verified",
        "share of G2's placed hits the engine's tier accounting attributes to the placed tier alone",
        "higher",
        "%",
        default=_exactly("placed_tier_verified", 1.0),
    ),
    Check(
        "disk_hit_ttft_vs_recompute",
        "cold disk hit TTFT / recompute TTFT at the longest context",
        "lower",
        "%",
        default=_at_most("disk_hit_ttft_vs_recompute", 0.25),
    ),
    Check(
        "cold_read_vs_storage_best",
        "cold-read KV bandwidth / the storage's best sequential read (G1's sweep), side by side",
        "higher",
        "%",
        default=_at_least("cold_read_vs_storage_best", 0.8),
    ),
    # model service loading (g2.model_load) and checkpoint saving (g2.checkpoint) on the storage under test
    Check(
        "model_load_vs_storage_best",
        "the judged loader's cold GB/s (g2.model_load.judged: kvgate's own by "
        "default) / the storage's best sequential read job reading the same files, side by side",
        "higher",
        "%",
        default=_at_least("model_load_vs_storage_best", 0.8),
    ),
    Check(
        "model_load_identical",
        "loaded tensors equal to the checkpoint's (a checksum per tensor), every loader and round",
        "higher",
        "%",
        default=_exactly("model_load_identical", 1.0),
    ),
    Check(
        "model_load_speedup_vs_baseline",
        "the judged loader's cold load seconds on g2.model_load.baseline_path "
        "over the storage under test's, side by side",
        "in band",
        "×",
        default=Band("model_load_speedup_vs_baseline", 6.2, 9.3),
    ),
    Check(
        "service_load_started",
        "server starts that loaded the weights and streamed a first token, every loader",
        "higher",
        "%",
        default=_exactly("service_load_started", 1.0),
    ),
    Check(
        "checkpoint_saves_complete",
        "saves that completed (every rank fsync'd, DCP's metadata written)",
        "higher",
        "%",
        default=_exactly("checkpoint_saves_complete", 1.0),
    ),
    Check(
        "checkpoint_write_vs_storage_best",
        "checkpoint write GB/s (bytes / the slowest rank's seconds) / the "
        "storage's best fsync'd sequential write job writing as many bytes, side by side",
        "higher",
        "%",
        default=_at_least("checkpoint_write_vs_storage_best", 0.7),
    ),
    Check(
        "checkpoint_restore_identical",
        "restored state equal to the saved state, bit for bit, every rank",
        "higher",
        "%",
        default=_exactly("checkpoint_restore_identical", 1.0),
    ),
    Check(
        "checkpoint_speedup_vs_baseline",
        "checkpoint save seconds on g2.checkpoint.baseline_path over the storage under test's, side by side",
        "higher",
        "×",
        default=_at_least("checkpoint_speedup_vs_baseline", 1.9),
    ),
    *NO_REUSE_CHECKS,  # g2.no_reuse: one request at a time
)

G3_CHECKS = (
    Check("ttft_p50_reduction", "candidate's TTFT p50 reduction against the baseline, per level", "higher", "%",
          default=_at_least("ttft_p50_reduction", 0.25)),
    Check("throughput_gain", "candidate's output throughput gain over the baseline, per level", "in band", "%",
          default=Band("throughput_gain", 0.29, 0.40)),
    Check("sustained_rate_gain", "gain in the highest trace-rate multiplier sustained within g3.ttft_slo_ms "
          "(replay: rate_multipliers)", "in band", "%",
          default=Band("sustained_rate_gain", 0.29, 0.40)),
    # per level, not over the sweep: errors only under the highest load must not average away over the lower
    # levels; the candidate's alone (the baseline's errors make its steps invalid, g3.max_error_share)
    Check("error_rate", "candidate's failed requests / its measured requests, per level", "lower", "%",
          default=_at_most("error_rate", 0.01)),
    # the seed's system keeps hot KV in device memory and the rest on its storage: a candidate whose lower-tier
    # hits all come from host DRAM tests DRAM, not the storage under test
    Check("disk_hit_share", "the disk tier's share of the candidate's lower-tier hit blocks (host, disk and "
          "pool), per level", "higher", "%", default=_at_least("disk_hit_share", 0.5)),
    # g3.capacity: the most users within the SLO, candidate over baseline; the seed's throughput claim at an
    # equal SLO (+29%) is the least gain
    Check("capacity_gain", "the candidate's capacity within the SLO (most closed-loop users) / the baseline's - 1, "
          "bounded by both searches' brackets", "higher", "%", default=_at_least("capacity_gain", 0.29)),
    *NO_REUSE_CHECKS,            # g3.no_reuse: one closed-loop level
)

G4_CHECKS = (
    Check("error_rate", "failed requests / requests over the soak", "lower", "%",
          default=_at_most("error_rate", 0.001)),
    Check("probe_identical_fraction", "consistency probes answering as at the start", "higher", "%",
          default=_at_least("probe_identical_fraction", 1.0)),
    Check("faults_handled_fraction", "scheduled faults detected, harmless and recovered", "higher", "%",
          default=_exactly("faults_handled_fraction", 1.0)),
    # drift: the Theil-Sen trend's change from the first to the last judged window over the level (the
    # median window), positive when worse, fault windows left out (gates/g4_soak/analysis.py)
    Check("ttft_p99_drift_fraction", "rise of windowed TTFT p99 over the soak, fraction of its level", "lower", "%",
          rule_from="g4.drift_tolerance"),
    Check("throughput_drift_fraction", "decline of windowed output throughput over the soak, fraction of its level",
          "lower", "%", rule_from="g4.drift_tolerance"),
    Check("memory_drift_fraction", "rise of server memory outside the cache pools over the soak, fraction of its "
          "level (RSS less the tiers' resident pools and the engine's request KV buffers' resident pages, those at "
          "most their bound)", "lower", "%", rule_from="g4.drift_tolerance"),
    Check("memory_growth_mib", "growth of server memory outside the cache pools, its Theil-Sen slope projected "
          "over the uptime the run certifies (g4.memory_growth_horizon_s; unset: 72 h for a soak of 30 min or "
          "more, the soak's own length for a shorter one)", "lower", "MiB",
          rule_from="g4.memory_growth_limit_mib"),
    # the server's runtime, projected as memory is (gates/g4_soak/analysis.py: RUNTIME_GROWTH)
    Check("open_fds_growth", "growth of the server's open file descriptors, projected as memory is", "lower",
          "descriptors", default=_at_most("open_fds_growth", 64)),
    Check("threads_growth", "growth of the server's OS threads, projected as memory is", "lower", "threads",
          default=_at_most("threads_growth", 16)),
    Check("asyncio_tasks_growth", "growth of the server's event-loop tasks, projected as memory is", "lower",
          "tasks", default=_at_most("asyncio_tasks_growth", 64)),
    Check("disk_temp_files_growth", "growth of temp files in the disk tier's directory, projected as memory is",
          "lower", "files", default=_at_most("disk_temp_files_growth", 16)),
)

CHECKS: dict[str, tuple[Check, ...]] = {"g1": G1_CHECKS, "g2": G2_CHECKS, "g3": G3_CHECKS, "g4": G4_CHECKS}


def check_of(gate: str, metric: str) -> Check:
    """The declared check; KeyError naming the gate's metrics when the gate does not judge `metric`."""
    for check in CHECKS[gate]:
        if check.metric == metric:
            return check
    raise KeyError(f"{gate} judges no metric {metric!r} (declared: {', '.join(c.metric for c in CHECKS[gate])})")


def configurable_metrics(gate: str) -> list[str]:
    return [c.metric for c in CHECKS[gate] if c.configurable]
