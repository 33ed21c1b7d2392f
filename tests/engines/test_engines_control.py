"""Each engine's cache-control calls, checked against a small recording HTTP server on 127.0.0.1 (method, path,
body, headers), their failures, a local disk tier's page-cache drop, and what is reported unavailable and why."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cache_impl.server.auth import ADMIN_TOKEN_HEADER
from engines import Control, ControlError, EngineSpec, Unavailable, build_adapter, parse_metrics
from engines import kvgate as kvgate_engine
from engines.steps import CommandStep, DropLocalPages, HttpStep

DATA = Path(__file__).resolve().parents[1] / "data" / "metrics"


class Recorder:
    """An HTTP server that records every request and answers from a table {(method, path): (status, body)}."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.answers: dict[tuple[str, str], tuple[int, str]] = {}
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                recorder.calls.append({"method": self.command, "path": self.path,
                                       "body": json.loads(raw) if raw else None, "headers": dict(self.headers)})
                status, body = recorder.answers.get((self.command, self.path.split("?")[0]), (200, "{}"))
                payload = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.root = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def seen(self) -> list[tuple[str, str, object]]:
        return [(call["method"], call["path"], call["body"]) for call in self.calls]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorder():
    server = Recorder()
    yield server
    server.close()


def adapter(engine: str, root: str, **fields):
    return build_adapter(EngineSpec(engine, root, **fields))


# -- vLLM ------------------------------------------------------------------------------------------------


def test_vllm_resets_the_prefix_cache_and_with_reset_external_the_offloaded_one(recorder):
    recorder.answers[("POST", "/reset_prefix_cache")] = (200, '{"success": true}')
    vllm = adapter("vllm", recorder.root, api_key="sk-test")
    done = vllm.clear_device_cache()
    vllm.clear_lower_tiers()
    assert recorder.seen() == [("POST", "/reset_prefix_cache", None),
                               ("POST", "/reset_prefix_cache?reset_external=true", None)]
    assert recorder.calls[0]["headers"]["Authorization"] == "Bearer sk-test"
    assert done.answer == {"success": True}
    abilities = vllm.abilities()
    assert abilities["clear_device_cache"].clears == ("device",)
    assert abilities["clear_lower_tiers"].clears == ("device", "host")


def test_vllm_refusing_the_reset_is_a_failure_not_a_flush(recorder):
    recorder.answers[("POST", "/reset_prefix_cache")] = (200, '{"success": false}')
    with pytest.raises(ControlError, match="vllm: clear_device_cache: POST .*/reset_prefix_cache: vLLM refused the "
                                           "reset \\(success: false\\)"):
        adapter("vllm", recorder.root).clear_device_cache()


def test_vllm_without_its_dev_routes_says_how_to_enable_them(recorder):
    recorder.answers[("POST", "/reset_prefix_cache")] = (404, '{"detail": "Not Found"}')
    with pytest.raises(ControlError, match="HTTP 404 \\(vLLM serves /reset_prefix_cache only when started with "
                                           "VLLM_SERVER_DEV_MODE=1\\)"):
        adapter("vllm", recorder.root).clear_device_cache()


def test_probing_finds_what_a_vllm_really_allows(recorder):
    # without VLLM_SERVER_DEV_MODE the reset is a 404; a plain vLLM (no offloading, no connector) has no host
    # tier, so reset_external's "clears the host" is not applicable: both found by the probe, not claimed
    recorder.answers[("POST", "/reset_prefix_cache")] = (404, '{"detail": "Not Found"}')
    recorder.answers[("GET", "/metrics")] = (200, (DATA / "vllm_cpu_0.32.0_prefix_caching_hit.prom").read_text())
    vllm = adapter("vllm", recorder.root)
    assert vllm.abilities()["clear_device_cache"].available        # claimed by the profile ...
    probed = vllm.probe()
    assert not probed["clear_device_cache"].available  # ... refused by the engine
    assert (
        "HTTP 404" in probed["clear_device_cache"].how and "VLLM_SERVER_DEV_MODE=1" in probed["clear_device_cache"].how
    )
    assert not probed["clear_lower_tiers"].available
    assert probed["clear_lower_tiers"].how.startswith("not applicable: vllm:cache_config_info kv_offloading_size=None")
    assert ("POST", "/reset_prefix_cache?reset_external=true", None) not in recorder.seen()   # never called
    vllm.restrict({name: {"available": a.available, "how": a.how} for name, a in probed.items()})
    with pytest.raises(Unavailable, match="clear_device_cache unavailable: probed: .*HTTP 404"):
        vllm.clear_device_cache()


def test_probing_a_vllm_in_dev_mode_keeps_its_reset(recorder):
    recorder.answers[("POST", "/reset_prefix_cache")] = (200, '{"success": true}')
    recorder.answers[("GET", "/metrics")] = (200, (DATA / "vllm_cpu_0.32.0_prefix_caching_hit.prom").read_text())
    probed = adapter("vllm", recorder.root).probe()
    assert probed["clear_device_cache"].available and ("POST", "/reset_prefix_cache", None) in recorder.seen()


def test_vllm_with_lmcache_clears_lmcaches_host_tier_through_its_internal_api(recorder):
    recorder.answers[("DELETE", "/cache/clear")] = (200, '{"status": "success", "num_removed": 12}')
    vllm = adapter("vllm", "http://127.0.0.1:9", cache_layer="lmcache", cache_layer_url=recorder.root)
    done = vllm.clear_lower_tiers()
    assert recorder.seen() == [("DELETE", "/cache/clear?locations=LocalCPUBackend", None)]
    assert done.answer == {"status": "success", "num_removed": 12}
    assert vllm.engine == "vllm+lmcache" and vllm.ability("clear_lower_tiers").clears == ("host",)


def test_vllm_with_lmcache_failing_to_clear_names_lmcaches_answer(recorder):
    recorder.answers[("DELETE", "/cache/clear")] = (503, '{"error": "LMCache API is unavailable"}')
    vllm = adapter("vllm", "http://127.0.0.1:9", cache_layer="lmcache", cache_layer_url=recorder.root)
    with pytest.raises(ControlError, match="HTTP 503: .*LMCache API is unavailable"):
        vllm.clear_lower_tiers()


def test_vllm_with_lmcache_and_no_api_url_reports_the_host_clear_unavailable():
    vllm = adapter("vllm", "http://127.0.0.1:9", cache_layer="lmcache")
    ability = vllm.ability("clear_lower_tiers")
    assert not ability.available and "set cache_layer_url to LMCache's internal API server" in ability.how
    with pytest.raises(Unavailable, match="vllm\\+lmcache: clear_lower_tiers unavailable: vllm\\+lmcache: set "
                                          "cache_layer_url"):
        vllm.clear_lower_tiers()


# -- SGLang ----------------------------------------------------------------------------------------------


def test_sglang_flushes_and_clears_hicache_storage(recorder):
    recorder.answers[("POST", "/flush_cache")] = (200, "Cache flushed.\n")
    sglang = adapter("sglang", recorder.root, cache_layer="hicache")
    assert sglang.clear_device_cache().answer.startswith("Cache flushed.")
    sglang.clear_lower_tiers()
    assert recorder.seen() == [("POST", "/flush_cache", None), ("POST", "/hicache/storage-backend/clear", None)]
    # HiCache's reset empties its host pool with the radix tree: the flush clears both tiers
    assert sglang.ability("clear_device_cache").clears == ("device", "host")
    assert sglang.ability("clear_lower_tiers").clears == ("disk",)


def test_sglang_refusing_to_flush_while_busy_is_a_failure(recorder):
    recorder.answers[("POST", "/flush_cache")] = (400, "Cache not flushed because there are pending requests.")
    with pytest.raises(ControlError, match="HTTP 400 \\(SGLang flushes only when no request runs or waits\\): Cache "
                                           "not flushed"):
        adapter("sglang", recorder.root).clear_device_cache()


def test_sglang_without_hicache_has_no_lower_tier_to_clear(recorder):
    sglang = adapter("sglang", recorder.root)
    assert sglang.ability("clear_device_cache").clears == ("device",)
    with pytest.raises(Unavailable, match="sglang without HiCache keeps no tier below the device"):
        sglang.clear_lower_tiers()
    assert recorder.calls == []


# -- kvgate ----------------------------------------------------------------------------------------------


def test_kvgate_publishes_queued_writes_then_evicts_through_its_admin_routes(recorder):
    kvgate = kvgate_engine.build(EngineSpec("kvgate", recorder.root), admin_token="t" * 20)
    kvgate.clear_device_cache()
    kvgate.clear_lower_tiers()
    kvgate.drop_disk_page_cache()
    assert recorder.seen() == [("POST", "/admin/cache/flush", {}),
                               ("POST", "/admin/cache/evict", {"tiers": ["device"]}),
                               ("POST", "/admin/cache/flush", {}),
                               ("POST", "/admin/cache/evict", {"tiers": ["host"]}),
                               ("POST", "/admin/cache/drop-page-cache", {})]
    assert all(call["headers"][ADMIN_TOKEN_HEADER] == "t" * 20 for call in recorder.calls)


def test_kvgate_without_the_admin_token_reports_its_controls_unavailable(recorder, monkeypatch):
    monkeypatch.delenv("KVGATE_ADMIN_TOKEN", raising=False)
    kvgate = adapter("kvgate", recorder.root)
    for name in ("clear_device_cache", "clear_lower_tiers", "drop_disk_page_cache"):
        ability = kvgate.ability(name)
        assert not ability.available and "admin token in $KVGATE_ADMIN_TOKEN" in ability.how
    with pytest.raises(Unavailable, match="kvgate: clear_device_cache unavailable"):
        kvgate.clear_device_cache()
    assert recorder.calls == []


# -- generic and configured steps --------------------------------------------------------------------------


def test_generic_engines_have_nothing_until_configured(recorder):
    generic = adapter("generic", recorder.root)
    abilities = generic.abilities()
    assert not any(ability.available for ability in abilities.values())
    assert abilities["clear_device_cache"].how.startswith("generic: set control.clear_device_cache")
    assert abilities["tier_accounting"].how.startswith("generic: set metric_map")
    with pytest.raises(Unavailable, match="generic: tier_accounting unavailable"):
        generic.tier_hits(None, None)
    assert recorder.calls == []


def test_configured_http_and_command_steps_run_as_given(recorder, tmp_path):
    marker = tmp_path / "cleared"
    control = {"clear_device_cache": Control(HttpStep("PUT", f"{recorder.root}/cache/reset", {"scope": "gpu"}),
                                             ("device",)),
               "clear_lower_tiers": Control(CommandStep(f"echo dram > {marker}"), ("host",))}
    generic = adapter("generic", recorder.root, control=control)
    generic.clear_device_cache()
    done = generic.clear_lower_tiers()
    assert recorder.seen() == [("PUT", "/cache/reset", {"scope": "gpu"})]
    assert marker.read_text() == "dram\n" and done.action == f"command: echo dram > {marker}"


def test_a_failing_command_names_its_exit_code_and_what_it_said():
    step = CommandStep("echo 'no such tier' >&2; exit 3")
    generic = adapter("generic", "http://127.0.0.1:9", control={"clear_lower_tiers": Control(step, ("host",))})
    with pytest.raises(ControlError, match="generic: clear_lower_tiers: command: .*: exit 3: no such tier"):
        generic.clear_lower_tiers()


def test_a_control_call_nobody_answers_is_a_failure_naming_the_call():
    unreachable = Recorder()
    root = unreachable.root
    unreachable.close()
    with pytest.raises(ControlError, match=f"sglang: clear_device_cache: POST {root}/flush_cache: no answer"):
        adapter("sglang", root).clear_device_cache()


def test_a_configured_step_replaces_the_engines_own(recorder):
    step = CommandStep("true")
    vllm = adapter("vllm", recorder.root, control={"clear_device_cache": Control(step, ("device",))})
    vllm.clear_device_cache()
    assert recorder.calls == [] and vllm.ability("clear_device_cache").how == "command: true"


# -- the page cache of a local disk tier -------------------------------------------------------------------


def _resident_pages(path: Path) -> int:
    done = subprocess.run(["fincore", "--noheadings", "--raw", "--output", "PAGES", str(path)], capture_output=True,
                          text=True, check=True)
    return int(done.stdout.split()[0])


@pytest.mark.skipif(shutil.which("fincore") is None, reason="fincore (util-linux) reads page-cache residency")
def test_a_local_cache_dir_has_every_files_pages_dropped(tmp_path):
    cache_dir = tmp_path / "lmcache"
    (cache_dir / "chunks").mkdir(parents=True)
    files = [cache_dir / "a.kv", cache_dir / "chunks" / "b.kv"]
    for path in files:
        path.write_bytes(b"\x5a" * (1 << 20))
        path.read_bytes()                       # in the page cache now
    assert all(_resident_pages(path) > 0 for path in files)
    vllm = adapter("vllm", "http://127.0.0.1:9", cache_dir=cache_dir)
    done = vllm.drop_disk_page_cache()
    assert done.answer == {"files": 2}
    assert [_resident_pages(path) for path in files] == [0, 0]
    assert vllm.ability("drop_disk_page_cache").how == f"fadvise(DONTNEED) every file under {cache_dir}"


def test_a_cache_dir_that_is_not_on_this_host_is_a_failure(tmp_path):
    with pytest.raises(ControlError, match="is not a directory on this host"):
        DropLocalPages(tmp_path / "absent").run()


def test_without_cache_dir_or_a_command_the_page_cache_drop_is_unavailable():
    sglang = adapter("sglang", "http://127.0.0.1:9")
    ability = sglang.ability("drop_disk_page_cache")
    assert not ability.available and "set cache_dir" in ability.how and "control.drop_disk_page_cache" in ability.how


# -- the metrics page ---------------------------------------------------------------------------------------


def test_the_metrics_page_is_read_from_the_default_url_and_attributed(recorder):
    vllm = adapter("vllm", recorder.root, api_key="sk-test")
    recorder.answers[("GET", "/metrics")] = (200, (DATA / "vllm_0.33.0_offload_before.prom").read_text())
    before = vllm.scrape()
    recorder.answers[("GET", "/metrics")] = (200, (DATA / "vllm_0.33.0_offload_after.prom").read_text())
    after = vllm.scrape()
    assert [call["path"] for call in recorder.calls] == ["/metrics", "/metrics"]
    assert recorder.calls[0]["headers"]["Authorization"] == "Bearer sk-test"
    assert vllm.tier_hits(before, after).tiers["host"] == 2048
    assert vllm.device_kv_tokens(after).tokens == 435776


def test_a_metrics_page_that_fails_is_an_error(recorder):
    from engines import MetricsError

    recorder.answers[("GET", "/metrics")] = (500, "boom")
    with pytest.raises(MetricsError, match="GET .*/metrics: HTTP 500: boom"):
        adapter("sglang", recorder.root).scrape()


def test_placement_by_pressure_reads_the_device_capacity_from_one_metrics_page(recorder, tmp_path):
    from engines.placement import plan_placement

    recorder.answers[("GET", "/metrics")] = (200, (DATA / "vllm_0.33.0_lmcache_0.5.6_after.prom").read_text())
    vllm = adapter("vllm", recorder.root, cache_layer="lmcache", host_kv_tokens=1_000_000, cache_dir=tmp_path)
    placement = plan_placement(vllm, "disk", max_filler_tokens=32768, block_size=16)
    # no route (LMCache's host tier has no clear without cache_layer_url): by pressure past device 27236 x 16 =
    # 435776 (the page) + host 1000000 (configured) = 1435776; x 1.25 = 1794720 -> ceil(1794720 / 32768) = 55
    assert placement.route is None and "set cache_layer_url" in placement.why_not_route
    assert (placement.pressure.capacity_tokens, placement.pressure.fillers) == (1435776, 55)
    assert placement.cold                                    # cache_dir: the page cache is dropped after
    assert recorder.seen() == [("GET", "/metrics", None)]


# -- reading a target's hits per tier over its nodes ------------------------------------------------------

def test_an_external_two_node_candidates_hits_are_summed_over_each_nodes_own_metrics(tmp_path):
    import yaml

    from engines import endpoint_adapter, hit_reader
    from gates.config import load_config
    from gates.targets import external_endpoints

    nodes = [Recorder(), Recorder()]
    try:
        # two real pages kvgate serve wrote: one node served 5 blocks from host; the other 5 from host, 5 from disk
        for node, page in zip(nodes, ("kvgate_tiered_host_hit.prom", "kvgate_tiered_disk_hit.prom")):
            node.answers[("GET", "/metrics")] = (200, (DATA / page).read_text())
        series = {tier: {"metric": "kvgate_cache_hits_total", "labels": {"tier": tier}, "scale": 256}
                  for tier in ("device", "host", "disk")}
        endpoint = {"model": "kvgate-small", "engine": "generic", "metric_map": series}
        path = tmp_path / "gates.yaml"
        path.write_text(yaml.safe_dump({"targets": {
            "kind": "external", "candidate": {**endpoint, "url": f"{nodes[0].root}/v1"},
            "baseline": {**endpoint, "url": f"{nodes[0].root}/v1"}, "candidate_nodes": [f"{nodes[1].root}/v1"]}}))
        config = load_config(path)
        candidate = external_endpoints(config)["candidate"]
        read, unit = hit_reader(candidate, endpoint_adapter(config, candidate), config)
        assert unit == "tokens" and read() == {"device": 0.0, "host": 10 * 256.0, "disk": 5 * 256.0}
        assert [call["path"] for node in nodes for call in node.calls] == ["/metrics", "/metrics"]   # each node once
        nodes[1].answers[("GET", "/metrics")] = (503, "down")
        assert read() is None                      # a node that cannot be read gives no figure, not half of one
    finally:
        for node in nodes:
            node.close()


def test_vllm_with_kvgates_connector_empties_its_host_tier_through_the_sidecar(recorder, monkeypatch):
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "side-token")
    vllm = adapter("vllm", "http://127.0.0.1:9", cache_layer="kvgate", cache_layer_url=recorder.root)
    vllm.clear_lower_tiers()
    vllm.drop_disk_page_cache()
    assert recorder.seen() == [("POST", "/admin/cache/flush", {}), ("POST", "/admin/cache/evict", {"tiers": ["host"]}),
                               ("POST", "/admin/cache/drop-page-cache", {})]
    assert all(call["headers"].get(ADMIN_TOKEN_HEADER) == "side-token" for call in recorder.calls)
    assert vllm.engine == "vllm+kvgate" and vllm.ability("clear_lower_tiers").clears == ("host",)
    assert vllm.ability("clear_device_cache").available                  # vLLM's own /reset_prefix_cache


def test_vllm_with_kvgates_connector_says_what_its_controls_need(monkeypatch):
    monkeypatch.delenv("KVGATE_ADMIN_TOKEN", raising=False)
    no_url = adapter("vllm", "http://127.0.0.1:9", cache_layer="kvgate")
    assert "set cache_layer_url to the connector's sidecar" in no_url.ability("clear_lower_tiers").how
    no_token = adapter("vllm", "http://127.0.0.1:9", cache_layer="kvgate", cache_layer_url="http://127.0.0.1:9")
    assert "$KVGATE_ADMIN_TOKEN" in no_token.ability("drop_disk_page_cache").how


def test_the_tiers_kvgates_connector_lacks_come_from_its_sidecars_metrics(recorder):
    recorder.answers[("GET", "/metrics")] = (200, 'kvgate_cache_capacity_bytes{tier="host"} 1024\n'
                                                  'kvgate_cache_capacity_bytes{tier="disk"} 4096\n')
    vllm = adapter("vllm", recorder.root, cache_layer="kvgate", cache_layer_url=recorder.root)
    lacking = vllm.absent_tiers()
    assert set(lacking) == {"remote"} and "no remote tier" in lacking["remote"]


def test_kvgates_connector_is_the_second_witness_of_vllms_hits_by_tier(recorder):
    recorder.answers[("GET", "/metrics")] = (200, 'kvgate_cache_hits_total{tier="disk"} 3\n'
                                                  'kvgate_connector_loaded_tokens_total{tier="disk"} 384\n')
    witness = adapter("vllm", "http://127.0.0.1:9", cache_layer="kvgate", cache_layer_url=recorder.root).witness
    assert witness.metrics_url == f"{recorder.root}/metrics"
    hits = witness.tier_hits(parse_metrics(""), witness.scrape())
    assert hits.tiers == {"host": 0.0, "disk": 384.0, "remote": 0.0}
    assert adapter("vllm", "http://127.0.0.1:9", cache_layer="kvgate").witness is None
    assert adapter("vllm", "http://127.0.0.1:9").witness is None


def test_kvgates_connector_in_vllm_is_reached_for_cold_reads_and_faults_through_its_sidecar(recorder):
    from engines.vllm import connector_cache_admin

    recorder.answers[("POST", "/tokenize")] = (200, '{"tokens": [1, 2, 3], "count": 3}')
    recorder.answers[("POST", "/reset_prefix_cache")] = (200, '{"success": true}')
    cache = connector_cache_admin(EngineSpec("vllm", recorder.root, cache_layer="kvgate",
                                             cache_layer_url="http://127.0.0.1:9/"), "kvgate-small")
    assert cache.admin.server_root == "http://127.0.0.1:9"
    assert cache.token_ids([{"role": "user", "content": "hi"}]) == [1, 2, 3]
    cache.clear_engine()
    assert recorder.seen() == [
        ("POST", "/tokenize", {"model": "kvgate-small", "messages": [{"role": "user", "content": "hi"}],
                               "add_generation_prompt": True}),
        ("POST", "/reset_prefix_cache?reset_running_requests=true", None)]      # under load: preempts, then resets


def test_a_vllm_without_tokenize_says_what_it_answered(recorder):
    from engines.vllm import connector_cache_admin

    recorder.answers[("POST", "/tokenize")] = (404, '{"detail": "Not Found"}')
    cache = connector_cache_admin(EngineSpec("vllm", recorder.root, cache_layer="kvgate",
                                             cache_layer_url=recorder.root), "m")
    with pytest.raises(ControlError, match=r"/tokenize: HTTP 404: expected \{\"tokens\": \[...\]\}, found"):
        cache.token_ids([])
