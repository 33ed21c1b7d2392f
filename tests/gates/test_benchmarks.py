"""The benchmark commands run the real parts and print figures consistent with their raw data."""

import json
import shutil
import subprocess
import sys

import pytest

from gates.cli import main

needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (Debian package 'fio')")


def _run_json(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "gates.cli", *args, "--json"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
@needs_fio
def test_cache_bench_json_reports_the_headline_ratios_against_the_storages_best_from_its_raw_figures(tmp_path):
    figures = _run_json("cache-bench", "--dir", str(tmp_path), "--prefix-mib", "16", "--rounds", "3",
                        "--read-workers", "2", "--block-mib", "4", "--indexed-blocks", "20000", "--sweep-mib", "32")
    disk, host, lookup = figures["disk"], figures["host"], figures["lookup"]
    assert disk["prefix_bytes"] == 16 * 2**20 and disk["block_bytes"] == 4 * 2**20
    assert disk["best"]["points"] >= 10 and disk["best"]["sweep_gbps"] > 0   # the quick sweep found the best job
    for mode in ("direct", "buffered_cold"):
        d = disk[mode]
        assert len(d["tier_rounds_gbps"]) == len(d["best_rounds_gbps"]) == len(d["fio_same_pattern_rounds_gbps"]) == 3
        ratios = [t / b for t, b in zip(d["tier_rounds_gbps"], d["best_rounds_gbps"])]
        assert d["ratio_rounds"] == pytest.approx(ratios)                     # divided by the best job, round by round
        assert d["ratio"] == pytest.approx((ratios[0] * ratios[1] * ratios[2]) ** (1 / 3))   # their geometric mean
        assert d["interval"][0] <= d["ratio"] <= d["interval"][1]
        by_shape = d["best_rounds_gbps_by_shape"]
        assert set(by_shape) == set(disk["best"]["shapes"]) == {"direct", "buffered"}   # the grid has both modes
        assert d["best_rounds_gbps"] == [max(r) for r in zip(*by_shape.values())]          # the faster, round by round
        for name, shape in disk["best"]["shapes"].items():  # each its mode's winner
            assert (
                f"--bs={shape['bs']}" in d["best_jobs"][name]
                and f"--numjobs={shape['numjobs']}" in d["best_jobs"][name]
            )
            assert ("--direct=1" in d["best_jobs"][name]) == (name == "direct")
    auto = disk["auto"]                                   # io_mode auto's start-up probe on the bench's storage
    assert set(auto["gbps"]) == {"direct", "buffered"} and all(len(g) == 3 for g in auto["gbps"].values())
    faster = max(auto["median_gbps"], key=auto["median_gbps"].get)
    assert auto["chosen"] == {"direct": "direct", "buffered": "buffered_cold"}[faster] and auto["error"] is None
    assert figures["disk_vs_storage_best"] == disk[auto["chosen"]]["ratio"]    # judged: the mode auto reads in
    assert figures["disk_direct_vs_storage_best"] == disk["direct"]["ratio"]
    assert figures["disk_buffered_cold_vs_storage_best"] == disk["buffered_cold"]["ratio"]
    assert figures["targets"]["disk_vs_storage_best"] == ">= 0.9"
    assert host["ratio_rounds"] == pytest.approx([t / m for t, m in zip(host["tier_rounds_gbps"],
                                                                          host["memcpy_rounds_gbps"])])
    assert figures["host_vs_memcpy"] == host["ratio"]
    assert figures["lookup_ms"] == lookup["lookup_ms_median"] > 0
    assert lookup["indexed_blocks"] == 20000 + 128 * 1024 // 256
    assert lookup["index_bytes_per_block"] > 16          # at least the key itself
    assert list(tmp_path.iterdir()) == []                 # the bench cleans up after itself


def test_cache_bench_rejects_bad_arguments_with_exit_code_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["cache-bench", "--rounds", "0"])
    assert exit_info.value.code == 2
    assert "expected a positive integer, found 0" in capsys.readouterr().err


def test_cache_bench_refuses_a_prefix_smaller_than_one_block_with_exit_code_2(tmp_path, capsys):
    assert main(["cache-bench", "--dir", str(tmp_path), "--prefix-mib", "8", "--block-mib", "16"]) == 2
    assert "--prefix-mib: expected at least --block-mib (16), found 8" in capsys.readouterr().err


def test_engine_bench_reports_ttft_of_recompute_host_and_cold_disk_hits(tmp_path):
    figures = _run_json("engine-bench", "--dir", str(tmp_path), "--preset", "tiny", "--contexts", "600,1100",
                        "--rounds", "1")
    assert figures["model"] == "kvgate-tiny"
    short, long = figures["contexts"]
    assert (short["context_tokens"], short["cached_tokens"]) == (600, 512)
    assert (long["context_tokens"], long["cached_tokens"]) == (1100, 1024)
    for c in (short, long):
        for name in ("recompute", "host", "disk_cold"):
            assert c[f"{name}_ttft_ms"] > 0
        assert c["host_speedup"] == pytest.approx(c["recompute_ttft_ms"] / c["host_ttft_ms"])
        assert c["hits_identical_to_recompute"] == 2        # the host hit and the cold disk hit, each compared
    assert figures["disk_speedup_at_longest"] == long["disk_speedup"]
    assert list(tmp_path.iterdir()) == []


def test_engine_bench_stops_when_a_hit_generates_other_tokens_than_the_recompute():
    from cache_impl.engine.generation import FinishEvent, Generation
    from gates.benches.engine_bench import _ttft

    class Engine:
        def generate(self, prompt, max_tokens):
            return Generation(token_ids=[7, 7, 7, 9], finish=FinishEvent("length", 600, 4, 512), ttft_s=0.01)

    assert _ttft(Engine(), [1] * 600, 512, [7, 7, 7, 9], "host hit") == (0.01, [7, 7, 7, 9])
    with pytest.raises(RuntimeError, match=r"a host hit generated \[7, 7, 7, 9\], the recompute \[7, 7, 7, 8\]"):
        _ttft(Engine(), [1] * 600, 512, [7, 7, 7, 8], "host hit")


def test_client_bench_says_when_the_openai_clients_stream_carried_no_text():
    from types import SimpleNamespace

    from gates.benches.client_bench import _openai_ttft

    def chunk(content):
        return SimpleNamespace(choices=[SimpleNamespace(delta=SimpleNamespace(content=content))])

    def client(*contents):
        return SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(
            create=lambda **body: iter([chunk(c) for c in contents]))))

    assert _openai_ttft(client(None, "text", None), {}) > 0
    # once a None that sank into the median beside the other requests' seconds (a TypeError there)
    with pytest.raises(RuntimeError, match="the openai client's stream ended before any text"):
        _openai_ttft(client(None, ""), {})


@pytest.mark.slow
def test_client_bench_compares_our_ttft_with_a_minimal_timer_and_holds_many_streams(tmp_path):
    figures = _run_json("client-bench", "--dir", str(tmp_path), "--streams", "20", "--duration", "5",
                        "--fidelity-requests", "6")
    fidelity, scale = figures["fidelity"], figures["scale"]
    assert fidelity["requests"] == 6 and fidelity["ours_ttft_p50_ms"] > 0 and fidelity["minimal_ttft_p50_ms"] > 0
    assert fidelity["difference_percent"] == pytest.approx(
        (fidelity["ours_ttft_p50_ms"] / fidelity["minimal_ttft_p50_ms"] - 1) * 100)
    assert scale["peak_concurrent_streams"] == 20 and scale["errors"] == 0 and scale["requests"] > 20
    # the reference server answers after 100 ms: nobody can measure less
    assert scale["ttft_p50_ms"] >= 100 and scale["single_stream_ttft_p50_ms"] >= 100
    assert scale["added_ttft_p50_ms"] == pytest.approx(scale["ttft_p50_ms"] - scale["single_stream_ttft_p50_ms"])


@pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("mooncake_master") is None,
                    reason="redis-server or Mooncake Store is not installed (.ci/run installs them)")
def test_pool_bench_measures_both_backends_and_a_cross_node_hit(tmp_path):
    figures = _run_json("pool-bench", "--dir", str(tmp_path), "--prefix-mib", "4", "--rounds", "1",
                        "--context", "1024", "--preset", "tiny")
    assert set(figures["backends"]) == {"redis", "mooncake"}
    for result in figures["backends"].values():
        bandwidth, cross = result["bandwidth"], result["cross_node"]
        assert bandwidth["prefix_bytes"] == 4 * 2**20 and bandwidth["tier_gbps"] > 0 < bandwidth["plain_get_gbps"]
        assert bandwidth["tier_vs_plain"] == pytest.approx(
            bandwidth["plain_rounds_s"][0] / bandwidth["tier_rounds_s"][0]
        )
        assert cross["cached_tokens"] == 1024           # node B reused every block node A computed, from the pool
        assert cross["node_b_speedup"] == pytest.approx(cross["recompute_ttft_ms"] / cross["node_b_ttft_ms"])


@pytest.mark.parametrize("interval, mark", [([0.92, 1.3], "meets target"), ([0.4, 0.85], "BELOW TARGET"),
                                            ([0.5, 1.4], "not decided"), (None, "not decided")])
def test_cache_bench_says_a_disk_figure_meets_its_target_only_when_its_interval_clears_it(interval, mark):
    from gates.benches.cache_bench import _headline

    figures = {"disk_vs_storage_best": 0.95, "disk": {"auto": {"chosen": "direct"}, "direct": {"interval": interval}}}
    assert f"(target >= 0.9: {mark}" in _headline(figures, "disk_vs_storage_best")


@pytest.mark.parametrize("interval, noted", [([1.5, 2.1], True), ([0.95, 1.3], False), (None, False)])
def test_cache_bench_says_when_the_tier_beat_every_fio_job_beside_it(interval, noted):
    from gates.benches.cache_bench import _beyond_the_yardstick

    lines = _beyond_the_yardstick({"interval": interval})
    assert bool(lines) == noted and all("below what this storage can do" in line for line in lines)
