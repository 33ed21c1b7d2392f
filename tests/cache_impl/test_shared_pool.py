"""The shared pool: two `kvgate serve` nodes on one Mooncake Store or Redis, started here on loopback.

A prefix computed on node A is a hit on node B (no shared disk), with greedy
output identical to recompute; a pool that goes away makes the tier
unavailable (misses, counted, no error) and it comes back by itself; a value
that fails verification is refused, removed from the pool and recomputed.
"""

from __future__ import annotations

import os
import shutil
import socket
import time

import psutil
import pytest

from cache_impl.cache import integrity
from cache_impl.cache.config import RemoteTierConfig
from cache_impl.cache.tiers.remote import open_store
from tests.servers import Oracle, ServerProcess, ask, distinct_prompt, started_pool_nodes, started_server
from workloads.probes.faults import AdminClient, counter
from workloads.servers.stores import MooncakePool, RedisServer

BLOCK = 256
NEEDS = {"redis": ["redis-server"], "mooncake": ["mooncake_master", "mooncake_http_metadata_server",
                                                  "mooncake_client"]}


def _pool(backend: str, workdir):
    missing = [p for p in NEEDS[backend] if shutil.which(p) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (.ci/run installs them; see the README)")
    return RedisServer(workdir) if backend == "redis" else MooncakePool(workdir, segment="256MB")


@pytest.fixture(scope="module", params=["redis", "mooncake"])
def pool(request, tmp_path_factory):
    with _pool(request.param, tmp_path_factory.mktemp(f"pool-{request.param}")) as started:
        yield request.param, started


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    for server in started_server(tmp_path_factory.mktemp("oracle"), mode="recompute"):
        yield Oracle(server)




@pytest.fixture(scope="module")
def nodes(pool, tmp_path_factory):
    backend, started = pool
    yield from started_pool_nodes([tmp_path_factory.mktemp(f"{backend}-node-{name}") for name in ("a", "b")],
                                  started.url)


def test_a_prefix_computed_on_node_a_is_a_hit_on_node_b(nodes, oracle, pool):
    a, b = nodes
    prompt = distinct_prompt(f"cross-node {pool[0]}")
    first = ask(a, prompt)
    AdminClient(a.base_url).flush()                       # node A's puts are in the pool
    before = AdminClient(b.base_url).metrics()
    second = ask(b, prompt)
    after = AdminClient(b.base_url).metrics()
    assert first["cached"] == 0 and first["text"] == oracle(prompt)
    assert second["cached"] == 5 * BLOCK and second["text"] == first["text"]
    assert (counter(after, "kvgate_cache_hits_total", tier="remote")
            - counter(before, "kvgate_cache_hits_total", tier="remote")) == 5   # served by the pool, not B's disk
    assert counter(after, "kvgate_cache_corrupt_blocks_total") == 0


WILDCARD = {"0.0.0.0", "::", ""}
# The one exception, for every process that runs a Mooncake transfer engine (a node's store client,
# mooncake_client): its handshake daemon listens on 0.0.0.0 and its TCP data listener on :: (dual stack),
# each on a port from [MC_MIN_RPC_PORT, MC_MAX_RPC_PORT], and no setting binds them elsewhere
# (see the README's shared pool section for the source lines).
MOONCAKE_ENGINE_WILDCARDS = [(socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")]


def _wildcard_listeners(process: psutil.Process) -> tuple[int, list[tuple[int, str, int]]]:
    """(listening sockets in all, those on every interface as (family, address, port))."""
    listening = [c for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    return len(listening), sorted((c.family, c.laddr.ip, c.laddr.port) for c in listening if c.laddr.ip in WILDCARD)


def _runs_a_mooncake_engine(process: psutil.Process, nodes, in_process_client: bool) -> bool:
    if process.pid == os.getpid():
        return in_process_client
    return process.pid in {n.process.pid for n in nodes} or os.path.basename(process.cmdline()[0]) == "mooncake_client"


def _wait_connected(nodes) -> None:
    deadline = time.monotonic() + 60
    for node in nodes:
        while counter(AdminClient(node.base_url).metrics(), "kvgate_cache_remote_available") != 1:
            assert time.monotonic() < deadline, f"no pool connection within 60 s: {AdminClient(node.base_url).health()}"
            time.sleep(0.2)


def test_every_listener_kvgate_starts_is_on_loopback_but_mooncakes_documented_two(nodes, pool):
    backend, started = pool
    _wait_connected(nodes)
    store = open_store(RemoteTierConfig.from_url(started.url))   # the test process is a client too
    try:
        me = psutil.Process()
        processes = [me] + me.children(recursive=True)
        ports = range(int(os.environ.get("MC_MIN_RPC_PORT", 15000)), int(os.environ.get("MC_MAX_RPC_PORT", 17000)) + 1)
        seen, wrong = {}, []
        for process in processes:
            count, wildcard = _wildcard_listeners(process)
            seen[process.pid] = count
            engine = backend == "mooncake" and _runs_a_mooncake_engine(process, nodes, in_process_client=True)
            allowed = MOONCAKE_ENGINE_WILDCARDS if engine else []
            if [(family, ip) for family, ip, _ in wildcard] != allowed or any(p not in ports for *_, p in wildcard):
                wrong.append(f"{process.name()} (pid {process.pid}, {' '.join(process.cmdline()[:4])}): {wildcard}")
    finally:
        store.close()
    assert not wrong, "listening on every interface:\n" + "\n".join(wrong)
    started_pids = [n.process.pid for n in nodes] + [p.pid for p in started.processes]
    assert all(seen.get(pid, 0) > 0 for pid in started_pids)     # every server was seen listening at all


def test_a_value_that_fails_verification_is_refused_removed_and_recomputed(nodes, oracle, pool):
    a, b = nodes
    prompt, other = distinct_prompt(f"pool corruption {pool[0]}"), distinct_prompt(f"pool donor {pool[0]}")
    ask(a, prompt)
    ask(a, other)
    AdminClient(a.base_url).flush()
    keys = [blk["key"] for blk in AdminClient(b.base_url).locate(prompt)]
    donor = [blk["key"] for blk in AdminClient(b.base_url).locate(other)]
    store = open_store(RemoteTierConfig.from_url(pool[1].url))
    fingerprint_dir = _fingerprint_prefix(b)
    value = store.get(fingerprint_dir + donor[2])
    store.remove(fingerprint_dir + keys[2])
    store.put(fingerprint_dir + keys[2], value)            # another block's whole value under this name
    before = AdminClient(b.base_url).metrics()
    answer = ask(b, prompt)
    after = AdminClient(b.base_url).metrics()
    assert answer["text"] == oracle(prompt) and answer["cached"] == 2 * BLOCK
    assert (counter(after, "kvgate_cache_corrupt_blocks_total", tier="remote", reason=integrity.WRONG_KEY)
            - counter(before, "kvgate_cache_corrupt_blocks_total", tier="remote", reason=integrity.WRONG_KEY)) == 1
    replaced = store.get(fingerprint_dir + keys[2])           # removed, and the recomputed block put whole
    store.close()
    assert replaced is not None and replaced != value
    assert replaced[:integrity.HEADER_BYTES].find(bytes.fromhex(keys[2])) > 0


def test_a_value_the_pool_evicted_is_a_miss_and_the_prefix_ends_before_it(nodes, oracle, pool):
    a, b = nodes
    prompt = distinct_prompt(f"pool eviction {pool[0]}")
    ask(a, prompt)
    AdminClient(a.base_url).flush()
    keys = [blk["key"] for blk in AdminClient(b.base_url).locate(prompt)]
    store = open_store(RemoteTierConfig.from_url(pool[1].url))
    store.remove(_fingerprint_prefix(b) + keys[3])            # as the store's own eviction would
    store.close()
    answer = ask(b, prompt)
    assert answer["text"] == oracle(prompt) and answer["cached"] == 3 * BLOCK


def _fingerprint_prefix(node) -> str:
    health = AdminClient(node.base_url).health()
    return f"kvgate/{health['fingerprint']}/"


@pytest.mark.parametrize("backend", ["redis", "mooncake"])
def test_the_pool_going_away_is_a_counted_miss_and_it_comes_back_by_itself(tmp_path, oracle, backend):
    pool = _pool(backend, tmp_path / "pool").start()
    remote = {**RemoteTierConfig.from_url(pool.url).model_dump(exclude_defaults=True), "retry_s": 1.0,
              "timeout_s": 1.0}
    node = ServerProcess(tmp_path / "node", admin=True, engine={"preset": "tiny", "cache": {"remote": remote}})
    try:
        node.wait_healthy()
        admin = AdminClient(node.base_url)
        pool.stop()
        prompt = distinct_prompt(f"pool away {backend}")
        away = ask(node, prompt)                           # no error: the pool's blocks are just misses
        samples = admin.metrics()
        assert away["text"] == oracle(prompt)
        assert counter(samples, "kvgate_cache_remote_available") == 0
        assert counter(samples, "kvgate_cache_remote_unavailable_calls_total") > 0
        assert counter(samples, "kvgate_cache_write_errors_total", tier="remote") > 0
        pool.start()                                       # back, empty, on the same ports
        deadline = time.monotonic() + 60                   # the node reconnects by itself, with no request
        while counter(admin.metrics(), "kvgate_cache_remote_available") != 1:
            assert time.monotonic() < deadline, f"no reconnection within 60 s: {admin.health()['remote']}"
            time.sleep(0.5)
        back = distinct_prompt(f"pool back {backend}")
        ask(node, back)
        admin.flush()
        for reader in started_server(tmp_path / "reader", admin=True, extra_args=("--remote", pool.url)):
            again = ask(reader, back)                      # what the node put after the pool came back
            assert again["text"] == oracle(back) and again["cached"] == 5 * BLOCK
    finally:
        node.stop()
        pool.stop()


def test_on_a_shared_disk_directory_node_b_loads_what_node_a_wrote(tmp_path, oracle):
    """Two nodes on one directory, as on an NVMe-oF array: B finds A's block files on a miss."""
    shared = tmp_path / "array"
    engine = {"preset": "tiny", "cache": {"disk": {"path": str(shared), "shared": True}}}
    a, b = (ServerProcess(tmp_path / name, admin=True, cache_dir=shared, engine=engine) for name in ("a", "b"))
    try:
        a.wait_healthy()
        b.wait_healthy()
        prompt = distinct_prompt("shared array")
        first = ask(a, prompt)
        AdminClient(a.base_url).flush()
        before = AdminClient(b.base_url).metrics()
        second = ask(b, prompt)
        after = AdminClient(b.base_url).metrics()
    finally:
        a.stop()
        b.stop()
    assert first["cached"] == 0 and second["cached"] == 5 * BLOCK
    assert second["text"] == first["text"] == oracle(prompt)
    assert (counter(after, "kvgate_cache_hits_total", tier="disk")
            - counter(before, "kvgate_cache_hits_total", tier="disk")) == 5
