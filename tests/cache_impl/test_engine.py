"""The embedded engine: greedy output with a cache hit from every tier equals recompute, and batching works."""

import threading
from pathlib import Path
from typing import get_args

import pytest

from cache_impl.engine.engine import Engine, EngineConfig, FinishEvent, GenerationRequest, QueueFullError
from cache_impl.engine.presets import PRESETS, PresetName
from cache_impl.engine.resident import PAGE
from cache_impl.engine.tokenizer import ByteTokenizer
from kvcore.settings import ConfigError

BLOCK = 256


def _prompt(seed: int, length: int) -> list[int]:
    """Printable, deterministic prompt tokens (byte tokenizer: one token per character)."""
    text = "".join(chr(32 + (seed * 31 + i * 17 + (i // 7) * 3) % 95) for i in range(length - 1))
    return ByteTokenizer().encode(text)


@pytest.fixture
def engines(tmp_path):
    made = []

    def make(mode: str, **settings) -> Engine:
        cache = {"block_size": BLOCK, "device": "cpu", "device_capacity_blocks": 16,
                 "host_capacity_bytes": "64MiB", "disk": {"path": str(tmp_path / "kv")}}
        cache.update(settings.pop("cache", {}))
        engine = Engine(EngineConfig.from_dict({"mode": mode, "preset": "tiny", "cache": cache, **settings}))
        made.append(engine.start())
        return engine

    yield make
    for engine in made:
        engine.stop()


@pytest.fixture
def reference(engines):
    """Greedy output of recompute mode, per prompt."""
    engine = engines("recompute")
    return lambda tokens, n=24: engine.generate(tokens, n).text


def _hits(engine: Engine, tier: str) -> int:
    return engine.cache.snapshot()["tiers"][tier]["hits"]


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_greedy_output_with_a_cache_hit_from_each_tier_equals_recompute(engines, reference, tier):
    engine = engines("tiered")
    prompt = _prompt(1, 3 * BLOCK + 40)
    first = engine.generate(prompt, 24)
    assert first.finish.cached_tokens == 0
    engine.cache.flush()
    if tier in ("host", "disk"):
        engine.cache.evict("device")
    if tier == "disk":
        engine.cache.evict("host")
        engine.cache.tier("disk").drop_page_cache()
    before = _hits(engine, tier)
    again = engine.generate(prompt, 24)
    assert again.finish.cached_tokens == 3 * BLOCK            # the hit really happened ...
    assert _hits(engine, tier) - before == 3                  # ... from the tier under test
    assert again.text == first.text == reference(prompt)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_prompt_ending_on_a_block_boundary_is_served_whole_from_the_cache_and_equals_recompute(
        engines, reference, tier):
    engine = engines("tiered")
    prompt = _prompt(9, 4 * BLOCK)
    first = engine.generate(prompt, 24)
    engine.cache.flush()
    engine.cache.evict("device")
    if tier == "disk":
        engine.cache.evict("host")
        engine.cache.drop_page_cache()
    computed = engine.counters["prompt_tokens_computed"]
    again = engine.generate(prompt, 24)
    assert again.finish.cached_tokens == 4 * BLOCK                         # every block, the last one too
    assert engine.counters["prompt_tokens_computed"] == computed          # no prompt chunk ran: only the logits pass
    assert again.text == first.text == reference(prompt)


def test_device_only_mode_reuses_within_the_device_tier_only(engines, reference):
    engine = engines("device-only")
    assert engine.cache.tiers == ["device"]
    prompt = _prompt(2, 2 * BLOCK + 10)
    engine.generate(prompt, 16)
    again = engine.generate(prompt, 16)
    assert again.finish.cached_tokens == 2 * BLOCK
    assert again.text == reference(prompt, 16)


def test_recompute_mode_reuses_nothing(engines):
    engine = engines("recompute")
    prompt = _prompt(3, 2 * BLOCK + 10)
    engine.generate(prompt, 4)
    assert engine.cache is None
    assert engine.generate(prompt, 4).finish.cached_tokens == 0
    assert engine.snapshot()["counters"]["prompt_tokens_computed"] == 2 * len(prompt)


def test_a_shared_prefix_is_reused_up_to_the_last_whole_block_before_divergence(engines, reference):
    engine = engines("tiered")
    base = _prompt(4, 3 * BLOCK)
    engine.generate(base + [65, 66, 67], 8)
    diverged = base[: 2 * BLOCK + 100] + [70] * 200
    result = engine.generate(diverged, 8)
    assert result.finish.cached_tokens == 2 * BLOCK
    assert result.text == reference(diverged, 8)


def test_blocks_filled_by_decoding_are_stored_and_reused(engines):
    engine = engines("tiered")
    prompt = _prompt(5, BLOCK - 10)
    first = engine.generate(prompt, 40)      # prompt + output crosses the first block boundary
    follow_up = prompt + first.token_ids + [10]
    assert engine.generate(follow_up, 4).finish.cached_tokens == BLOCK


def test_concurrent_requests_are_batched_and_each_gets_its_recompute_answer(engines, reference):
    engine = engines("tiered", max_running=4)
    prompts = [_prompt(10 + i, 100 + 150 * i) for i in range(6)]
    results, threads = {}, []
    for i, prompt in enumerate(prompts):
        thread = threading.Thread(target=lambda i=i, p=prompt: results.__setitem__(i, engine.generate(p, 20)))
        threads.append(thread)
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == len(prompts)
    for i, prompt in enumerate(prompts):
        assert results[i].finish.finish_reason == "length" and results[i].finish.completion_tokens == 20
        assert results[i].text == reference(prompt, 20)


def test_a_full_queue_refuses_new_requests(engines):
    engine = engines("recompute", max_running=1, max_waiting=1)
    started, release = threading.Event(), threading.Event()
    done = threading.Event()

    def slow(event):
        started.set()
        release.wait(30)
        if getattr(event, "finish_reason", None):
            done.set()

    engine.submit(GenerationRequest(_prompt(20, 50), 3, slow))
    assert started.wait(30)                               # the engine thread is busy in the callback
    engine.submit(GenerationRequest(_prompt(21, 50), 3, lambda e: None))
    with pytest.raises(QueueFullError):
        engine.submit(GenerationRequest(_prompt(22, 50), 3, lambda e: None))
    release.set()
    assert done.wait(30)


def test_a_cancelled_request_finishes_as_cancelled_and_frees_its_slot(engines):
    engine = engines("recompute", max_running=1)
    events, finished = [], threading.Event()
    request = GenerationRequest(
        _prompt(30, 50), 3000 - 60, lambda e: (events.append(e), getattr(e, "finish_reason", None) and finished.set())
    )
    engine.submit(request)
    request.cancelled.set()
    assert finished.wait(30)
    assert events[-1].finish_reason == "cancelled"
    assert engine.generate(_prompt(31, 50), 3).finish.finish_reason == "length"   # the slot is free again
    assert engine.snapshot()["running"] == 0


def test_prompts_that_do_not_fit_are_refused(engines):
    engine = engines("recompute")
    with pytest.raises(ValueError, match="exceeds the model's context of 4096 tokens"):
        engine.submit(GenerationRequest(_prompt(40, 4000), 200, lambda e: None))
    with pytest.raises(ValueError, match="empty"):
        engine.submit(GenerationRequest([], 5, lambda e: None))
    # an id past the vocabulary never reaches the embedding (on CUDA: a device-side assert for the process)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 262\), found 262 \(2 outside\)"):
        engine.submit(GenerationRequest([5, 262, 9, 300], 5, lambda e: None))
    assert engine.snapshot()["waiting"] == 0


def test_sampling_with_a_seed_is_reproducible(engines):
    engine = engines("recompute")
    prompt = _prompt(50, 64)
    a = engine.generate(prompt, 20, temperature=1.0, seed=7)
    b = engine.generate(prompt, 20, temperature=1.0, seed=7)
    c = engine.generate(prompt, 20, temperature=1.0, seed=8)
    assert a.text == b.text and a.text != c.text


def test_the_default_preset_also_answers_a_cold_disk_hit_exactly_like_recompute(tmp_path):
    cache = {"device": "cpu", "disk": {"path": str(tmp_path / "kv")}}
    tiered = Engine(EngineConfig.from_dict({"mode": "tiered", "cache": cache})).start()
    recompute = Engine(EngineConfig.from_dict({"mode": "recompute"})).start()
    try:
        assert tiered.model_name == "kvgate-small"
        prompt = _prompt(60, 4 * BLOCK + 3)
        tiered.generate(prompt, 12)
        tiered.cache.flush()
        tiered.cache.evict("device")
        tiered.cache.evict("host")
        tiered.cache.tier("disk").drop_page_cache()
        hit = tiered.generate(prompt, 12)
        assert hit.finish.cached_tokens == 4 * BLOCK
        assert hit.text == recompute.generate(prompt, 12).text
    finally:
        tiered.stop()
        recompute.stop()


def _collecting_request(
    tokens: list[int], max_tokens: int, **sampling
) -> tuple[GenerationRequest, list, threading.Event]:
    events, done = [], threading.Event()

    def on_event(event) -> None:
        events.append(event)
        if isinstance(event, FinishEvent):
            done.set()

    return GenerationRequest(tokens, max_tokens, on_event, **sampling), events, done


@pytest.mark.parametrize("sampling, raises_in", [
    pytest.param({"temperature": 1.0, "seed": 2**64}, "ValueError", id="start-raises"),  # torch's seed range
    pytest.param({"temperature": 1e-300}, "RuntimeError", id="sampling-raises"),  # inf / nan probabilities
])
def test_a_request_that_raises_inside_the_engine_fails_alone(tmp_path, sampling, raises_in):
    """The engine's API takes what the server's protocol refuses: both requests start in the same step."""
    engine = Engine(EngineConfig.from_dict({"mode": "recompute", "preset": "tiny", "cache": {"device": "cpu"}}))
    greedy, greedy_events, greedy_done = _collecting_request(_prompt(7, 40), 12)
    bad, bad_events, bad_done = _collecting_request(_prompt(8, 40), 12, **sampling)
    engine.submit(greedy)
    engine.submit(bad)
    engine.start()
    try:
        assert bad_done.wait(60) and greedy_done.wait(60)
        assert bad_events[-1].finish_reason == "error" and raises_in in bad_events[-1].error
        assert [e for e in bad_events if isinstance(e, FinishEvent)] == [bad_events[-1]]  # one finish event
        assert greedy_events[-1].finish_reason == "length"
        assert len(greedy_events) == 13  # 12 tokens, then the finish
        assert engine.snapshot()["counters"]["engine_errors"] == 1
        alone = engine.generate(_prompt(7, 40), 12)  # the engine keeps serving, with the same greedy output
        assert alone.token_ids == [e.token_id for e in greedy_events[:-1]]
    finally:
        engine.stop()


def test_a_returning_prompt_reuses_the_finished_requests_kv_buffer_and_answers_the_same(tmp_path):
    engine = Engine(EngineConfig.from_dict({"mode": "recompute", "preset": "tiny"})).start()
    try:
        prompt = _prompt(3, 700)
        first = engine.generate(prompt, max_tokens=4)
        again = engine.generate(prompt, max_tokens=4)
        assert engine.runner.kv_buffers.reused == 1 and engine.runner.kv_buffers.allocated == 1
        assert first.finish.finish_reason == "length" and len(first.token_ids) == 4   # both really generated
        assert again.token_ids == first.token_ids
    finally:
        engine.stop()


def test_the_snapshot_counts_the_kv_buffers_kept_for_reuse_and_not_one_that_never_came_back(engines):
    engine = engines("recompute")
    engine.generate(_prompt(5, 300), 2)
    kept = engine.runner.kv_buffers.idle_bytes
    assert kept > 0 and engine.snapshot()["kv_buffer_bytes"] == kept          # nothing running: the kept buffers
    engine.generate(_prompt(6, 300), 2)
    assert engine.snapshot()["kv_buffer_bytes"] == kept                       # the same length reused the buffer
    stray = engine.runner.kv_buffers.take(256)                                # lent, never given back: a leak
    assert engine.snapshot()["kv_buffer_bytes"] == engine.runner.kv_buffers.idle_bytes
    assert stray.nbytes > 0


def test_the_snapshot_says_the_kv_buffers_pages_in_memory_and_their_bound(engines):
    engine = engines("recompute")
    engine.generate(_prompt(7, 2000), 2)                                      # one 8-block buffer, all touched
    used = engine.snapshot()
    # all of it, and what its storage holds besides (the pad that aligned it: under a page, over at most two)
    assert 0 < used["kv_buffer_bytes"] <= used["kv_buffer_resident_bytes"] <= used["kv_buffer_bytes"] + 2 * PAGE
    untouched = engine.runner.kv_buffers.take(4096)                           # 16 blocks: a fresh mapping
    engine.runner.kv_buffers.give(untouched)
    kept = engine.snapshot()
    assert kept["kv_buffer_bytes"] == used["kv_buffer_bytes"] + untouched.nbytes
    assert kept["kv_buffer_resident_bytes"] == used["kv_buffer_resident_bytes"]   # its bytes, not yet pages
    context = -(-engine.max_context // engine.block_size) * engine.block_size
    per_buffer = untouched.nbytes // 4096 * context
    assert kept["kv_buffer_limit_bytes"] == 2 * engine.scheduler.max_running * per_buffer


def test_finished_requests_report_their_kv_to_the_heap_trimmer(engines):
    # a finished request's KV goes back to the OS (cache_impl/platform/heap.py), not to a fragmented arena
    engine = engines("recompute")
    engine.runner.heap.every_bytes = 1
    for length in (300, 700, 1100):
        engine.generate(_prompt(length, length), 4)
    assert engine.runner.heap.trims == (3 if engine.runner.heap.available else 0)


def _finish_of(engine, request_fields: dict) -> tuple[list[int], str]:
    events, done = [], threading.Event()

    def on_event(event):
        events.append(event)
        if isinstance(event, FinishEvent):
            done.set()

    engine.submit(GenerationRequest(_prompt(9, 50), 6, on_event, **request_fields))
    assert done.wait(60)
    return [e.token_id for e in events[:-1]], events[-1].finish_reason


def test_ignore_eos_generates_to_max_tokens_past_end_of_text(engines):
    # benchmark clients (GuideLLM, vllm bench serve) send ignore_eos: true; vLLM then generates max_tokens tokens
    engine = engines("recompute")
    engine.runner.allowed.fill_(float("-inf"))
    engine.runner.allowed[ByteTokenizer().eos_id] = 0.0       # this model's every next token is end-of-text
    assert _finish_of(engine, {}) == ([], "stop")
    assert _finish_of(engine, {"ignore_eos": True}) == ([ByteTokenizer().eos_id] * 6, "length")


def test_the_snapshot_counts_the_buffer_the_cache_is_loading_into(engines):
    """A request being started holds its KV buffer before it runs: while the cache loads into it, the buffer is
    neither running nor kept, and a scrape then must still count it (it is memory the server holds), once even
    when the scrape sees it both starting and running."""
    engine = engines("recompute")
    loop, seen = engine._loop, []
    load = loop.prefix_cache.load

    def load_and_look(seq):
        kept = engine.runner.kv_buffers.idle_bytes
        seen.append((seq.buffer.nbytes, engine.snapshot()["kv_buffer_bytes"], kept))
        engine.scheduler.running.append(seq)                   # as a scrape racing the start would see it
        try:
            seen.append((seq.buffer.nbytes, engine.snapshot()["kv_buffer_bytes"], kept))
        finally:
            engine.scheduler.running.remove(seq)
        return load(seq)

    loop.prefix_cache.load = load_and_look
    try:
        engine.generate(_prompt(8, 900), 2)
    finally:
        loop.prefix_cache.load = load
    assert len(seen) == 2 and all(counted == buffer + kept for buffer, counted, kept in seen)
    assert loop.starting is None



ONE_TEAM = """
import os, sys, threading, torch
from cache_impl.platform.openmp import hand_threads_to_engine
from cache_impl.engine.engine import Engine, EngineConfig, GenerationRequest
before = len(os.listdir("/proc/self/task"))
if sys.argv[1] == "team-first":
    torch.randn(1000000).mul_(2)           # a parallel operation on the main thread: it starts a team
hand_threads_to_engine()
engine = Engine(EngineConfig.from_dict({"mode": "recompute", "preset": "tiny"}), threads=2)
seen, done = [], threading.Event()
def on_event(event):
    seen.append(torch.get_num_threads())
    done.set()
engine.start()
engine.submit(GenerationRequest([7] * 3000, 1, on_event))
done.wait(60)
print(torch.get_num_threads(), seen[0], len(os.listdir("/proc/self/task")) - before)
engine.stop()
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads in /proc")
def test_the_engines_thread_holds_the_processs_only_openmp_team():
    """A server's main thread hands its threads to the engine's (libgomp lets every team's workers sleep between
    parallel regions once the teams outnumber the cores: a prefill 20-40% slower on 2 cores)."""
    import subprocess
    import sys

    def run(mode: str) -> tuple[int, ...]:
        done = subprocess.run([sys.executable, "-c", ONE_TEAM, mode], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return tuple(map(int, done.stdout.split()))

    main_threads, engine_threads, started = run("handed")
    assert main_threads == 1 and engine_threads == 2
    # the control: a main thread that ran one parallel operation first has one more thread, its team's worker
    assert run("team-first") == (1, 2, started + 1)


def test_the_preset_setting_takes_every_preset_by_name_and_nothing_else():
    assert get_args(PresetName) == tuple(PRESETS)
    with pytest.raises(ConfigError, match="engine.preset: expected one of 'tiny', 'small' or 'base', found 'huge'"):
        EngineConfig.from_dict({"preset": "huge"})
    with pytest.raises(ConfigError, match="engine.load_format: expected one of 'kvgate', 'safetensors', "
                                          "'runai_streamer' or 'fastsafetensors', found 'mmap'"):
        EngineConfig.from_dict({"load_format": "mmap"})
