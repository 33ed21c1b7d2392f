"""The pre-flight: a dead, misconfigured or refusing target fails in seconds, naming role, URL and what happened."""

import json
import subprocess
import sys

import pytest
import yaml

from gates.preflight import check_node, failure_message, run_preflight
from gates.targets import Endpoint
from tests.servers import REPO, TINY_MODEL, free_port, started_server


def test_a_closed_port_fails_at_once_naming_the_role_the_url_and_connection_refused():
    url = f"http://127.0.0.1:{free_port()}/v1"
    results = run_preflight({"baseline": Endpoint("baseline", url, "m")})
    assert [(r.ok, r.error_type) for r in results] == [(False, "connection_refused")]
    assert failure_message(results) == f"pre-flight failed: baseline {url}: connection refused"


def test_a_server_serving_another_model_fails_with_the_models_it_serves(answering):
    url = answering(["llama-3-8b", "qwen-7b"])
    result = check_node("candidate", url, Endpoint("candidate", url, "kvgate-tiny"))
    assert not result.ok and result.served == ["llama-3-8b", "qwen-7b"] and result.error_type == ""
    assert result.line() == f"candidate {url}: model 'kvgate-tiny' not served (serves: llama-3-8b, qwen-7b)"


def test_a_server_answering_400_to_every_request_fails_with_the_status_code_and_message(answering):
    error = {"error": {"message": "the prompt has 9000 tokens; the maximum is 8192", "type": "invalid_request_error",
                       "code": "context_length_exceeded"}}
    url = answering(["m"], status=400, body=json.dumps(error).encode())
    result = check_node("baseline", url, Endpoint("baseline", url, "m"))
    assert not result.ok and result.error_type == "http_400"
    assert result.problem == ("HTTP 400 context_length_exceeded: the prompt has 9000 tokens; the maximum is 8192")


def test_every_node_of_a_role_is_checked_and_only_the_dead_one_fails(answering):
    alive, dead = answering(["m"], status=400, body=b"{}"), f"http://127.0.0.1:{free_port()}/v1"
    results = run_preflight({"candidate": Endpoint("candidate", alive, "m", nodes=(alive, dead))})
    assert [(r.role, r.url) for r in results] == [("candidate node 0", alive), ("candidate node 1", dead)]
    assert results[1].problem == "connection refused"


@pytest.fixture
def embedded(tmp_path):
    yield from started_server(tmp_path, preset="tiny")


def test_a_healthy_embedded_server_passes_with_its_first_token(embedded):
    url = f"{embedded.base_url}/v1"
    results = run_preflight({"candidate": Endpoint("candidate", url, TINY_MODEL)})
    assert [r.ok for r in results] == [True], results[0].problem
    assert results[0].served == [TINY_MODEL] and results[0].ttft_s > 0
    assert failure_message(results) == ""
    # no tokenizer configured: the line and the report say the prompts were sized in words
    assert results[0].line().endswith("(prompts sized: in words, an approximation (targets.<role>.tokenizer not "
                                      "given))")


def test_kvgate_run_g3_against_dead_external_urls_exits_2_naming_each_target(tmp_path):
    baseline, candidate = (f"http://127.0.0.1:{free_port()}/v1" for _ in range(2))
    config = {"targets": {"kind": "external", "baseline": {"url": baseline, "model": "m"},
                          "candidate": {"url": candidate, "model": "m"}},
              "storage": {"path": str(tmp_path / "storage")}}
    (tmp_path / "gates.yaml").write_text(yaml.safe_dump(config))
    run = subprocess.run([sys.executable, "-m", "gates.cli", "run", "g3", "--config", str(tmp_path / "gates.yaml"),
                          "--out", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert (f"kvgate run: pre-flight failed: baseline {baseline}: connection refused; "
            f"candidate {candidate}: connection refused") in run.stderr
    assert not (tmp_path / "run" / "gates" / "g3" / "raw").exists()          # no sweep was started
    preflight = json.loads((tmp_path / "run" / "preflight.json").read_text())
    assert [(r["role"], r["ok"], r["problem"]) for r in preflight] == [
        ("baseline", False, "connection refused"), ("candidate", False, "connection refused")]
    status = json.loads((tmp_path / "run" / "gates" / "g3" / "status.json").read_text())
    assert status["status"] == "not run" and status["reason"].startswith("pre-flight failed: baseline")


def test_g2_contexts_longer_than_the_models_max_model_len_fail_the_pre_flight_naming_the_limit(answering):
    url = answering(["m"], max_model_len=4096)
    result = check_node("candidate", url, Endpoint("candidate", url, "m"), contexts=[1024, 8192])
    assert not result.ok and result.max_model_len == 4096
    assert result.line() == (f"candidate {url}: g2.contexts: expected context lengths the model serves (m by its "
                             "max_model_len at GET /models: 4096 tokens, less the 1 token each G2 request generates: "
                             "at most 4095), found 8192")
    # G2 not run (no contexts), or a listing without max_model_len: nothing to judge, the probe goes on
    assert "g2.contexts" not in check_node("candidate", url, Endpoint("candidate", url, "m")).problem
    unlisted = answering(["m"])
    assert "g2.contexts" not in check_node("candidate", unlisted, Endpoint("candidate", unlisted, "m"),
                                           contexts=[8192]).problem


def test_kvgate_run_g2_against_a_model_shorter_than_its_contexts_exits_2_before_the_gate(tmp_path, answering):
    url = answering(["m"], max_model_len=4096)
    config = {"targets": {"kind": "external", "baseline": {"url": url, "model": "m"},
                          "candidate": {"url": url, "model": "m"}},
              "g2": {"contexts": [1024, 8192]}, "storage": {"path": str(tmp_path / "storage")}}
    (tmp_path / "gates.yaml").write_text(yaml.safe_dump(config))
    run = subprocess.run([sys.executable, "-m", "gates.cli", "run", "g2", "--config", str(tmp_path / "gates.yaml"),
                          "--out", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stdout + run.stderr
    assert (f"kvgate run: pre-flight failed: baseline {url}: g2.contexts: expected context lengths the model serves "
            "(m by its max_model_len at GET /models: 4096 tokens, less the 1 token each G2 request generates: at most "
            "4095), found 8192") in run.stderr
    assert not (tmp_path / "run" / "gates" / "g2" / "raw").exists()
