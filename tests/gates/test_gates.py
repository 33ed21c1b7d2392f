"""The gate framework: configuration errors, stop-loss, gate outcomes, `kvgate init`."""

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from cache_impl.cache.config import ConfigError
from gates.cli import main
from gates.config import load_config
from gates.run import GateRunner, gate_status
from gates.template import render_template


def _config_file(tmp_path: Path, data) -> Path:
    path = tmp_path / "gates.yaml"
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    "data, message",
    [
        ({"g2": {"contextz": [1024]}}, "g2.contextz: unknown field"),
        ({"g2": {"contexts": "many"}}, "g2.contexts: expected a list, found 'many'"),
        ({"g2": {"contexts": []}}, "g2.contexts"),
        ({"g2": {"cold_read_pairs": 2}}, "g2.cold_read_pairs.min: expected a value >= 3, found 2"),
        (
            {"g2": {"cold_read_pairs": {"min": 6, "max": 4}}},
            "g2.cold_read_pairs.max: expected at least min (6), found 4",
        ),
        ({"g2": {"model_load": {"rounds": {"budget_s": 0}}}}, "g2.model_load.rounds.budget_s: expected a value > 0"),
        ({"fio": {"sweep": {"iodepths": [4, 4]}}}, "fio.sweep.iodepths: expected each value once, found [4] repeated"),
        ({"fio": {"sweep": {"ioengines": ["posixaio"]}}}, "fio.sweep.ioengines[0]"),
        ({"fio": {"sweep": {"size": "8M"}}}, "fio.sweep.size: expected at least the largest request size"),
        ({"g3": {"levels": [2, "four"]}}, "g3.levels[1]: expected a finite number, found 'four'"),
        (
            {"g1": {"thresholds": [{"metric": "seq_read_gbps", "value": 1}]}},
            "g1.thresholds[0]: expected keys {metric, op, value} (threshold) or {metric, min, max} (band), "
            "found {metric, value}",
        ),
        ({"g1": {"thresholds": [{"metric": "x", "op": "=>", "value": 1}]}}, "g1.thresholds[0].op: expected one of"),
        (
            {"g3": {"thresholds": [{"metric": "throughput_gain", "min": 0.5, "max": 0.3}]}},
            "g3.thresholds[0].max: expected max >= min (0.5), found 0.3",
        ),
        ({"targets": {"kind": "external"}}, "targets: expected baseline and candidate endpoints"),
        (
            {
                "targets": {
                    "kind": "external",
                    "baseline": {"url": "10.0.0.1:8000", "model": "m"},
                    "candidate": {"url": "http://h/v1", "model": "m"},
                }
            },
            "targets.baseline.url",
        ),
        ({"fio": {"iodepth": 0}}, "fio.iodepth: expected a value >= 1, found 0"),
        ({"profile": "medium"}, "profile: expected one of ['full', 'quick'], found 'medium'"),
        ({"g4": {"faults": [{"kind": "meteor", "at_s": 3}]}}, "g4.faults[0].kind: expected one of"),
        ({"g4": {"duration_s": 20}}, "g4: expected every fault's at_s < duration_s (20), found faults[1].at_s"),
        (
            {"g4": {"faults": [{"kind": "slow_disk", "at_s": 3, "delay_ms": 0}]}},
            "g4.faults[0].delay_ms: expected a value > 0.0, found 0",
        ),
        # what the server's /admin/faults would refuse mid-soak is refused at load
        (
            {"g4": {"faults": [{"kind": "read_error", "at_s": 3, "duration_s": 1e9}]}},
            "g4.faults[0].duration_s: expected a value <= 86400.0, found 1000000000.0",
        ),
        (
            {"g4": {"faults": [{"kind": "slow_disk", "at_s": 3, "delay_ms": 600000}]}},
            "g4.faults[0].delay_ms: expected a value <= 60000.0, found 600000",
        ),
        ("- just\n- a list\n", "expected a mapping at the top level, found list"),
        ("g1: [unclosed\n", "expected valid YAML"),
        # a threshold naming a metric its gate does not judge
        (
            {
                "g3": {
                    "thresholds": [
                        {"metric": "ttft_p50_reduction", "op": ">=", "value": -1},
                        {"metric": "throughput_gian", "min": 1, "max": 2},
                    ]
                }
            },
            "g3.thresholds[1].metric: expected one of ttft_p50_reduction, throughput_gain, sustained_rate_gain, "
            "error_rate, disk_hit_share, capacity_gain, no_reuse_ttft_cost, no_reuse_throughput_cost, "
            "found 'throughput_gian'",
        ),
        (
            {
                "g2": {
                    "thresholds": [
                        {"metric": "cold_read_vs_storage_best", "op": ">=", "value": 0.8},
                        {"metric": "cold_read_vs_storage_best", "op": ">=", "value": 0.7},
                    ]
                }
            },
            "g2.thresholds[1].metric: expected each metric once, found 'cold_read_vs_storage_best' again "
            "(first at [0])",
        ),
        (
            {"g1": {"thresholds": [{"metric": "cpu_cores", "op": ">=", "value": 2}]}},
            "g1.thresholds[0].metric: expected one of seq_read_gbps",
        ),
        # values that cannot be meant (1.6)
        (
            {"g3": {"levels": [0, -2]}},
            "g3.levels: expected concurrencies (integers in 1..100,000) for replay: closed_loop, found [0, -2]",
        ),
        ({"g3": {"levels": [True]}}, "g3.levels[0]: expected a finite number, found True"),
        ({"g3": {"duration_s": 1e400}}, "g3.duration_s: expected a finite number, found inf"),
        ({"g3": {"duration_s": 10, "warmup_s": 10}}, "g3.warmup_s: expected less than duration_s (10), found 10"),
        (
            {"g4": {"duration_s": 5, "window_s": 10, "warmup_s": 0, "faults": []}},
            "g4.window_s: expected at most duration_s (5), found 10",
        ),
        ({"g2": {"rounds": 2.0}}, "g2.rounds: expected a whole number or a mapping of min, max, budget_s, found 2.0"),
        # section 2: every field at load, before any server starts
        ({"g3": {"workload": {"kind": "multi_round_qa", "userz": 4}}}, "g3.workload.userz: unknown field"),
        ({"g3": {"workload": {"kind": "nonexistent_kind"}}}, "g3.workload.kind: expected one of"),
        (
            {"targets": {"embedded": {"host_capacity": "1XB"}}},
            "targets.embedded.host_capacity: expected a byte size (integer or string like '4GiB'), found '1XB'",
        ),
        (b"g1: {thresholds: []}\n# caf\xe9\n", "expected a UTF-8 text file, found byte 0xe9 at offset 26"),
        # what a stranger found next: values the servers or the gates would only refuse later
        (
            {"targets": {"embedded": {"host_capacity": "99999TiB"}}},
            "targets.embedded.host_capacity: expected at most this host's memory",
        ),
        ({"targets": {"embedded": {"seed": 10**23}}}, "targets.embedded.seed: expected a value <= 9223372036854775807"),
        ({"fio": {"size": "1XB"}}, "fio.size: expected a byte size"),
        ({"fio": {"verify_size": "0"}}, "fio.verify_size: expected a byte size > 0, found '0'"),
        ({"fio": {"ioengine": "; rm -rf /"}}, "fio.ioengine: expected"),
        ({"storage": {"path": ""}}, "storage.path: expected a directory path, found an empty string"),
        ({"g3": {"levels": [2, 2, 4]}}, "g3.levels: expected each level once, found [2] repeated"),
        ({"g4": {"window_s": 0.001}}, "g4.window_s: expected a value >= 1"),
        (
            {"targets": {"candidate_nodes": ["http://127.0.0.1:9000/v1"]}},
            "targets.candidate_nodes: expected none for kind: embedded",
        ),
        (
            {
                "targets": {
                    "kind": "external",
                    "baseline": {"url": "http://", "model": "m"},
                    "candidate": {"url": "http://h:8000/v1", "model": "m"},
                }
            },
            "targets.baseline.url: expected http(s)://host[:port]/v1 with a host, found 'http://'",
        ),
        (
            {
                "targets": {
                    "kind": "external",
                    "baseline": {"url": "http://127.0.0.1:99999/v1", "model": "m"},
                    "candidate": {"url": "http://h:8000/v1", "model": "m"},
                }
            },
            "targets.baseline.url: expected a port in 1-65535 in the URL",
        ),
        (
            {
                "targets": {
                    "kind": "external",
                    "baseline": {"url": "http://h:1/v1", "model": "m", "api_key_env": "KVGATE_NOPE"},
                    "candidate": {"url": "http://h:8000/v1", "model": "m"},
                }
            },
            "targets.baseline.api_key_env: expected the environment variable 'KVGATE_NOPE' to hold the API key, "
            "found it unset",
        ),
        (
            {
                "targets": {
                    "kind": "external",
                    "baseline": {"url": "http://h:1/v1", "model": "m"},
                    "candidate": {"url": "http://h:8000/v1", "model": "m"},
                },
                "g4": {"faults": [{"kind": "flip_byte", "at_s": 1}]},
            },
            "g4.faults: expected no fault schedule for an external candidate without kvgate's cache",
        ),
        (
            {
                "targets": {
                    "kind": "external",
                    "baseline": {"url": "http://h:1/v1", "model": "m"},
                    "candidate": {"url": "http://h:8000/v1", "model": "m", "engine": "vllm", "cache_layer": "kvgate"},
                },
                "g4": {"faults": [{"kind": "flip_byte", "at_s": 1}]},
            },
            "g4.faults: expected no fault schedule for an external candidate without kvgate's cache",
        ),
        # model load and checkpoint save
        ({"g2": {"model_load": {"loaders": ["safetensor"]}}}, "g2.model_load.loaders[0]: expected one of"),
        (
            {"g2": {"model_load": {"loaders": ["safetensors", "safetensors"]}}},
            "g2.model_load.loaders: expected each loader once, found ['safetensors'] repeated",
        ),
        ({"g2": {"model_load": {"rounds": 2}}}, "g2.model_load.rounds.min: expected a value >= 3, found 2"),
        ({"g2": {"checkpoint": {"rounds": {"min": 2}}}}, "g2.checkpoint.rounds.min: expected a value >= 3, found 2"),
        ({"g2": {"model_load": {"size": "1XB"}}}, "g2.model_load.size: expected a byte size"),
        (
            {"g2": {"model_load": {"launch": "vllm serve m"}}},
            "g2.model_load: launch and health_url: expected both (the start command and the URL that answers "
            "when it is ready) or neither",
        ),
        (
            {"g2": {"model_load": {"launch": [], "health_url": "http://127.0.0.1:8000/health"}}},
            "g2.model_load.launch: expected a command",
        ),
        ({"g2": {"model_load": {"path": ""}}}, "g2.model_load.path: expected a directory path, found an empty string"),
        ({"g2": {"checkpoint": {"parameters": "7B"}}}, "g2.checkpoint.parameters"),
        ({"g2": {"checkpoint": {"parameters": 0}}}, "g2.checkpoint.parameters"),
        ({"g2": {"checkpoint": {"ranks": 0}}}, "g2.checkpoint.ranks: expected a value >= 1, found 0"),
        ({"g2": {"checkpoint": {"sync": False}}}, "g2.checkpoint.sync: unknown field"),
        # the capacity search
        ({"g3": {"capacity": {"start": 0}}}, "g3.capacity.start: expected a load > 0, found 0"),
        (
            {"g3": {"capacity": {"enabled": True, "start": 1.5}}, "slo": {"ttft_ms": 100}},
            "g3.capacity.start: expected a whole number of users (replay: closed_loop), found 1.5",
        ),
    ],
)
def test_a_bad_config_names_the_field_what_was_expected_and_what_was_found(tmp_path, data, message):
    with pytest.raises(ConfigError) as error:
        load_config(_config_file(tmp_path, data))
    assert message in str(error.value)


def test_kvgate_run_exits_2_on_a_bad_config_and_on_an_unknown_gate(tmp_path, capsys):
    assert main(["run", "--config", str(_config_file(tmp_path, {"g9": {}})), "--out", str(tmp_path / "r")]) == 2
    assert "g9: unknown field" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "g7"])
    assert exit_info.value.code == 2
    assert not (tmp_path / "r").exists()


def test_profiles_supply_defaults_under_the_files_values(tmp_path):
    quick, full = load_config(None, "quick"), load_config(None, "full")
    assert quick.g4.duration_s < 600 and full.g4.duration_s == 72 * 3600
    assert [r.to_dict() for r in quick.g3.thresholds] == [
        {"metric": "ttft_p50_reduction", "op": ">=", "value": 0.25},
        {"metric": "throughput_gain", "min": 0.29, "max": 0.40},
        {"metric": "sustained_rate_gain", "min": 0.29, "max": 0.40},
        {"metric": "disk_hit_share", "op": ">=", "value": 0.5}]
    mine = load_config(_config_file(tmp_path, {"profile": "full", "g2": {"rounds": 9}}))
    assert mine.profile == "full" and mine.g2.rounds.min == 9 and mine.g2.contexts == full.g2.contexts
    assert load_config(_config_file(tmp_path, {"g2": {"rounds": 9}}), profile="quick").g2.contexts == quick.g2.contexts


def test_kvgate_init_writes_a_template_that_loads_as_the_quick_profile_and_never_overwrites(tmp_path, capsys):
    target = tmp_path / "gates.yaml"
    assert main(["init", str(target)]) == 0
    assert target.read_text() == render_template() and "#" in target.read_text()
    assert load_config(target).model_dump() == load_config(None, "quick").model_dump()
    assert main(["init", str(target)]) == 2
    assert "exists" in capsys.readouterr().err


def _verdicts(*statuses):
    return [{"status": s, "reason": f"check {i}: {s}"} for i, s in enumerate(statuses)]


@pytest.mark.parametrize("verdicts, exit_code, status", [
    (_verdicts("PASS", "PASS"), 0, "passed"),
    (_verdicts("PASS", "FAIL", "INCONCLUSIVE"), 1, "failed"),
    (_verdicts("PASS", "INCONCLUSIVE"), 1, "inconclusive"),
    (_verdicts("PASS"), 1, "error"),        # a test failed without a failing verdict: it crashed
    ([], 0, "error"),                       # nothing judged is never a pass
    (_verdicts("PASS"), 2, "error"),        # pytest was interrupted
])
def test_a_gates_outcome_follows_its_verdicts_and_a_crash_is_never_a_pass(verdicts, exit_code, status):
    assert gate_status(verdicts, exit_code)[0] == status


def test_a_gate_none_of_whose_checks_applies_is_not_run_saying_why_and_never_passes():
    unjudged = [{"reason": "not run: not applicable: vllm has no disk tier (no KV connector)"},
                {"reason": "no threshold for 'no_reuse_ttft_cost' in g2.thresholds and no default rule"}]
    assert gate_status([], 0, unjudged) == ("not run", "no check applies to the candidate: not applicable: vllm "
                                                       "has no disk tier (no KV connector)")
    assert gate_status([], 0, unjudged[1:])[0] == "error"                # measured only: nothing was judged
    assert gate_status(_verdicts("PASS"), 0, unjudged) == ("passed", "1 checks passed; 2 measured, not judged")


class _ScriptedRunner(GateRunner):
    """The real orchestration with each gate's outcome scripted (unit test of the stop-loss order)."""

    def __init__(self, outcomes, **kwargs):
        super().__init__(load_config(None, "quick"), **kwargs)
        self.outcomes, self.ran = outcomes, []

    def _run_gate(self, gate):
        self.ran.append(gate)
        self.store.set_status(gate, self.outcomes[gate], "scripted")
        return self.outcomes[gate]


def test_a_failed_gate_stops_the_later_ones_unless_continue_on_fail(tmp_path):
    outcomes = {"g1": "passed", "g2": "failed", "g3": "passed", "g4": "passed"}
    stopped = _ScriptedRunner(outcomes, run_dir=tmp_path / "a", run_id="a", gates=["g1", "g2", "g3", "g4"],
                              continue_on_fail=False)
    assert stopped._run_gates() == ["passed", "failed", "not run", "not run"]
    assert stopped.ran == ["g1", "g2"]
    assert stopped.store.status("g3") == {"gate": "g3", "status": "not run", "reason": "not run: stopped at G2"}
    going_on = _ScriptedRunner(outcomes, run_dir=tmp_path / "b", run_id="b", gates=["g1", "g2", "g3", "g4"],
                               continue_on_fail=True)
    assert going_on._run_gates() == ["passed", "failed", "passed", "passed"]
    assert going_on.ran == ["g1", "g2", "g3", "g4"]


def _run_cli(capsys, *argv) -> tuple[int, str]:
    code = main(["run", *map(str, argv)])
    return code, capsys.readouterr().err


def test_out_pointing_at_an_existing_file_or_another_run_is_exit_2(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("not a run directory")
    code, err = _run_cli(capsys, "g1", "--out", taken)
    assert code == 2 and "--out: expected a new or empty directory for the run, found an existing file" in err
    other = tmp_path / "other-run"
    other.mkdir()
    (other / "run.json").write_text("{}")
    code, err = _run_cli(capsys, "g1", "--out", other)
    assert code == 2 and "holding files (a run: --resume continues its G4 soak)" in err
    assert taken.read_text() == "not a run directory" and (other / "run.json").read_text() == "{}"


def test_resume_refuses_a_gate_it_cannot_resume_and_leaves_the_run_untouched(tmp_path, capsys):
    run_dir = tmp_path / "g4-run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"storage": {"path": str(tmp_path / "storage")}}))
    (run_dir / "run.json").write_text('{"run_id": "r", "gates": ["g4"]}')
    code, err = _run_cli(capsys, "g3", "--resume", run_dir)
    assert code == 2 and "--resume: expected only gates that can resume (g4" in err and "found g3" in err
    assert (run_dir / "run.json").read_text() == '{"run_id": "r", "gates": ["g4"]}'
    (run_dir / "run.json").write_text('{"run_id": "r", "gates": ["g1", "g2"]}')
    code, err = _run_cli(capsys, "--resume", run_dir)
    assert code == 2 and "--resume: expected a run that had g4, found a run of g1, g2" in err


def test_a_storage_path_that_is_a_file_or_read_only_is_exit_2_before_anything_starts(tmp_path, capsys):
    a_file = tmp_path / "storage-file"
    a_file.write_text("x")
    config = _config_file(tmp_path, {"storage": {"path": str(a_file)}})
    code, err = _run_cli(capsys, "g1", "--config", config, "--out", tmp_path / "r1")
    assert code == 2 and "storage.path: expected a directory (or a path to create one), found an existing file" in err
    read_only = tmp_path / "ro"
    read_only.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (needs CAP_SYS_ADMIN): the read-only case is untested")
    try:
        config = _config_file(tmp_path, {"storage": {"path": str(read_only / "kv")}})
        code, err = _run_cli(capsys, "g1", "--config", config, "--out", tmp_path / "r2")
    finally:
        subprocess.run(["umount", str(read_only)], check=True)
    assert code == 2 and "storage.path: expected a writable directory, found" in err
    assert "Read-only file system" in err
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


def test_a_refused_run_creates_nothing_not_even_the_storage_directory(tmp_path, capsys):
    (tmp_path / "taken").write_text("x")
    config = _config_file(tmp_path, {"storage": {"path": str(tmp_path / "new-storage")}})
    code, err = _run_cli(capsys, "g1", "--config", config, "--out", tmp_path / "taken")
    assert code == 2 and "--out: expected a new or empty directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gates.yaml", "taken"]


def test_an_external_config_does_not_inherit_the_profiles_fault_schedule(tmp_path):
    config = load_config(_config_file(tmp_path, {"targets": {"kind": "external",
                                                             "baseline": {"url": "http://h:1/v1", "model": "m"},
                                                             "candidate": {"url": "http://h:2/v1", "model": "m"}}}))
    assert config.g4.faults == [] and load_config().g4.faults


def test_a_fault_schedule_goes_to_kvgates_connector_in_vllm_through_its_sidecar(tmp_path):
    faults = [{"kind": "flip_byte", "at_s": 12}, {"kind": "read_error", "at_s": 30, "duration_s": 5}]
    config = load_config(_config_file(tmp_path, {"targets": {
        "kind": "external", "baseline": {"url": "http://h:1/v1", "model": "m", "engine": "vllm"},
        "candidate": {"url": "http://h:2/v1", "model": "m", "engine": "vllm", "cache_layer": "kvgate",
                      "cache_layer_url": "http://h:3"}}, "g4": {"faults": faults}}))
    assert [f.kind for f in config.g4.faults] == ["flip_byte", "read_error"]


def test_a_relative_storage_path_is_stored_absolute_so_every_gate_measures_the_same_directory(tmp_path,
                                                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(_config_file(tmp_path, {"storage": {"path": "st"}}))
    assert config.storage.path == tmp_path / "st"
    assert yaml.safe_load(yaml.safe_dump(config.model_dump(mode="json")))["storage"]["path"] == str(tmp_path / "st")


@pytest.mark.parametrize("out, message", [
    ("afile/sub", "--out: expected a new or empty directory for the run, found the file"),
    ("/proc/kvgate-out", "--out: expected a writable directory, found '/proc/kvgate-out'"),
    ("dangling", "--out: expected a new or empty directory for the run, found a dangling link"),
])
def test_an_out_directory_that_cannot_be_made_is_exit_2(tmp_path, capsys, monkeypatch, out, message):
    monkeypatch.chdir(tmp_path)
    Path("afile").write_text("x")
    Path("dangling").symlink_to(tmp_path / "nowhere")
    code, err = _run_cli(capsys, "g1", "--out", out)
    assert code == 2 and message in err and "Traceback" not in err


def test_a_broken_run_json_is_exit_2_for_resume_and_report(tmp_path, capsys):
    run_dir = tmp_path / "bad"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"storage": {"path": str(tmp_path / "s")}}))
    for text, found in (("{not json", "unreadable JSON"), ("[]", "found a list")):
        (run_dir / "run.json").write_text(text)
        code, err = _run_cli(capsys, "--resume", run_dir)
        assert code == 2 and "run.json: expected a run's JSON object" in err and found in err
        assert main(["report", str(run_dir)]) == 2
        assert "run.json: expected a run's JSON object" in capsys.readouterr().err


def test_init_into_a_place_it_cannot_write_is_exit_2(tmp_path, capsys):
    assert main(["init", str(tmp_path / "no" / "such" / "dir" / "g.yaml")]) == 2
    assert "file: expected a path kvgate can write" in capsys.readouterr().err


def test_an_embedded_server_that_dies_at_start_is_said_at_once_with_its_reason(tmp_path, capsys):
    config = _config_file(tmp_path, {"targets": {"embedded": {"preset": "tiny", "device_capacity_blocks": 10**9}},
                                     "g2": {"contexts": [1024]}, "storage": {"path": str(tmp_path / "storage")}})
    code, err = _run_cli(capsys, "g2", "--config", config, "--out", tmp_path / "run")
    assert code == 2
    assert "the embedded server" in err and "exited at start" in err and "can't allocate memory" in err
    assert json.loads((tmp_path / "run" / "gates" / "g2" / "status.json").read_text())["status"] == "not run"



def test_model_load_and_checkpoint_settings_are_read_as_given(tmp_path, monkeypatch):
    from cache_impl.weights.safetensors_dir import write_random_checkpoint

    monkeypatch.chdir(tmp_path)               # models/m below is relative: read from here, stored absolute
    write_random_checkpoint(tmp_path / "models" / "m", 1 << 20, shard_bytes=1 << 20)
    config = load_config(_config_file(tmp_path, {"g2": {
        "model_load": {"path": "models/m", "launch": "engine serve --port 9 'a b'",
                       "health_url": "http://127.0.0.1:9/health", "loaders": ["fastsafetensors"],
                       "judged": "fastsafetensors"},
        "checkpoint": {"parameters": "70B", "ranks": 8}}}))
    assert config.g2.model_load.path.is_absolute() and config.g2.model_load.path.name == "m"
    assert config.g2.model_load.launch == ["engine", "serve", "--port", "9", "a b"]   # split as a shell would
    assert config.g2.model_load.loaders == ["fastsafetensors"] and config.g2.model_load.judged == "fastsafetensors"
    assert config.g2.checkpoint.parameters == "70B" and config.g2.checkpoint.ranks == 8
    spec = config.g2.checkpoint.spec()                     # the preset's count, 14 bytes each, over 8 ranks
    assert (spec.parameters, spec.ranks) == (70_553_706_496, 8)
    assert 70_553_706_496 * 14 * 0.999 < spec.total_bytes < 70_553_706_496 * 14 * 1.001
    # the profile's parameter count is replaced, not merged with a preset
    assert (
        load_config(_config_file(tmp_path, {"g2": {"checkpoint": {"parameters": 1000}}})).g2.checkpoint.parameters
        == 1000
    )


def test_the_g2_control_configs_load_as_a_short_g2_and_the_serial_one_reads_with_one_worker():
    root = Path(__file__).resolve().parents[2] / "examples" / "controls"
    serial, default = load_config(root / "g2-serial-read.yaml"), load_config(root / "g2-cold-read.yaml")
    assert serial.targets.embedded.disk_read_workers == 1
    assert default.targets.embedded.disk_read_workers == load_config(None).targets.embedded.disk_read_workers
    for config in (serial, default):
        g2 = config.g2
        assert not (g2.model_load.enabled or g2.checkpoint.enabled or g2.no_reuse.enabled)
        assert config.rule("g2", "cold_read_vs_storage_best").value == 0.8


def test_kvgates_admin_routes_reach_the_embedded_candidate_and_the_connector_in_vllm_and_nothing_else(tmp_path):
    from engines import cache_admin
    from gates.targets import Endpoint as RunEndpoint

    targets = {"kind": "external", "baseline": {"url": "http://h:1/v1", "model": "m", "engine": "vllm"},
               "candidate": {"url": "http://h:2/v1", "model": "m", "engine": "vllm", "cache_layer": "kvgate",
                             "cache_layer_url": "http://h:3"}}
    connector = load_config(_config_file(tmp_path, {"targets": targets}))
    candidate, baseline = RunEndpoint("candidate", "http://h:2/v1", "m"), RunEndpoint("baseline", "http://h:1/v1", "m")
    assert cache_admin(connector, candidate).admin.server_root == "http://h:3"
    assert cache_admin(connector, baseline) is None                      # vLLM alone: not kvgate's cache
    embedded = RunEndpoint("candidate", "http://127.0.0.1:5/v1", "m", admin=True)
    assert cache_admin(load_config(), embedded).admin.server_root == "http://127.0.0.1:5"


def test_an_open_loop_capacity_search_takes_loads_in_steps_of_the_traces_rate(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(f'{{"timestamp": {i * 100}, "input_length": 600, "output_length": 4, "hash_ids": [{i}]}}\n'
                             for i in range(200)))
    open_loop = {"g3": {"workload": {"kind": "trace", "path": str(trace)}, "replay": "rate_multipliers",
                        "levels": [0.5, 1.0], "ttft_slo_ms": 500,
                        "capacity": {"enabled": True, "start": 0.5, "most": 8, "rate_step": 0.25}},
                 "slo": {"ttft_ms": 500}}
    config = load_config(_config_file(tmp_path, open_loop))
    assert config.g3.capacity.unit(config.g3.replay) == 0.25
    open_loop["g3"]["capacity"]["start"] = 0.3
    with pytest.raises(ConfigError, match=r"g3.capacity.start: expected a whole multiple of rate_step \(0.25, "
                                          r"replay: rate_multipliers\), found 0.3"):
        load_config(_config_file(tmp_path, open_loop))


def test_a_capacity_search_needs_an_slo_which_every_profile_gives():
    # a file's `slo: null` keeps the profile's (an empty section: its defaults), so only a configuration built
    # without a profile can lack it
    import copy

    from gates.config import GatesConfig, profile_defaults
    for name in ("quick", "full"):
        assert load_config(profile=name).slo is not None
    data = copy.deepcopy(profile_defaults("quick"))
    data.update(profile="quick", slo=None)
    data["g3"]["capacity"] = {"enabled": True}
    with pytest.raises(ValueError, match=r"slo: expected the objective g3.capacity searches under"):
        GatesConfig.model_validate(data)


def test_aa_without_a_gate_of_side_by_side_figures_is_exit_2(tmp_path, capsys):
    code, err = _run_cli(capsys, "g4", "--aa", "--out", tmp_path / "run")
    assert code == 2 and "--aa: expected a gate with side-by-side figures to run against itself (g2, g3), found g4" \
        in err


def test_an_aa_run_against_external_targets_preflights_only_the_endpoints_it_uses(tmp_path):
    from gates.run import preflighted
    from gates.targets import Endpoint

    targets = {"kind": "external", "baseline": {"url": "http://127.0.0.1:9/v1", "model": "m"},
               "candidate": {"url": "http://127.0.0.1:8/v1", "model": "m"}}
    (tmp_path / "gates.yaml").write_text(yaml.safe_dump({"targets": targets}))
    config = load_config(tmp_path / "gates.yaml")
    endpoints = {role: Endpoint(role, settings["url"], "m") for role, settings in
                 (("baseline", targets["baseline"]), ("candidate", targets["candidate"]))}
    assert list(preflighted(endpoints, config)) == ["baseline", "candidate"]
    aa = config.model_copy(update={"aa": True})
    assert list(preflighted(endpoints, aa)) == ["candidate"]            # the candidate serves the baseline's role
    embedded = load_config(None).model_copy(update={"aa": True})
    assert list(preflighted(endpoints, embedded)) == ["baseline", "candidate"]   # its own servers: all started
