"""The commented gates.yaml that `kvgate init` writes: the quick profile's values filled into an annotated layer.

`ANNOTATED` holds the keys and what they mean, never a value: a line `key:` with no key under it takes
the value at its path, from the quick profile (gates/profiles/quick.yaml) or, for a key the profile leaves
out, from the validated configuration's default. A list of mappings (thresholds, faults) is written whole,
in the profile's order; a line `- name  # comment` under it only gives the item whose first value is
`name` (a threshold's metric, a fault's kind) its comment. The claims sheet is kvcore's DEFAULT_CLAIMS.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from kvcore.claims import DEFAULT_CLAIMS

from .config import StorageConfig, load_config, profile_defaults

ANNOTATED = """\
# kvgate gates.yaml: what to test, against what, and what counts as passing.
# Every key is optional: a missing key takes the profile's default. A typo is an
# error (exit 2), never a silent default. Run: kvgate run --config gates.yaml

# quick: the embedded default, all gates in minutes on a small machine.
# full: a real joint test (G4 soaks for 72 hours).
profile:
aa:                               # A/A (kvgate run --aa): each subject against itself, counting false decisions

targets:
  # embedded: kvgate starts its own servers (recompute, device-only baseline, tiered candidate).
  # external: give the endpoints below; API keys are read from the named environment variables.
  kind:
  embedded:
    preset:                       # tiny | small | base (model size)
    seed:                         # weights seed
    max_running:                  # requests decoding at once per server
    device_capacity_blocks:       # device tier, both cached modes (256-token blocks)
    host_capacity:                # host DRAM tier of the tiered candidate
    disk_capacity:                # disk tier of the tiered candidate, under storage.path
    disk_io_mode:                 # O_DIRECT reads (buffered: through the page cache)
    disk_read_workers:            # parallel block reads, the tier's queue depth
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
  path:                           # the storage under test: fio runs here, the disk tier lives here

inventory:                        # G1: what the order says; leave a key out to skip its check
  min_cpu_cores:
  min_memory_gib:
  min_free_gib:                   # free space at storage.path
  # min_gpus: 8
  # min_nics: 2
  # rdma_required: true

fio:                              # G1 fio matrix: seq read/write 1 MiB, random read/write 4 KiB, mixed 70/30
  size:
  runtime_s:
  iodepth:
  numjobs:
  direct:
  ioengine:
  verify:                         # crc32c write + verify pass
  verify_size:
  sweep:                          # G1's storage sweep: the storage's best read and fsync'd write, G2's yardstick
    read_bs:                      # request sizes of the sequential read points
    iodepths:                     # queue depths of the direct read points (libaio, io_uring)
    numjobs:                      # parallel jobs (buffered reads: psync jobs, depth 1)
    modes:                        # buffered reads drop the pages first (invalidate=1)
    ioengines:                    # one the host lacks is probed and left out
    write_bs:                     # fsync'd sequential writes (end_fsync=1)
    write_numjobs:
    write_modes:
    size:                         # bytes per point
    runtime_s:                    # at most, per point

g1:
  thresholds:                     # {metric, op, value} or a band {metric, min, max}

g2:
  contexts:                       # tokens; one request at a time
  rounds:
  cold_read_pairs:                # pairs of the tier's cold load and the storage's best read job, until decided
    min:                          # always taken (at least 3); a plain number n: exactly n pairs
    max:                          # the most when the interval does not decide
    budget_s:                     # no pair started after this
  cold_read_prefixes:             # longest-context prefixes each tier round loads cold (more bytes per pair)
  cold_read_sets:                 # prefix sets stored at the first pair; pair i reloads set i mod sets
  model_load:                     # model service loading on the storage under test
    enabled:
    # path: /models/DeepSeek-R1-Distill-Llama-70B   # an existing safetensors model (read only, never written)
    size:                         # without path: a random checkpoint this big is written under storage.path
    shard_size:
    loaders:                                 # each read cold beside the best read job on the same files
                                             # (also: fastsafetensors)
    judged:                       # whose ratio is judged: kvgate (its own path), or a field loader
    parallel:                     # reads in flight (kvgate) or read threads (the streamers)
    rounds:                                  # after a warm-up round, until the judged loader decides
    # baseline_path: /mnt/nfs/kvgate   # the storage to compare with (e.g. NFS): the speedup check runs
    service:                      # embedded: `kvgate serve --weights` per loader, process start to first token
    # launch: "vllm serve /models/x --load-format runai_streamer"   # external: the engine's own start,
    # health_url: http://127.0.0.1:8000/health                      # timed to ready and first token
  checkpoint:                     # checkpoint saving: torch.distributed.checkpoint, model + optimizer state
    enabled:
    ranks:                        # processes on the gloo backend; the slowest rank's time counts
    parameters:                   # 280 MB of state; or 8B, 70B, 405B, 1T (MLPerf Storage), 32B, adapter
    bytes_per_parameter:          # bf16 weights + fp32 master weights + Adam's two moments
    thread_count:                 # files each rank writes at once
    writers:                                 # kvgate (its own: O_DIRECT, DCP's format) and dcp (FileSystemWriter)
    judged:                       # whose ratio is judged: kvgate (the storage is judged), or dcp
    rounds:                                  # saves beside the best fsync'd write job (after two warm-ups)
    restores:                     # cold restores by each reader, checked bit for bit
    # baseline_path: /mnt/nfs/kvgate-ckpt
  no_reuse:                       # the no-reuse control: unique prompts, tiered candidate beside the baseline
    enabled:
    context_tokens:
    max_tokens:
    pairs:                        # alternating pairs: no_reuse_ttft_cost, no_reuse_throughput_cost (judged when
                                  # in thresholds, as the full profile has them: <= 5%)
  thresholds:
    - cold_read_vs_storage_best  # vs the storage's best read, side by side
    - disk_hit_ttft_vs_recompute  # at the longest context
    - model_load_vs_storage_best  # the judged loader vs the best read job, same files
    - model_load_speedup_vs_baseline  # needs model_load.baseline_path
    - checkpoint_write_vs_storage_best  # vs the best fsync'd write job, side by side
    - checkpoint_speedup_vs_baseline  # needs checkpoint.baseline_path

g3:
  workload:                       # see workloads/specs/ for every kind
  # A trace (kind: trace, path: your JSONL file or `kvgate run --trace FILE`, warmup_requests: N):
  # see workloads/specs/trace.yaml. replay: closed_loop sends its requests in order at each
  # concurrency; rate_multipliers replays its arrival times at each multiple of its rate (open loop)
  # and judges the highest one each target sustains with TTFT p90 <= ttft_slo_ms.
  replay:                         # closed_loop: levels are concurrencies | rate_multipliers (traces)
  levels:                         # concurrency sweep (rate_multipliers: e.g. [1, 2, 4])
  # ttft_slo_ms: 2000             # rate_multipliers: the TTFT objective a sustained rate meets
  # each level: pairs of short blocks, baseline and candidate in turn (ABBA...), both serving the same
  # segment of the load order once; warm-up pairs until the candidate settles, then pairs until the
  # interval over them decides every rule of the level (valid at every look), or blocks.max, or blocks.budget_s
  duration_s:                     # about how long the baseline takes to serve a pair's segment
  warmup_s:                       # left out of a block run by time (the no-reuse control's default)
  steady:                         # a level's warm-up ends when a candidate block agrees with its block 2 pairs before
    ttft_change:                  # TTFT p50 within this fraction
    hit_ratio_points:             # hit ratio within this many points (a fraction)
    max_pairs:                    # warm-up pairs left out at most; then measured anyway, and said
  blocks:                         # measured pairs per level: {min: at least (>= 3), max: at most, budget_s: none
                                  # started after this many seconds at a level (null: no limit)}
  min_requests:                   # completed requests a block needs to be valid
  max_error_share:                # a block whose measured requests failed more than this is invalid
  prime:                          # send each target every turn of every session once (a trace: its warm-up) first
  no_reuse:                       # the no-reuse control: prompts that share no prefix, one level, unprimed
    enabled:
    level:                        # its concurrency: no_reuse_ttft_cost, no_reuse_throughput_cost (judged when
                                  # in thresholds, as the full profile has them: <= 5%)
    duration_s:                   # per target (default: duration_s)
    warmup_s:
    # workload: {kind: random, requests: 1000, input_tokens: {distribution: uniform, min: 512, max: 2048}}
  thresholds:
    - throughput_gain  # below: FAIL; above: PASS with a note
    - sustained_rate_gain  # rate_multipliers: in place of throughput_gain
    - disk_hit_share  # the candidate's lower-tier hits its disk tier served (its storage, not DRAM)
    # error_rate (the candidate's failed share, per level) is judged by its default, <= 0.01

g4:
  workload:
  duration_s:
  window_s:
  warmup_s:                       # first seconds left out of the drift checks (caches filling)
  concurrency:
  memory_growth_limit_mib:        # most growth of server memory outside the cache pools over the horizon:
  memory_growth_horizon_s:        # the uptime certified: every growth slope (memory, descriptors, threads, tasks,
                                  # temp files) projected this far (unset: 72 h for a soak of 30 min or more,
                                  # duration_s for a shorter one, as two minutes tell gross growth only)
  drift_tolerance:                # largest trend over the soak (fraction of the level) in TTFT p99, throughput,
                                  # memory; two minutes tell gross drift only (full profile: 0.05)
  max_error_share:                # a window whose requests failed more than this is left out of the drift checks
  measured_only:                  # drift checks measured, not judged: a soak too short to power them (quick only)
  faults:                         # injected into the embedded candidate during the soak ([] for none)
    # stored-block faults (flip_byte, truncate, delete, swap) damage a disk block of the first probe's
    # prompt; I/O faults (read_error, write_error, disk_full, slow_disk + delay_ms) stay armed duration_s
  thresholds:
    - faults_handled_fraction  # detected, answers unchanged, recovered

# The sizing model (kvgate plan): before each gate, its figures predicted from the config and what the
# gates before it measured, shown and recorded; at the end, set beside what each gate measured.
sizing:
  calibration:                    # constants from an earlier run (kvgate plan --calibrate RUN_DIR): predicts
                                  # G2 and G3 before G2 runs; null: from G2's own measurements onward
  runs:                           # G3 runs simulated per level, each its own draw of the machine's step noise
  hit_ratio_points:               # the model's tolerances (informational, never a gate):
  figure_mape:                    # G3's hit ratios and reductions within 5 points, TTFT / throughput within 15%,
  g2_ttft_mape:                   # G2's TTFTs within 10%
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

CLAIMS_HEADER = """
# The vendor's claims, each set beside what the run measured (and what `kvgate plan` predicts):
# met at or above `min` (above a band's `max`: met, with a note), not met below it, or not measured
# with the reason (e.g. no baseline path). `metric` is a figure its `gate` records; `read`: last, min
# or max over the gate's levels, median, or inverse (1/x: a speed-up from a TTFT ratio).
claims:
"""

_KEY = re.compile(r"^(?P<indent> *)(?P<key>[a-z_0-9]+):(?P<pad> *)(?P<comment>#.*)?$")
_ITEM = re.compile(r"^ *- (?P<name>[a-z_0-9.-]+)(?: +(?P<comment>#.*))?$")
_PLAIN = re.compile(r"^[A-Za-z0-9_./][A-Za-z0-9_./ -]*$")
_LONG_FLOW = 60   # a mapping whose flow form is longer is written as a block (a workload)


def render_template() -> str:
    """The template's text: the annotated layer filled with the quick profile's values, then the claims sheet."""
    validated = load_config(profile="quick").model_dump(mode="json")
    # the storage path is made absolute when validated; the template keeps the default as written
    validated["storage"]["path"] = str(StorageConfig.model_fields["path"].default)
    return fill(ANNOTATED, profile_defaults("quick"), validated) + _claims_section()


def fill(annotated: str, profile: dict, validated: dict) -> str:
    """Each value-less key of `annotated` given its value: `profile`'s where it has the path, else `validated`'s."""
    out: list[str] = []
    path: list[str] = []
    pending: Optional[_Items] = None
    lines = annotated.splitlines()
    for number, line in enumerate(lines):
        key = _KEY.match(line)
        if pending is not None:
            if line.strip().startswith("#") and not pending.comments:   # a comment on the list, before its items
                out.append(line)
                continue
            if pending.takes(line):
                continue
            out += pending.lines()
            pending = None
        if key is None:
            out.append(line)
            continue
        indent = len(key["indent"])
        path = path[: indent // 2] + [key["key"]]
        if _opens_section(lines, number, indent):
            out.append(line)
            continue
        value = _value(path, profile, validated)
        if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            out.append(line)
            pending = _Items(path, value, indent + 2)
        elif isinstance(value, dict) and len(_flow(value)) > _LONG_FLOW:
            out.append(line)
            out += [f"{' ' * (indent + 2)}{name}: {_flow(item)}" for name, item in value.items()]
        else:
            out.append(_commented(f"{key['indent']}{key['key']}: {_flow(value)}", line, key["comment"]))
    if pending is not None:
        out += pending.lines()
    return "\n".join(out) + "\n"


class _Items:
    """A list of mappings being written: the comments its `- name` lines give, the lines that follow them."""

    def __init__(self, path: list[str], items: list[dict], indent: int) -> None:
        self.path, self.items, self.indent = path, items, indent
        self.comments: dict[str, str] = {}
        self.after: list[str] = []

    def takes(self, line: str) -> bool:
        """Whether `line` still belongs to the list (an item's comment, or a comment line among or after them)."""
        item = _ITEM.match(line)
        if item:
            self.comments[item["name"]] = item["comment"] or ""
            return True
        if line.strip().startswith("#") and self.comments:
            self.after.append(line)
            return True
        return False

    def lines(self) -> list[str]:
        names = [str(next(iter(item.values()))) for item in self.items]
        unknown = sorted(set(self.comments) - set(names))
        if unknown:
            raise KeyError(f"{'.'.join(self.path)}: the template comments on {unknown}, which the profile lacks")
        written = []
        for name, item in zip(names, self.items):
            comment = self.comments.get(name)
            written.append(f"{' ' * self.indent}- {_flow(item)}" + (f"  {comment}" if comment else ""))
        return written + self.after


def _opens_section(lines: list[str], number: int, indent: int) -> bool:
    """Whether the key on line `number` has keys of its own below it (the next line that is not a comment)."""
    for line in lines[number + 1:]:
        if line.strip() and not line.strip().startswith("#"):
            key = _KEY.match(line) or re.match(r"^(?P<indent> *)[a-z_0-9]+: ", line)
            return bool(key) and len(key["indent"]) > indent
    return False


def _value(path: list[str], profile: dict, validated: dict) -> Any:
    for source in (profile, validated):
        value: Any = source
        for key in path:
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:   # a default validated as a float from a whole number (512) is written as one
            return int(value) if source is validated and isinstance(value, float) and value.is_integer() else value
    raise KeyError(f"{'.'.join(path)}: in the template but not in the configuration")


def _flow(value: Any) -> str:
    """YAML's flow form as a person writes it: [1M, 16M], {min: 3, max: 12}, \">=\", null."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_flow(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_flow(item) for item in value) + "]"
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, str) and not _PLAIN.match(value):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _commented(text: str, annotated: str, comment: Optional[str]) -> str:
    """`text` with the annotated line's comment, at its column where there is room."""
    if not comment:
        return text
    column = annotated.index(comment)
    return (text.ljust(column) if len(text) < column else text + " ") + comment


def _claims_section() -> str:
    """The claims sheet with the seed playbook's figures, one flow mapping per claim (kvcore/claims.py)."""
    lines = [
        "  - {" + ", ".join(f"{key}: {json.dumps(value, ensure_ascii=False)}" for key, value in claim.items()
                            if value not in ("", None)) + "}"
        for claim in DEFAULT_CLAIMS
    ]
    return CLAIMS_HEADER + "\n".join(lines) + "\n"
