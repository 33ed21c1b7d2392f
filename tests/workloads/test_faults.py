"""Consistency under faults: every fault, and a token-exact oracle.

Each test runs real `kvgate serve` processes on loopback. The oracle for every
fault: greedy output identical to a `recompute` server's for the same prompt,
no 5xx, the fault detected and counted in /metrics, and requests go on. Each
test also shows the fault met a block in use (the cache hit stops right at the
damaged block, or the fault's own counter moved).
"""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from cache_impl.cache.faults import BLOCK_FAULTS, EXPECTED_REASON
from cache_impl.server.auth import ADMIN_TOKEN_HEADER
from gates.g4_soak.analysis import fault_outcome
from tests.servers import ADMIN_TOKEN, Oracle, ServerProcess, ask, distinct_prompt, http_client, started_server
from workloads.probes.faults import (
    AdminClient,
    AdminError,
    counter,
    damage_prompt_blocks,
    detection_counts,
    kill_and_restart,
)
from workloads.traffic.client import StreamingClient

BLOCK = 256


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    for server in started_server(tmp_path_factory.mktemp("oracle"), mode="recompute"):
        yield Oracle(server)


@pytest.fixture(scope="module")
def tiered(tmp_path_factory):
    yield from started_server(tmp_path_factory.mktemp("faults"), admin=True)


def _temp_files(root: Path) -> list[Path]:
    return list(root.rglob("*.tmp"))


# -- stored blocks -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", BLOCK_FAULTS)
def test_a_damaged_stored_block_is_refused_counted_and_its_kv_recomputed(tiered, oracle, kind):
    prompt = distinct_prompt(f"stored block {kind}")
    admin = AdminClient(tiered.base_url)
    first = ask(tiered, prompt)
    before = admin.metrics()
    done = damage_prompt_blocks(admin, kind, prompt=prompt, block=2)
    again = ask(tiered, prompt)
    after = admin.metrics()
    assert done["block_index"] == 2
    assert again["text"] == first["text"] == oracle(prompt)
    assert again["cached"] == 2 * BLOCK          # blocks 0 and 1 came from disk; the hit ended at the damaged block
    reason = EXPECTED_REASON[kind]
    caught = (counter(after, "kvgate_cache_corrupt_blocks_total", tier="disk", reason=reason)
              - counter(before, "kvgate_cache_corrupt_blocks_total", tier="disk", reason=reason))
    assert caught == 1, f"expected one block refused as {reason}"
    third = ask(tiered, prompt)                    # recomputed blocks were stored again
    assert third["text"] == first["text"] and third["cached"] > again["cached"]


class _TieredBlocks:
    """An admin client's locate/evict/flush over a fixed layout of block files (unit test of the victim's choice)."""

    def __init__(self, root: Path, tiers: list[list[str]]) -> None:
        self.tiers = tiers
        self.paths = [root / f"block-{i}" for i in range(len(tiers))]
        for path in self.paths:
            path.write_bytes(bytes(8192))

    def flush(self) -> dict:
        return {}

    def evict(self, tiers) -> dict:
        self.tiers = [[tier for tier in held if tier not in tiers] for held in self.tiers]
        return {}

    def locate(self, prompt=None, messages=None, token_ids=None) -> list[dict]:
        return [{"key": f"k{i}", "index": i, "tiers": held, "path": str(path)}
                for i, (held, path) in enumerate(zip(self.tiers, self.paths))]


def test_the_damaged_block_is_one_a_load_reads_the_last_before_a_gap_in_the_lower_tiers(tmp_path):
    # blocks 0-1 on disk, 2 only in the host (its disk copy evicted by LRU), 3 on disk again: once the host is
    # emptied a load reads 0 and 1 and recomputes from 2, so damage to 3 would never be read
    admin = _TieredBlocks(tmp_path, [["host", "disk"], ["disk"], ["host"], ["disk"]])
    done = damage_prompt_blocks(admin, "flip_byte", prompt="p")
    assert (done["block_index"], done["loadable_blocks"], done["prompt_blocks"]) == (1, 2, 4)
    assert admin.paths[1].read_bytes() != bytes(8192) and admin.paths[3].read_bytes() == bytes(8192)


def test_a_prompt_whose_first_block_is_on_no_lower_tier_has_nothing_to_damage(tmp_path):
    admin = _TieredBlocks(tmp_path, [["host"], ["disk"]])
    with pytest.raises(AdminError, match="no block on the disk tier"):
        damage_prompt_blocks(admin, "flip_byte", prompt="p")


# -- disk I/O ------------------------------------------------------------------------------------


def _on_disk_only(server, prompt: str) -> AdminClient:
    """Ask once (the prompt's blocks are stored), publish the disk writes and empty the upper tiers."""
    admin = AdminClient(server.base_url)
    ask(server, prompt)
    admin.flush()
    admin.evict(("device", "host"))
    return admin


def test_read_errors_fall_back_to_recompute_and_are_counted(tiered, oracle):
    prompt = distinct_prompt("read error")
    admin = _on_disk_only(tiered, prompt)
    before = detection_counts(admin.metrics())
    admin.arm("read_error")
    try:
        failed_read = ask(tiered, prompt)
    finally:
        admin.clear()
    after = detection_counts(admin.metrics())
    assert failed_read["text"] == oracle(prompt) and failed_read["cached"] == 0
    assert after["read_errors"] > before["read_errors"] and after["faults_injected"] > before["faults_injected"]
    assert ask(tiered, prompt)["cached"] > 0      # requests go on, and the cache serves again


@pytest.mark.parametrize("kind", ["disk_full", "write_error"])
def test_a_failed_disk_write_publishes_nothing_and_the_tier_recovers(tiered, oracle, kind):
    prompt = distinct_prompt(f"failed write {kind}")
    admin = AdminClient(tiered.base_url)
    before = detection_counts(admin.metrics())
    admin.arm(kind)
    try:
        answer = ask(tiered, prompt)
        admin.flush()
    finally:
        admin.clear()
    after = detection_counts(admin.metrics())
    blocks = admin.locate(prompt)
    assert answer["text"] == oracle(prompt)
    assert after["write_errors"] - before["write_errors"] == len(blocks) == 5
    assert all("disk" not in b["tiers"] and not Path(b["path"]).exists() for b in blocks)
    assert not _temp_files(tiered.cache_dir)       # a failed write leaves nothing behind
    admin.evict(("device", "host"))                # demotes the blocks to disk now that writes work
    admin.flush()
    assert all("disk" in b["tiers"] and Path(b["path"]).exists() for b in admin.locate(prompt))
    admin.evict(("device", "host"))
    from_disk = ask(tiered, prompt)
    assert from_disk["text"] == oracle(prompt) and from_disk["cached"] == 5 * BLOCK


def test_a_slow_disk_delays_loads_but_serves_the_same_tokens(tiered, oracle):
    prompt = distinct_prompt("slow disk")
    admin = _on_disk_only(tiered, prompt)
    before = detection_counts(admin.metrics())
    admin.arm("slow_disk", duration_s=30, delay_ms=150)
    try:
        started = time.monotonic()
        slow = ask(tiered, prompt)
        took = time.monotonic() - started
    finally:
        admin.clear()
    after = detection_counts(admin.metrics())
    assert slow["text"] == oracle(prompt) and slow["cached"] == 5 * BLOCK
    assert after["faults_injected"] - before["faults_injected"] >= 5 and took >= 0.15
    assert after["disk_hits"] - before["disk_hits"] == 5


def test_bad_fault_requests_get_a_400_naming_the_field(tiered):
    with http_client(tiered.port) as http:
        for body, param in (({"kind": "meteor"}, "kind"), ({"kind": "slow_disk"}, "delay_ms"),
                            ({"kind": "read_error", "duration_s": "soon"}, "duration_s"),
                            ({"kind": "read_error", "when": 3}, "kind")):
            response = http.post("/admin/faults", json=body, headers={ADMIN_TOKEN_HEADER: ADMIN_TOKEN})
            assert response.status_code == 400, body
            assert response.json()["error"]["param"] == param, response.json()


# -- processes -------------------------------------------------------------------------------------


def test_kill_9_in_the_middle_of_stores_then_a_warm_restart_serves_only_whole_verified_blocks(tmp_path, oracle):
    workdir = tmp_path / "node"
    server = ServerProcess(workdir, admin=True)
    server.wait_healthy()
    admin = AdminClient(server.base_url)
    prompts = [distinct_prompt(f"killed mid-store {i}") for i in range(3)]
    restarted = None
    try:
        admin.arm("slow_disk", delay_ms=1500)    # each block write waits before it is published
        for prompt in prompts:
            ask(server, prompt)
        first_block = Path(admin.locate(prompts[0])[0]["path"])
        deadline = time.monotonic() + 60
        while len(list(server.cache_dir.rglob("*.kvb"))) < 2:            # writes are published in order
            assert time.monotonic() < deadline, "no two blocks were published"
            time.sleep(0.2)
        assert counter(admin.metrics(), "kvgate_cache_pending_disk_writes") > 0
        assert _temp_files(server.cache_dir), "no write was in flight at the kill"
        torn = next(p for p in server.cache_dir.rglob("*.kvb") if p != first_block)
        in_flight = []

        def while_down() -> None:                                          # what the kill left, then a torn block
            in_flight.extend(_temp_files(server.cache_dir))
            torn.write_bytes(torn.read_bytes()[:5000])

        restarted = kill_and_restart(server.process.pid, workdir / "restarted.log", while_down=while_down)
        assert server.process.wait(timeout=30) is not None                # the old process is gone
        assert in_flight, "no write was in flight at the kill"
        server.process = restarted
        server.wait_healthy()
        samples = admin.metrics()
        assert counter(samples, "kvgate_cache_reindex_removed_total") == 1        # the torn block, refused
        assert counter(samples, "kvgate_cache_corrupt_blocks_total", reason="short_read") == 1
        assert not _temp_files(server.cache_dir)                          # in-flight writes never became blocks
        answers = [ask(server, prompt) for prompt in prompts]
        assert [a["text"] for a in answers] == [oracle(p) for p in prompts]
        assert answers[0]["cached"] >= BLOCK                                # published blocks were served
        assert counter(admin.metrics(), "kvgate_cache_corrupt_blocks_total") == 1
    finally:
        server.stop()


def test_eviction_racing_loads_under_concurrency_never_serves_wrong_kv(tmp_path, oracle):
    engine = {"preset": "tiny", "max_running": 4,
              "cache": {"device_capacity_blocks": 6, "host_capacity_bytes": "1MiB"}}
    shared = distinct_prompt("shared system prompt", 600)
    prompts = [shared + distinct_prompt(f" user {i}", 900) for i in range(8)]
    expected = {p: oracle(p) for p in prompts}
    failures, cached = [], Counter()
    for server in started_server(tmp_path, engine=engine, admin=True):
        def user(seed: int) -> None:
            order = random.Random(seed).sample(prompts * 3, len(prompts) * 3)
            for prompt in order:
                try:
                    answer = ask(server, prompt)
                except (AssertionError, httpx.HTTPError) as error:
                    failures.append(str(error))
                    continue
                cached[answer["cached"] > 0] += 1
                if answer["text"] != expected[prompt]:
                    failures.append(f"wrong answer for {prompt[:30]!r}")
        threads = [threading.Thread(target=user, args=(seed,)) for seed in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        samples = AdminClient(server.base_url).metrics()
    assert not failures, failures[:5]
    assert cached[True] > 0
    for tier in ("device", "host"):
        assert counter(samples, "kvgate_cache_evictions_total", tier=tier) > 0, f"no eviction from {tier}"
    assert counter(samples, "kvgate_cache_corrupt_blocks_total") == 0


def test_two_servers_writing_the_same_blocks_into_one_directory_leave_only_whole_blocks(tmp_path, oracle):
    shared_dir = tmp_path / "shared-disk"
    prompts = [distinct_prompt(f"two writers {i}") for i in range(4)]
    nodes = [ServerProcess(tmp_path / name, cache_dir=shared_dir, admin=True) for name in ("a", "b")]
    answers = []
    try:
        for node in nodes:
            node.wait_healthy()
        threads = [threading.Thread(target=lambda n=node: answers.extend(ask(n, p) for p in prompts))
                   for node in nodes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for node in nodes:
            AdminClient(node.base_url).flush()
    finally:
        for node in nodes:
            assert node.stop() == 0
    assert sorted(a["text"] for a in answers) == sorted([oracle(p) for p in prompts] * 2)
    assert len(list(shared_dir.rglob("*.kvb"))) == 4 * 5 and not _temp_files(shared_dir)
    for third in started_server(tmp_path / "c", cache_dir=shared_dir, admin=True):
        samples = AdminClient(third.base_url).metrics()
        assert counter(samples, "kvgate_cache_reindex_removed_total") == 0
        assert counter(samples, "kvgate_cache_blocks", tier="disk") == 20
        for prompt in prompts:
            answer = ask(third, prompt)
            assert answer["text"] == oracle(prompt) and answer["cached"] == 5 * BLOCK


@pytest.mark.parametrize("change", [{"seed": 1}, {"cache": {"block_size": 128}}], ids=["weights-seed", "block-size"])
def test_blocks_of_another_fingerprint_are_never_served(tmp_path, change):
    prompt = distinct_prompt("fingerprint change")
    shared_dir = tmp_path / "disk"
    for old in started_server(tmp_path / "old", cache_dir=shared_dir, admin=True):
        ask(old, prompt)
        AdminClient(old.base_url).flush()
    old_dirs = [d for d in shared_dir.iterdir() if d.is_dir()]
    engine = {"preset": "tiny", **change}
    for reference in started_server(tmp_path / "reference", mode="recompute", engine=engine):
        expected = ask(reference, prompt)["text"]
    # the new model's directory is planted with the old model's block files, under their own names
    probe = ServerProcess(tmp_path / "probe", cache_dir=shared_dir, engine=engine, admin=True)
    probe.wait_healthy()
    assert probe.stop() == 0
    new_dir = next(d for d in shared_dir.iterdir() if d.is_dir() and d not in old_dirs)
    planted = 0
    for block in old_dirs[0].rglob("*.kvb"):
        (new_dir / block.parent.name).mkdir(exist_ok=True)
        shutil.copyfile(block, new_dir / block.parent.name / block.name)
        planted += 1
    assert planted == 5
    for new in started_server(tmp_path / "new", cache_dir=shared_dir, engine=engine, admin=True):
        samples = AdminClient(new.base_url).metrics()
        answer = ask(new, prompt)
    assert counter(samples, "kvgate_cache_reindex_removed_total") == planted
    assert counter(samples, "kvgate_cache_corrupt_blocks_total", reason="fingerprint") == planted
    assert answer["cached"] == 0 and answer["text"] == expected


def _flip_fault_with_a_race(tiered, tmp_path, tag: str, race) -> tuple[dict, list]:
    """A flip_byte fault through the G4 schedule on the tiered server, `race(victim, resend)` run once between
    the damage and the probe (the engine's cache hook); the fault's row, and what the race returned."""
    from gates.g4_soak.fault_schedule import FaultSchedule
    from workloads.probes.faults import CacheAdmin
    from workloads.probes.settings import FaultSpec
    from workloads.traffic.requests import WorkloadRequest
    from workloads.traffic.target import Target

    admin = AdminClient(tiered.base_url)
    messages = ({"role": "user", "content": distinct_prompt(tag)},)
    probe = WorkloadRequest("probe", "s", 0, messages, 12, 400)
    target = Target("candidate", f"{tiered.base_url}/v1", "kvgate-tiny")
    client = StreamingClient(target.url, target.model, target.api)
    expected = client.send(probe, keep_text=True).text
    raced: list = []

    def hook() -> None:
        if raced:
            return
        # the block the fault damaged: the last of the prompt's leading blocks on disk (damage_prompt_blocks')
        victim = Path([b for b in admin.locate(messages=list(messages)) if "disk" in b["tiers"]][-1]["path"])
        raced.append(race(victim, lambda: client.send(replace(probe, request_id="racing"), keep_text=True).ok))

    schedule = FaultSchedule([FaultSpec(kind="flip_byte", at_s=0)], CacheAdmin(admin, hook), target,
                             probe, expected, tmp_path / "faults.jsonl", recovery_timeout_s=20)
    try:
        schedule.start(time.time(), 0.0, time.time() + 60)
        schedule._thread.join(90)
    finally:
        client.close()
    row, = schedule.done()
    return row, raced


def test_a_stored_block_fault_whose_probe_an_upper_tiers_whole_copy_served_is_probed_again_past_it(tiered, tmp_path):
    """Between the damage and the probe a whole copy of the damaged block is published into the upper tiers (here:
    the flipped byte put back for one request that loads the block from disk, then flipped again, the disk's copy
    left damaged). The probe is then served that copy and never reads the disk's: the fault step evicts the upper
    tiers and asks again, and the row says so; the damage is then read and counted."""
    from cache_impl.cache.faults import flip_byte

    def publish_a_whole_copy(victim: Path, resend) -> bool:
        flip_byte(victim)                     # whole again, for one request that loads it from disk
        sent = resend()
        flip_byte(victim)                     # damaged again, the upper tiers holding a whole copy
        return sent

    row, published = _flip_fault_with_a_race(tiered, tmp_path, "published between damage and probe",
                                                publish_a_whole_copy)
    assert row["error"] is None and published == [True]
    assert row["reprobes"] and "device" in row["reprobes"][0]["held_by"], json.dumps(row)
    assert not row["reprobes"][0]["damage_replaced"]
    assert row["detected"]["corrupt_blocks"] > 0, json.dumps(row)  # the re-probe read the damaged copy
    assert row["probe_during"]["identical"], row
    handled, words = fault_outcome(row)
    assert handled and "asked again 1 time after evicting device" in words, words


def test_a_stored_block_fault_whose_file_a_store_replaced_with_a_whole_one_is_damaged_again(tiered, tmp_path):
    """Between the damage and the probe the damaged block's file is replaced by a whole one, as a store of the same
    block publishes it (a new file renamed over it: the disk tier had evicted the block and a request stored it
    again). The probe then reads the whole file from the disk and nothing is counted: the fault step sees that its
    damaged file is gone, damages the block again and asks again; the damage is then read and counted."""
    from cache_impl.cache.faults import flip_byte

    def store_a_whole_file_over_it(victim: Path, resend) -> bool:
        flip_byte(victim)                     # the bytes whole again ...
        whole = victim.with_name(victim.name + ".whole")
        shutil.copyfile(victim, whole)
        whole.replace(victim)                 # ... in a new file, published as the writer publishes a block
        return True

    row, replaced = _flip_fault_with_a_race(tiered, tmp_path, "its file replaced between damage and probe",
                                               store_a_whole_file_over_it)
    assert row["error"] is None and replaced == [True]
    assert row["reprobes"] and row["reprobes"][0]["damage_replaced"], json.dumps(row)
    assert row["reprobes"][0]["probe"]["identical"]      # the whole file was read: an answer, nothing counted
    assert row["detected"]["corrupt_blocks"] > 0, json.dumps(row)  # the re-probe read the block damaged again
    assert row["probe_during"]["identical"], row
    handled, words = fault_outcome(row)
    assert handled and "damaging it again where a store had replaced the damaged file" in words, words
