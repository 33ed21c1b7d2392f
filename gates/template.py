"""The commented gates.yaml that `kvgate init` writes (a test checks it loads and matches the quick profile)."""

TEMPLATE = """\
# kvgate gates.yaml: what to test, against what, and what counts as passing.
# Every key is optional: a missing key takes the profile's default. A typo is an
# error (exit 2), never a silent default. Run: kvgate run --config gates.yaml

# quick: the embedded default, all gates in minutes on a small machine.
# full: a real joint test (G4 soaks for 72 hours).
profile: quick
aa: false                         # A/A (kvgate run --aa): each subject against itself, counting false decisions

targets:
  # embedded: kvgate starts its own servers (recompute, device-only baseline, tiered candidate).
  # external: give the endpoints below; API keys are read from the named environment variables.
  kind: embedded
  embedded:
    preset: small                 # tiny | small | base (model size)
    seed: 0                       # weights seed
    max_running: 8                # requests decoding at once per server
    device_capacity_blocks: 64    # device tier, both cached modes (256-token blocks)
    host_capacity: 1GiB           # host DRAM tier of the tiered candidate
    disk_capacity: 8GiB           # disk tier of the tiered candidate, under storage.path
    disk_io_mode: direct          # O_DIRECT reads (buffered: through the page cache)
    disk_read_workers: 16         # parallel block reads, the tier's queue depth
  # baseline:  {url: "http://10.0.0.5:8000/v1", model: my-model, api_key_env: BASELINE_KEY}
  # candidate: {url: "http://10.0.0.6:8000/v1", model: my-model, api_key_env: CANDIDATE_KEY}
  # recompute: {url: "http://10.0.0.7:8000/v1", model: my-model}   # optional no-reuse reference
  #
  # Each external endpoint names its engine, so the gates can control its cache and read which tier
  # served a hit from its /metrics (an embedded target is always engine kvgate):
  # candidate:
  #   url: "http://10.0.0.6:8000/v1"
  #   model: my-model
  #   engine: vllm                  # kvgate | vllm | sglang | generic (default: generic, nothing assumed)
  #                                 # vllm: POST /reset_prefix_cache (start it with VLLM_SERVER_DEV_MODE=1)
  #                                 # sglang: POST /flush_cache (start it with --enable-metrics)
  #                                 # kvgate: its /admin/cache routes (the admin token in $KVGATE_ADMIN_TOKEN)
  #   cache_layer: lmcache          # lmcache (vllm) | hicache (sglang) | mooncake (vllm, sglang)
  #   cache_layer_url: "http://10.0.0.6:7000"   # lmcache: its internal API server (clears its host tier)
  #   metrics_url: "http://10.0.0.6:8000/metrics"   # default: the URL without /v1, + /metrics
  #   cache_dir: /mnt/nvme/lmcache  # the disk tier's directory when on this host: page cache dropped by fadvise
  #   device_kv_tokens: 500000      # device KV capacity in tokens (default: from the engine's metrics:
  #                                 # vLLM's cache_config_info, SGLang's max_total_num_tokens)
  #   host_kv_tokens: 2000000       # host tier capacity in tokens (placement by pressure past the host)
  #   control:                      # steps of your own, each {http: {method, url, json}} or {command: "..."};
  #                                 # they replace the engine's; clears: the tiers a step empties
  #     drop_disk_page_cache: {command: "ssh storage01 'sync; echo 1 > /proc/sys/vm/drop_caches'"}
  #     # clear_device_cache: {http: {method: POST, url: "http://10.0.0.6:8000/flush"}, clears: [device]}
  #     # clear_lower_tiers: {command: "my-cache-cli clear --tier dram", clears: [host]}
  #   # metric_map:                 # engine generic: per tier, the counters of its hit tokens (summed)
  #   #   device: {metric: my_engine_cache_hit_tokens_total, labels: {tier: gpu}}
  #   #   host: [{metric: my_offload_hit_blocks_total, scale: 16}]   # scale: tokens per unit counted
  #   #   prompt_tokens: {metric: my_engine_prompt_tokens_total}

storage:
  path: kvgate-storage            # the storage under test: fio runs here, the disk tier lives here

inventory:                        # G1: what the order says; leave a key out to skip its check
  min_cpu_cores: 1
  min_memory_gib: 1
  min_free_gib: 2                 # free space at storage.path
  # min_gpus: 8
  # min_nics: 2
  # rdma_required: true

fio:                              # G1 fio matrix: seq read/write 1 MiB, random read/write 4 KiB, mixed 70/30
  size: 256M
  runtime_s: 2
  iodepth: 16
  numjobs: 1
  direct: true
  ioengine: libaio
  verify: true                    # crc32c write + verify pass
  verify_size: 32M
  sweep:                          # G1's storage sweep: the storage's best read and fsync'd write, G2's yardstick
    read_bs: [1M, 16M]            # request sizes of the sequential read points
    iodepths: [32]                 # queue depths of the direct read points (libaio, io_uring)
    numjobs: [1, 4]               # parallel jobs (buffered reads: psync jobs, depth 1)
    modes: [direct, buffered]     # buffered reads drop the pages first (invalidate=1)
    ioengines: [libaio, io_uring] # one the host lacks is probed and left out
    write_bs: [1M, 16M]           # fsync'd sequential writes (end_fsync=1)
    write_numjobs: [4]
    write_modes: [direct, buffered]
    size: 512M                    # bytes per point
    runtime_s: 1                  # at most, per point

g1:
  thresholds:                     # {metric, op, value} or a band {metric, min, max}
    - {metric: seq_read_gbps, op: ">=", value: 0.1}
    - {metric: seq_write_gbps, op: ">=", value: 0.05}
    - {metric: rand_read_iops, op: ">=", value: 1000}
    - {metric: rand_write_iops, op: ">=", value: 500}
    - {metric: rand_read_p99_ms, op: "<=", value: 50}

g2:
  contexts: [1024, 4096, 8192]    # tokens; one request at a time
  rounds: 2
  cold_read_pairs:                # pairs of the tier's cold load and the storage's best read job, until decided
    min: 5                        # always taken (at least 3); a plain number n: exactly n pairs
    max: 24                       # the most when the interval does not decide
    budget_s: 45                  # no pair started after this
  cold_read_prefixes: 4           # longest-context prefixes each tier round loads cold (more bytes per pair)
  cold_read_sets: 2               # prefix sets stored at the first pair; pair i reloads set i mod sets
  model_load:                     # model service loading on the storage under test
    enabled: true
    # path: /models/DeepSeek-R1-Distill-Llama-70B   # an existing safetensors model (read only, never written)
    size: 512MiB                  # without path: a random checkpoint this big is written under storage.path
    shard_size: 128MiB
    loaders: [safetensors, runai_streamer]   # each read cold beside the best read job on the same files
                                             # (also: fastsafetensors)
    parallel: 16                  # read threads of the streaming loaders
    rounds: {min: 3, max: 12, budget_s: 30}  # after a warm-up round, until the best loader decides
    # baseline_path: /mnt/nfs/kvgate   # the storage to compare with (e.g. NFS): the speedup check runs
    service: true                 # embedded: `kvgate serve --weights` per loader, process start to first token
    # launch: "vllm serve /models/x --load-format runai_streamer"   # external: the engine's own start,
    # health_url: http://127.0.0.1:8000/health                      # timed to ready and first token
  checkpoint:                     # checkpoint saving: torch.distributed.checkpoint, model + optimizer state
    enabled: true
    ranks: 2                      # processes on the gloo backend; the slowest rank's time counts
    parameters: 20000000          # 280 MB of state; or 8B, 70B, 405B, 1T (MLPerf Storage), 32B, adapter
    bytes_per_parameter: 14       # bf16 weights + fp32 master weights + Adam's two moments
    thread_count: 1               # write threads per rank
    rounds: {min: 3, max: 6, budget_s: 30}   # saves beside the best fsync'd write job (after two warm-ups)
    restores: 3                   # cold restores, checked bit for bit
    # baseline_path: /mnt/nfs/kvgate-ckpt
  no_reuse:                       # the no-reuse control: unique prompts, tiered candidate beside the baseline
    enabled: true
    context_tokens: 2048
    max_tokens: 32
    pairs: 8                      # alternating pairs: no_reuse_ttft_cost, no_reuse_throughput_cost (judged when
                                  # in thresholds, as the full profile has them: <= 5%)
  thresholds:
    - {metric: cold_read_vs_storage_best, op: ">=", value: 0.8}            # vs the storage's best read, side by side
    - {metric: disk_hit_ttft_vs_recompute, op: "<=", value: 0.25}  # at the longest context
    - {metric: model_load_vs_storage_best, op: ">=", value: 0.8}           # the best loader vs the best read job, same files
    - {metric: model_load_speedup_vs_baseline, min: 6.2, max: 9.3}  # needs model_load.baseline_path
    - {metric: checkpoint_write_vs_storage_best, op: ">=", value: 0.7}     # vs the best fsync'd write job, side by side
    - {metric: checkpoint_speedup_vs_baseline, op: ">=", value: 1.9}  # needs checkpoint.baseline_path

g3:
  workload:                       # see workloads/specs/ for every kind
    kind: multi_round_qa
    users: 16
    rounds: 4
    system_prompt_tokens: 256
    document_tokens: 1536
    question_tokens: 32
    answer_tokens: 64
    output_tokens: 16
  # A trace (kind: trace, path: your JSONL file or `kvgate run --trace FILE`, warmup_requests: N):
  # see workloads/specs/trace.yaml. replay: closed_loop sends its requests in order at each
  # concurrency; rate_multipliers replays its arrival times at each multiple of its rate (open loop)
  # and judges the highest one each target sustains with TTFT p90 <= ttft_slo_ms.
  replay: closed_loop             # closed_loop: levels are concurrencies | rate_multipliers (traces)
  levels: [2, 4, 8]               # concurrency sweep (rate_multipliers: e.g. [1, 2, 4])
  # ttft_slo_ms: 2000             # rate_multipliers: the TTFT objective a sustained rate meets
  # each level: pairs of short blocks, baseline and candidate in turn (ABBA...), until the interval over
  # the pairs decides every rule of the level (anytime-valid), or max_blocks, or level_budget_s
  duration_s: 7                   # seconds per block
  warmup_s: 2                     # left out of each block, from its first request
  min_blocks: 3                   # blocks per target per level, at least (>= 3)
  max_blocks: 5                   # at most
  level_budget_s: 60              # no further pair starts after this many seconds at a level (optional)
  min_requests: 3                 # completed requests a block needs to be valid
  max_error_share: 0.01           # a block whose measured requests failed more than this is invalid
  prime: true                     # send each target every session's first turn (a trace: its warm-up) first
  no_reuse:                       # the no-reuse control: prompts that share no prefix, one level, unprimed
    enabled: true
    level: 4                      # its concurrency: no_reuse_ttft_cost, no_reuse_throughput_cost (judged when
                                  # in thresholds, as the full profile has them: <= 5%)
    duration_s: 10                # per target (default: duration_s)
    warmup_s: 3
    # workload: {kind: random, requests: 1000, input_tokens: {distribution: uniform, min: 512, max: 2048}}
  thresholds:
    - {metric: ttft_p50_reduction, op: ">=", value: 0.25}
    - {metric: throughput_gain, min: 0.29, max: 0.40}   # below: FAIL; above: PASS with a note
    - {metric: sustained_rate_gain, min: 0.29, max: 0.40}   # rate_multipliers: in place of throughput_gain
    # error_rate (the candidate's failed share, per level) is judged by its default, <= 0.01

g4:
  workload:
    kind: multi_round_qa
    users: 16
    rounds: 4
    system_prompt_tokens: 256
    document_tokens: 1536
    question_tokens: 32
    answer_tokens: 64
    output_tokens: 16
  duration_s: 120
  window_s: 10
  warmup_s: 10                    # first seconds left out of the drift checks (caches filling)
  concurrency: 4
  memory_growth_limit_mib: 512    # most growth of server memory outside the cache pools over the horizon:
  memory_growth_horizon_s: null   # the memory slope projected this far (default 259200: 72 h, the full
                                  # profile's soak; null: duration_s, as two minutes tell gross growth only)
  drift_tolerance: 0.25           # largest trend over the soak (fraction of the level) in TTFT p99, throughput,
                                  # memory; two minutes tell gross drift only (full profile: 0.05)
  max_error_share: 0.01           # a window whose requests failed more than this is left out of the drift checks
  faults:                         # injected into the embedded candidate during the soak ([] for none)
    # stored-block faults (flip_byte, truncate, delete, swap) damage a disk block of the first probe's
    # prompt; I/O faults (read_error, write_error, disk_full, slow_disk + delay_ms) stay armed duration_s
    - {kind: flip_byte, at_s: 12}
    - {kind: read_error, at_s: 30, duration_s: 5}
  thresholds:
    - {metric: error_rate, op: "<=", value: 0.001}
    - {metric: probe_identical_fraction, op: ">=", value: 1.0}
    - {metric: faults_handled_fraction, op: "==", value: 1.0}   # detected, answers unchanged, recovered
"""


def _claims_section() -> str:
    """The claims sheet with the seed playbook's figures, one flow mapping per claim (kvcore/claims.py)."""
    import json

    from kvcore.claims import DEFAULT_CLAIMS

    lines = ["",
             "# The vendor's claims, each set beside what the run measured (and what `kvgate plan` predicts):",
             "# met at or above `min` (above a band's `max`: met, with a note), not met below it, or not measured",
             "# with the reason (e.g. no baseline path). `metric` is a figure its `gate` records; `read`: last, min",
             "# or max over the gate's levels, median, or inverse (1/x: a speed-up from a TTFT ratio).",
             "claims:"]
    for claim in DEFAULT_CLAIMS:
        fields = ", ".join(f"{key}: {json.dumps(value, ensure_ascii=False)}" for key, value in claim.items()
                           if value not in ("", None))
        lines.append(f"  - {{{fields}}}")
    return "\n".join(lines) + "\n"


TEMPLATE += """
# The sizing model (kvgate plan): before each gate, its figures predicted from the config and what the
# gates before it measured, shown and recorded; at the end, set beside what each gate measured.
sizing:
  calibration: null               # constants from an earlier run (kvgate plan --calibrate RUN_DIR): predicts
                                  # G2 and G3 before G2 runs; null: from G2's own measurements onward
  runs: 5                         # G3 runs simulated per level, each its own draw of the machine's step noise
  hit_ratio_points: 0.05          # the model's tolerances (informational, never a gate):
  figure_mape: 0.15               # hit ratios within 5 points, TTFT / throughput within 15%
  # What the plan needs of an external target (kind: external), which no endpoint tells; for the embedded
  # one it reads targets.embedded, and a field given here replaces what it reads there.
  # target:
  #   model_config: /models/Llama-3.1-70B/config.json   # the KV layout: layers, KV heads, head dim, dtype
  #   # kv_dtype: fp8                 # the KV cache's dtype when it is not the model's
  #   # kv_layout: {layers: 80, dtype: bf16, kv_heads: 8, head_dim: 128}   # instead of model_config
  #   # kv_layout: {layers: 61, dtype: bf16, kv_lora_rank: 512, qk_rope_head_dim: 64}   # MLA (DeepSeek-V3)
  #   block_size: 16                  # tokens per KV block (vLLM's default 16)
  #   device_kv_tokens: 500000        # vLLM: "GPU KV cache size: N tokens"; SGLang: max_total_num_tokens
  #   host_capacity: 256GiB           # the host DRAM tier (an offload connector's CPU buffer)
  #   disk_capacity: 4TB              # the disk tier
  #   pool_capacity: 1TiB             # the shared pool under the candidate's nodes (targets.candidate_nodes)
  #   pool_gbps: 5.0                  # what a node loads from the pool at (default: kvgate pool-bench on loopback)
  #   max_running: 256                # requests an engine runs at once (vLLM --max-num-seqs)
  # A recompute curve from FLOPs where no run or calibration gives one (a plan before any test):
  # roofline: {device_tflops: 400, params: 8.03B, attention_dim: 4096}   # achievable TFLOP/s, heads x head dim
"""
TEMPLATE += _claims_section()
