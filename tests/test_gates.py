"""The gate framework: configuration errors, stop-loss, gate outcomes, `kvgate init`."""

from pathlib import Path

import pytest
import yaml

from cache_impl.config import ConfigError
from gates.cli import main
from gates.config import load_config
from gates.run import GateRunner, gate_status
from gates.template import TEMPLATE


def _config_file(tmp_path: Path, data) -> Path:
    path = tmp_path / "gates.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("data, message", [
    ({"g2": {"contextz": [1024]}}, "gates.g2.contextz: unknown field"),
    ({"g2": {"contexts": "many"}}, "gates.g2.contexts: expected a list, found 'many'"),
    ({"g2": {"contexts": []}}, "gates.g2.contexts"),
    ({"g2": {"cold_read_pairs": 3}}, "gates.g2.cold_read_pairs: expected a value >= 5, found 3"),
    ({"g3": {"levels": [2, "four"]}}, "gates.g3.levels.1: expected an integer, found 'four'"),
    ({"g1": {"thresholds": [{"metric": "seq_read_gbps", "value": 1}]}},
     "gates.g1.thresholds.0: expected either op and value, or min and max"),
    ({"g1": {"thresholds": [{"metric": "x", "op": "=>", "value": 1}]}}, "gates.g1.thresholds.0.op: expected one of"),
    ({"g3": {"thresholds": [{"metric": "throughput_gain", "min": 0.5, "max": 0.3}]}},
     "expected min <= max, found min=0.5 max=0.3"),
    ({"targets": {"kind": "external"}}, "gates.targets: expected baseline and candidate endpoints"),
    ({"targets": {"kind": "external", "baseline": {"url": "10.0.0.1:8000", "model": "m"},
                  "candidate": {"url": "http://h/v1", "model": "m"}}}, "gates.targets.baseline.url"),
    ({"fio": {"iodepth": 0}}, "gates.fio.iodepth: expected a value >= 1, found 0"),
    ({"profile": "medium"}, "profile: expected one of ['full', 'quick'], found 'medium'"),
    ({"g4": {"faults": [{"kind": "meteor", "at_s": 3}]}}, "gates.g4.faults.0.kind: expected one of"),
    ({"g4": {"duration_s": 20}}, "gates.g4: expected every fault's at_s < duration_s (20), found faults.1.at_s"),
    ({"g4": {"faults": [{"kind": "slow_disk", "at_s": 3, "delay_ms": 0}]}},
     "gates.g4.faults.0.delay_ms: expected a value > 0.0, found 0"),
    ("- just\n- a list\n", "expected a mapping at the top level, found list"),
    ("g1: [unclosed\n", "expected valid YAML"),
])
def test_a_bad_config_names_the_field_what_was_expected_and_what_was_found(tmp_path, data, message):
    with pytest.raises(ConfigError) as error:
        load_config(_config_file(tmp_path, data))
    assert message in str(error.value)


def test_kvgate_run_exits_2_on_a_bad_config_and_on_an_unknown_gate(tmp_path, capsys):
    assert main(["run", "--config", str(_config_file(tmp_path, {"g9": {}})), "--out", str(tmp_path / "r")]) == 2
    assert "gates.g9: unknown field" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "g7"])
    assert exit_info.value.code == 2
    assert not (tmp_path / "r").exists()


def test_profiles_supply_defaults_under_the_files_values(tmp_path):
    quick, full = load_config(None, "quick"), load_config(None, "full")
    assert quick.g4.duration_s < 600 and full.g4.duration_s == 72 * 3600
    assert [r.as_dict() for r in quick.g3.thresholds] == [
        {"metric": "ttft_p50_reduction", "op": ">=", "value": 0.25},
        {"metric": "throughput_gain", "min": 0.29, "max": 0.40}]
    mine = load_config(_config_file(tmp_path, {"profile": "full", "g2": {"rounds": 9}}))
    assert mine.profile == "full" and mine.g2.rounds == 9 and mine.g2.contexts == full.g2.contexts
    assert load_config(_config_file(tmp_path, {"g2": {"rounds": 9}}), profile="quick").g2.contexts == quick.g2.contexts


def test_kvgate_init_writes_a_template_that_loads_as_the_quick_profile_and_never_overwrites(tmp_path, capsys):
    target = tmp_path / "gates.yaml"
    assert main(["init", str(target)]) == 0
    assert target.read_text() == TEMPLATE and "#" in TEMPLATE
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
