"""`kvgate selftest`: the controllable mock server, the controls' configs and the expectation logic.

The whole quick suite (minutes: real gates against real servers) is the `selftest`-marked test at
the end, skipped unless KVGATE_SELFTEST=1.
"""

import http.client
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from gates.cli import main
from gates.config import load_config, profile_defaults
from gates.selftest import CONTROLS, controls_for
from gates.selftest.controls import (
    COMPARED,
    G3_SETTINGS,
    G4_SETTINGS,
    GOOD_COLD_READ,
    NULL_GAIN,
    Server,
    g3_run_seconds,
    gates_yaml,
)
from gates.selftest.expectations import (
    ClaimNotMet,
    MustFail,
    MustNotPass,
    MustPass,
    RefusedAtPreflight,
    format_verdict,
    invalid_steps,
    run_completed,
)
from gates.selftest.runner import ControlResult, ServerStartError, start_server, stop_server
from workloads.loadgen.steady import requests_per_part
from workloads.servers.server_behaviour import Behaviour, parse_every
from workloads.traffic.client import StreamingClient
from workloads.traffic.requests import WorkloadRequest

REQUEST = WorkloadRequest("r", "s", 0, ({"role": "user", "content": "one two three four"},), 4, 8)


# -- the behaviour, as pure functions ---------------------------------------------------------------------------


def test_the_error_schedule_fails_every_nth_request_with_its_status_the_first_divisor_winning():
    behaviour = Behaviour(every=parse_every("3:500,7:400"))
    statuses = {n: behaviour.error_status(n) for n in range(1, 22)}
    assert {n for n, s in statuses.items() if s == 500} == {3, 6, 9, 12, 15, 18, 21}
    assert {n for n, s in statuses.items() if s == 400} == {7, 14}
    assert sum(s is not None for s in statuses.values()) == 9          # 43% of 21


def test_an_error_fraction_fails_that_share_spread_evenly_and_never_the_first_requests():
    behaviour = Behaviour(fraction=0.4, fraction_status=503)
    failed = [n for n in range(1, 101) if behaviour.error_status(n) == 503]
    assert len(failed) == 40
    assert all(behaviour.error_status(n) is None for n in (1, 2))      # the pre-flight's probe is answered
    assert max(b - a for a, b in zip(failed, failed[1:])) <= 3


def test_ttft_drifts_linearly_over_uptime_and_stays_at_its_end_value():
    behaviour = Behaviour(ttft_ms=400, ttft_end_ms=100, drift_s=60)
    assert [round(behaviour.ttft_s(t) * 1e3) for t in (0, 30, 60, 600)] == [400, 250, 100, 100]


def test_a_ttft_of_its_own_above_a_number_in_flight():
    behaviour = Behaviour(ttft_ms=200, fast_above_inflight=2, fast_ttft_ms=50)
    assert [behaviour.ttft_s(0, n) for n in (1, 2, 3)] == [0.2, 0.2, 0.05]


def test_usage_can_miscount_tokens_and_send_cached_tokens_as_a_string():
    assert Behaviour(usage_token_offset=1).usage(10, 8)["completion_tokens"] == 9
    assert Behaviour(cached_tokens=64).usage(10, 8)["prompt_tokens_details"] == {"cached_tokens": 10}
    assert Behaviour(cached_tokens=4, cached_tokens_as_string=True).usage(10, 8)["prompt_tokens_details"] == {
        "cached_tokens": "4"}
    assert "prompt_tokens_details" not in Behaviour().usage(10, 8)


@pytest.mark.parametrize("fields, named", [({"fraction": 1.0}, "fraction"), ({"drift_s": 5}, "drift_s"),
                                           ({"fast_ttft_ms": 5}, "fast_above_inflight"),
                                           ({"every": ((0, 500),)}, "every"), ({"every": ((3, 200),)}, "every")])
def test_a_behaviour_that_cannot_be_is_refused_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=named):
        Behaviour(**fields)
    with pytest.raises(ValueError, match="N:STATUS"):
        parse_every("3-500")


# -- the mock server over real HTTP -----------------------------------------------------------------------------


@pytest.fixture
def mock(tmp_path):
    """Start a reference server with these flags (through the selftest's own starter); stopped afterwards."""
    started = []

    def start(*flags):
        server = start_server(f"m{len(started)}", Server("mock", ("--model", "mock", "--tokens", "4", *flags)),
                              "quick", tmp_path)
        started.append(server)
        return server

    yield start
    for server in started:
        stop_server(server.process)


def test_the_mock_passes_the_preflight_and_streams_usage_with_cached_tokens(mock):
    from gates.preflight import check_node
    from gates.targets import Endpoint

    server = mock("--ttft-ms", "5", "--itl-ms", "1", "--cached-tokens", "2")
    assert server.model == "mock"
    assert check_node("candidate", server.url, Endpoint("candidate", server.url, "mock")).ok
    record = StreamingClient(server.url, "mock").send(REQUEST)
    assert record.ok and record.completion_tokens == record.content_chunks == 4   # max_tokens 8 > its 4 tokens
    assert record.prompt_tokens == 4 and record.cached_tokens == 2


def test_the_mock_answers_its_error_schedule_over_http(mock):
    server = mock("--ttft-ms", "1", "--itl-ms", "1", "--error-every", "3:500,7:400")
    client = StreamingClient(server.url, "mock")
    records = [client.send(REQUEST) for _ in range(7)]
    assert [r.error_type for r in records] == [None, None, "http_500", None, None, "http_500", "http_400"]
    assert "scheduled error for request 3" in records[2].error_message
    assert records[3].ok                                       # the connection is reused after an error answer


def test_the_mock_sends_a_string_cached_tokens_when_told(mock):
    server = mock("--ttft-ms", "1", "--itl-ms", "1", "--cached-tokens", "3", "--cached-tokens-as-string")
    connection = http.client.HTTPConnection("127.0.0.1", int(server.url.split(":")[2].split("/")[0]), timeout=10)
    connection.request("POST", "/v1/chat/completions", body=json.dumps({"max_tokens": 2, "messages": list(
        REQUEST.messages)}))
    events = [json.loads(line[6:]) for line in connection.getresponse().read().decode().splitlines()
              if line.startswith("data: {")]
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage == [{"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                      "prompt_tokens_details": {"cached_tokens": "3"}}]


def test_the_mock_ttft_drifts_over_its_uptime(mock):
    # a rising drift: each TTFT is at least the drifted value (a sleep never ends early), whatever the machine
    server = mock("--ttft-ms", "10", "--itl-ms", "1", "--ttft-end-ms", "400", "--drift-s", "1")
    client = StreamingClient(server.url, "mock")
    time.sleep(1.2)
    assert client.send(REQUEST).ttft_s >= 0.4


def test_a_server_that_does_not_start_says_so_with_its_last_words(tmp_path):
    with pytest.raises(ServerStartError, match=r"server bad exited \(2\) before it listed a model: .*fraction: "
                                                r"expected a share in \[0, 1\), found 2.0"):
        start_server("bad", Server("mock", ("--error-fraction", "2")), "quick", tmp_path)


# -- the controls' configs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("control", CONTROLS, ids=lambda c: c.key)
@pytest.mark.parametrize("profile", ["quick", "full"])
def test_every_controls_gates_yaml_is_a_valid_config(control, profile, tmp_path):
    names = list(control.servers)
    config = gates_yaml(control, profile, str(tmp_path / "storage"),
                        {n: f"http://127.0.0.1:{9000 + i}/v1" for i, n in enumerate(names)},
                        {n: "mock" for n in names}, {n: None for n in names})
    (tmp_path / "gates.yaml").write_text(yaml.safe_dump(config))
    loaded = load_config(tmp_path / "gates.yaml")
    assert loaded.profile == (control.profile or profile)
    if control.embedded is not None and "g3" in control.gates:   # the embedded default through G3, as a run makes it
        own = profile_defaults(control.profile)["g3"]
        assert loaded.targets.kind == "embedded" and loaded.g3.prime and not loaded.g3.no_reuse.enabled
        assert (loaded.g3.levels, loaded.g3.duration_s, loaded.g3.blocks.min, loaded.g3.blocks.max) == (
            own["levels"], own["duration_s"], own["blocks"]["min"], own["blocks"]["max"])
        assert loaded.g3.workload.model_dump(exclude_none=True, exclude_defaults=True) == own["workload"]
    elif control.embedded is None:
        assert loaded.targets.kind == "external"
        assert {loaded.targets.baseline.url, loaded.targets.candidate.url} == {
            config["targets"][role]["url"] for role in ("baseline", "candidate")}
        if "g3" in control.gates:
            assert loaded.g3.levels == G3_SETTINGS[profile]["levels"] and not loaded.g3.no_reuse.enabled
            assert loaded.g3.blocks.max == (control.g3 or G3_SETTINGS[profile])["blocks"]["max"]
        if "g4" in control.gates:
            assert loaded.g4.duration_s == G4_SETTINGS[profile]["duration_s"] and not loaded.g4.faults
    else:
        assert loaded.targets.kind == "embedded" and not loaded.g2.no_reuse.enabled
        if control.g2 is None:           # the cold read alone
            assert not (loaded.g2.model_load.enabled or loaded.g2.checkpoint.enabled)
        else:                            # kvgate's loader (and writer): what the control judges
            assert loaded.g2.model_load.enabled and loaded.g2.model_load.loaders == ["kvgate"]
            assert loaded.g2.checkpoint.enabled == ("checkpoint_write_vs_storage_best" in
                                                    " ".join(e.describe() for e in control.expectations))
            # the same small weights and training state under both profiles (--full once took the full profile's
            # 8 ranks of 32B parameters and found no room)
            assert loaded.g2.model_load.size == "512MiB"
            if loaded.g2.checkpoint.enabled:
                assert (loaded.g2.checkpoint.ranks, loaded.g2.checkpoint.parameters) == (2, 20_000_000)


def test_an_aa_control_points_both_roles_at_one_server_and_a_drift_spans_the_g3_run():
    by_key = {c.key: c for c in CONTROLS}
    assert set(by_key["a-aa-mock"].roles.values()) == {"server"}
    assert set(by_key["e-drift"].roles.values()) == {"server"} and by_key["e-drift"].servers["server"].drifts
    g3 = G3_SETTINGS["quick"]
    assert g3_run_seconds("quick") > 2 * g3["duration_s"] * len(g3["levels"])


def test_every_known_bad_check_has_a_known_good_control_and_an_aa_must_fail_decided():
    by_key = {c.key: c for c in CONTROLS}
    for key in ("a-aa-mock", "a-aa-serve"):
        assert by_key[key].expectations == NULL_GAIN == tuple(MustFail(m) for m in COMPARED)
    passed = {e.metric for c in CONTROLS for e in c.expectations if isinstance(e, MustPass)}
    bad = {m for c in CONTROLS for e in c.expectations if isinstance(e, (MustNotPass, MustFail))
           for m in (e.metrics if isinstance(e, MustNotPass) else (e.metric,))}
    assert bad <= passed, bad - passed
    assert {"disk_hit_share", "open_fds_growth", "memory_growth_mib"} <= passed
    assert by_key["i-good-loader-writer"].g2["cold_read_pairs"] == GOOD_COLD_READ["cold_read_pairs"]
    assert by_key["k-embedded-tiered"].full_only and by_key["k-embedded-tiered"].prime


@pytest.mark.parametrize("profile", ["quick", "full"])
def test_a_matched_block_of_the_first_level_holds_the_requests_a_valid_block_needs(profile):
    # the first level's part size is set before the baseline's rate is known: 8 requests per user
    g3 = G3_SETTINGS[profile]
    served = requests_per_part(SimpleNamespace(requests=[None] * 32), g3["levels"][0], None, g3["duration_s"])
    assert served >= g3["min_requests"], (served, g3["min_requests"])


def test_quick_runs_every_control_but_the_full_only_ones_and_a_named_one_alone():
    quick = {c.key for c in controls_for(full=False)}
    assert quick == {"a-aa-mock", "b-serial-read", "c-failing", "d-invalid-only", "e-drift", "f-known-good", "h-leak",
                     "i-good-loader-writer", "j-serial-loader", "l-stable", "m-capacity-aa", "n-capacity-double"}
    assert {c.key for c in controls_for(full=True)} == {c.key for c in CONTROLS}
    assert [c.key for c in controls_for(False, ("e-drift",))] == ["e-drift"]
    assert main(["selftest", "--control", "no-such-control"]) == 2


def test_a_control_named_twice_or_an_out_that_cannot_be_a_directory_is_exit_2_before_any_control_runs(tmp_path,
                                                                                                    capsys):
    assert main(["selftest", "--control", "a-aa-mock", "--control", "a-aa-mock", "--out", str(tmp_path / "s")]) == 2
    assert "--control: expected each control once, found a-aa-mock repeated" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    for out, found in ((tmp_path / "file", "found an existing file"), (tmp_path / "file" / "under", "on its way"),
                       (Path("/proc/kvgate-selftest"), "does not take new files")):
        assert main(["selftest", "--control", "a-aa-mock", "--out", str(out)]) == 2
        error = capsys.readouterr().err
        assert error.startswith("kvgate selftest: --out: expected a directory for the controls' runs") or \
            "--out: expected a writable directory" in error, error
        assert found in error and (str(out) in error or str(out.parent) in error)     # the path, or what blocks it
    assert not (tmp_path / "s").exists()                         # nothing was run, nothing was written


def test_a_relative_out_is_the_same_directory_for_every_control_wherever_its_run_starts(tmp_path, monkeypatch):
    import gates.selftest.runner as runner

    given = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner, "run_control", lambda control, profile, out: given.append(out) or
                        runner.ControlResult(control.key, "", [], 0))
    runner.run_selftest(controls_for(False, ("e-drift", "h-leak")), "quick", Path("relative/out"))
    assert given == [tmp_path / "relative" / "out"] * 2 and (tmp_path / "relative" / "out" / "selftest.json").exists()


# -- the expectation logic: verdicts -> OK / WRONG --------------------------------------------------------------


def _verdict(metric, status, value=0.3, interval=(0.2, 0.4), level=2):
    return {"gate": "g3", "metric": metric, "status": status, "value": value, "interval": list(interval),
            "unit": "%", "context": {"concurrency": level}}


def _results(*verdicts, claims=()):
    return {"gates": [{"gate": "g3", "verdicts": list(verdicts)}], "claims": list(claims)}


def test_must_not_pass_is_wrong_on_any_pass_and_ok_on_fail_or_inconclusive():
    rule = MustNotPass(("ttft_p50_reduction", "throughput_gain"))
    ok = rule.check(_results(_verdict("ttft_p50_reduction", "FAIL"), _verdict("throughput_gain", "INCONCLUSIVE")))
    assert ok.ok and len(ok.rows) == 2
    wrong = rule.check(_results(_verdict("ttft_p50_reduction", "FAIL"), _verdict("throughput_gain", "PASS", level=4)))
    assert not wrong.ok and wrong.problem == "1 PASS: throughput_gain c=4"


def test_a_control_without_the_verdict_it_tests_is_wrong_not_ok():
    found = MustNotPass(("ttft_p50_reduction", "throughput_gain")).check(_results(_verdict("ttft_p50_reduction",
                                                                                           "FAIL")))
    assert not found.ok and found.problem.startswith("not judged: throughput_gain")
    assert not MustPass("ttft_p50_reduction").check(_results()).ok
    assert not ClaimNotMet("ttft_p50_reduction").check(_results()).ok


def test_a_renamed_metric_is_read_under_its_former_name_and_the_new_name_wins():
    old = {**_verdict("cold_read_vs_fio", "PASS", value=1.5), "gate": "g2", "context": {}}
    new = {**_verdict("cold_read_vs_storage_best", "FAIL", value=0.4), "gate": "g2", "context": {}}
    rule = MustNotPass(("cold_read_vs_storage_best",))
    assert rule.check(_results(old)).problem == "1 PASS: cold_read_vs_fio"
    assert rule.check(_results(old, new)).ok


def test_must_pass_needs_every_level_to_pass():
    rule = MustPass("ttft_p50_reduction")
    assert rule.check(_results(_verdict("ttft_p50_reduction", "PASS"),
                               _verdict("ttft_p50_reduction", "PASS", level=4))).ok
    found = rule.check(_results(_verdict("ttft_p50_reduction", "PASS"),
                                _verdict("ttft_p50_reduction", "INCONCLUSIVE", level=4)))
    assert found.problem == "ttft_p50_reduction c=4 INCONCLUSIVE"


def test_must_fail_needs_every_verdict_to_fail_decided():
    rule = MustFail("throughput_gain")
    assert rule.check(_results(_verdict("throughput_gain", "FAIL"), _verdict("throughput_gain", "FAIL", level=4))).ok
    found = rule.check(_results(_verdict("throughput_gain", "FAIL"),
                                _verdict("throughput_gain", "INCONCLUSIVE", level=4)))
    assert found.problem == "throughput_gain c=4 INCONCLUSIVE"             # an undecided A/A is not a FAIL
    assert rule.check(_results(_verdict("throughput_gain", "PASS"))).problem == "throughput_gain c=2 PASS"
    assert rule.check(_results()).problem.startswith("not judged: throughput_gain")


def test_a_refusal_is_expected_at_exit_2_from_the_named_roles_preflight_naming_the_field_with_nothing_judged():
    rule = RefusedAtPreflight("candidate", "bad_response", "usage.prompt_tokens_details.cached_tokens")
    ok_row = {"role": "baseline", "ok": True, "problem": "", "error_type": ""}
    refused = {"role": "candidate", "ok": False, "error_type": "bad_response", "problem": (
        "bad_response: usage.prompt_tokens_details.cached_tokens: expected a count (an integer >= 0), found '2' (str)")}
    found = rule.check({**_results(), "preflight": [ok_row, refused]})
    assert found.ok and found.got() == [f"pre-flight candidate: refused ({refused['problem']})"]
    # refused for another reason, or not at all, or judged anyway: wrong
    other = {**refused, "error_type": "timeout", "problem": "timed out"}
    assert rule.check({**_results(), "preflight": [ok_row, other]}).problem == "not refused: candidate: timed out"
    assert rule.check({**_results(), "preflight": [ok_row]}).problem == "not refused: no pre-flight row of candidate"
    judged_anyway = {**_results(_verdict("ttft_p50_reduction", "FAIL")), "preflight": [refused]}
    assert rule.check(judged_anyway).problem == "1 verdicts after a refusal"
    # the run must end with exit 2 for a refusal control, 0 or 1 for any other
    assert run_completed((rule,), 2) and not run_completed((rule,), 1) and not run_completed((rule,), 0)
    assert run_completed((MustPass("m"),), 1) and not run_completed((MustPass("m"),), 2)


def test_a_claim_that_says_met_is_wrong_and_not_measured_is_ok():
    met = {"id": "ttft_p50_reduction", "verdict": "met", "measured": 0.407, "measured_text": "40.7%"}
    unmeasured = {**met, "verdict": "not measured", "measured": None, "measured_text": ""}
    rule = ClaimNotMet("ttft_p50_reduction")
    assert rule.check(_results(claims=[met])).problem == "claim ttft_p50_reduction says met at 40.7%"
    assert rule.check(_results(claims=[unmeasured])).ok


def test_a_controls_line_says_what_it_got_what_it_should_have_got_and_ok_or_wrong():
    results = _results(_verdict("ttft_p50_reduction", "PASS", 0.312, (0.252, 0.414)))
    finding = MustNotPass(("ttft_p50_reduction",)).check(results)
    line = ControlResult("a-aa-mock", "A/A", [finding]).line()
    assert line == ("a-aa-mock: got ttft_p50_reduction c=2: PASS 31.2% [25.2%, 41.4%] | expected no PASS of "
                    "ttft_p50_reduction | WRONG: 1 PASS: ttft_p50_reduction c=2")
    assert not ControlResult("x", "x", []).ok                            # nothing judged is never OK
    assert format_verdict(_verdict("throughput_gain", "FAIL", -1e-5, (-0.12, 0.14))) == (
        "throughput_gain c=2: FAIL 0.0% [-12.0%, 14.0%]")
    results["gates"][0]["measurements"] = [
        {"metric": "step_valid", "value": True, "context": {"target": "baseline", "concurrency": 2, "reasons": ""}},
        {"metric": "step_valid", "value": False, "context": {"target": "candidate", "concurrency": 2,
                                                             "reasons": "client saturated"}}]
    steps = invalid_steps(results)
    assert steps == [{"step": "candidate c=2", "reasons": "client saturated"}]
    shown = ControlResult("a-aa-mock", "A/A", [finding], invalid_steps=steps).line()
    assert "PASS 31.2% [25.2%, 41.4%] (invalid steps: candidate c=2) | expected" in shown
    crashed = ControlResult("x", "x", [MustPass("m").check(_results(_verdict("m", "PASS")))], exit_code=2,
                            problem="the gate run did not complete (exit 2)")
    assert not crashed.ok and crashed.line().endswith("WRONG: the gate run did not complete (exit 2)")
    gave_nothing = ControlResult("c", "c", [], exit_code=2, problem="the gate run did not complete (exit 2)",
                                 expects=[MustPass("m").describe(), MustFail("n").describe()])
    assert "| expected PASS of m; FAIL of n | WRONG" in gave_nothing.line()       # said, though nothing was judged


# -- the whole quick suite --------------------------------------------------------------------------------------


@pytest.mark.selftest
@pytest.mark.skipif(os.environ.get("KVGATE_SELFTEST") != "1", reason="the quick selftest takes minutes: "
                    "KVGATE_SELFTEST=1 runs it")
def test_the_quick_selftest_runs_every_control_through_the_real_gates_and_each_behaves(tmp_path):
    code = main(["selftest", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "selftest.json").read_text())
    assert [c["control"] for c in summary["controls"]] == [c.key for c in controls_for(full=False)]
    wrong = [f"{c['control']}: {c['problem'] or [e['problem'] for e in c['expectations'] if not e['ok']]}"
             for c in summary["controls"] if not c["ok"]]
    assert not wrong and code == 0, wrong
    assert all(e["rows"] for c in summary["controls"] for e in c["expectations"])   # every control judged something
