"""Concurrent use: 8 threads storing and loading with eviction running never see wrong KV."""

import random
import shutil
import threading

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cache_impl import CacheConfig, TieredKVCache
from tests.blocks import BLOCK, block_for, blocks_for

PROMPT_FAMILY = 12
DEVICE_SLOTS = 3


def _prompt(family: int, length_blocks: int) -> list[int]:
    """Prompts of one family share their leading blocks; each family is distinct from the first token."""
    return [family * 1000 + i for i in range(length_blocks * BLOCK)]


def test_eight_threads_store_and_load_with_eviction_and_always_get_the_right_bytes(make_cache, layout):
    cache = make_cache(
        write_policy="write-back",
        device_capacity_blocks=6,
        host_capacity_bytes=6 * layout.block_nbytes,
        disk_capacity_bytes=30 * (layout.block_nbytes + 8192),
        disk_read_workers=4,
    )
    expected = {}
    for family in range(PROMPT_FAMILY):
        tokens = _prompt(family, 5)
        for i in range(5):
            expected[cache.keys_for(tokens)[i]] = block_for(layout, tokens, i)
    errors, loaded_blocks = [], [0]
    count_lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                tokens = _prompt(rng.randrange(PROMPT_FAMILY), rng.randint(1, 5))
                if rng.random() < 0.5:
                    cache.store(tokens, blocks_for(layout, tokens))
                    continue
                prefix = cache.load(tokens)
                for key, block in zip(prefix.keys, prefix.blocks):
                    if not torch.equal(block, expected[key]):
                        errors.append(f"wrong bytes for block {key.hex()}")
                with count_lock:
                    loaded_blocks[0] += prefix.num_blocks
                if rng.random() < 0.5:
                    cache.promote(tokens, prefix.blocks)
                for tier in cache.snapshot()["tiers"].values():
                    if tier["used_bytes"] > tier["capacity_bytes"]:
                        errors.append(f"capacity exceeded: {tier}")
        except Exception as exc:  # surfaced below with the thread's seed
            errors.append(f"thread {seed}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert errors == []
    cache.flush()
    snap = cache.snapshot()
    tiers = snap["tiers"]
    assert loaded_blocks[0] > 0
    assert tiers["device"]["evictions"] > 0 and tiers["host"]["evictions"] > 0  # eviction really ran
    assert tiers["host"]["hits"] > 0 and tiers["disk"]["hits"] > 0              # every tier really served
    assert tiers["disk"]["corrupt_blocks"] == 0
    assert snap["pinned_blocks"] == 0


class CacheAgainstAModel(RuleBasedStateMachine):
    """Random stores, loads and restarts; the model says which blocks must be found.

    The disk is large enough never to evict, so a block once stored must stay
    reachable somewhere (eviction demotes, it never drops), across restarts too.
    """

    def __init__(self):
        super().__init__()
        self.cache = None

    @initialize(policy=st.sampled_from(["write-back", "write-through"]))
    def start(self, policy):
        import tempfile

        from cache_impl import Fingerprint, KVLayout

        self.layout = KVLayout(2, 2, 8, "float32", BLOCK)
        self.fp = Fingerprint("seed-0", "test-tokenizer", self.layout)
        self.dir = tempfile.mkdtemp(prefix="kvgate-state-")
        self.policy = policy
        self.stored: set[bytes] = set()
        self._open()

    def _open(self):
        nbytes = self.layout.block_nbytes
        config = CacheConfig.from_dict({
            "block_size": BLOCK, "device": "cpu", "device_capacity_blocks": DEVICE_SLOTS,
            "host_capacity_bytes": 3 * nbytes, "write_policy": self.policy,
            "disk": {"path": self.dir, "capacity_bytes": 1000 * (nbytes + 8192)},
        })
        self.cache = TieredKVCache(config, self.fp)

    @rule(family=st.integers(0, 5), blocks=st.integers(1, 4))
    def store(self, family, blocks):
        tokens = _prompt(family, blocks)
        self.cache.store(tokens, blocks_for(self.layout, tokens))
        self.stored.update(self.cache.keys_for(tokens))

    @rule(family=st.integers(0, 5), blocks=st.integers(1, 4))
    def load(self, family, blocks):
        tokens = _prompt(family, blocks)
        keys = self.cache.keys_for(tokens)
        cached = 0
        while cached < len(keys) and keys[cached] in self.stored:
            cached += 1
        self.cache.flush()
        assert self.cache.lookup(tokens).num_blocks == cached
        prefix = self.cache.load(tokens)
        assert prefix.num_blocks == cached  # the whole prefix, however few device slots there are
        for i, block in enumerate(prefix.blocks):
            assert torch.equal(block, block_for(self.layout, tokens, i))
        self.cache.promote(tokens, prefix.blocks)
        assert all("device" in self.cache.where(key) for key in keys[max(cached - 1, 0):cached])  # the latest

    @rule()
    def restart(self):
        self.cache.close()
        self._open()

    @invariant()
    def within_capacity(self):
        if self.cache is not None:
            for tier in self.cache.snapshot()["tiers"].values():
                assert tier["used_bytes"] <= tier["capacity_bytes"]

    def teardown(self):
        if self.cache is not None:
            self.cache.close()
            shutil.rmtree(self.dir, ignore_errors=True)


CacheAgainstAModel.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
test_cache_against_a_model = CacheAgainstAModel.TestCase
