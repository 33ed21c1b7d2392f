"""`kvgate selftest`: known-bad and known-null candidates through the real gates.

Each control (`controls.py`) starts what it needs (mock OpenAI servers with a controlled behaviour,
`workloads/servers/reference_server.py`; `kvgate serve`; or the embedded targets), runs the real gate as
`kvgate run` would, and says which verdicts it got against what it should have got
(`expectations.py`): nothing in the serial-read, failing, invalid-only and drifting controls may PASS,
the A/A's compared verdicts must FAIL, the leak must FAIL G4's descriptor check, and each such check
has a known-good control that must PASS it. `runner.py` runs them and writes `selftest.json`.
"""

from .controls import CONTROLS, Control, controls_for
from .runner import ControlResult, Selftest, run_selftest

__all__ = ["CONTROLS", "Control", "ControlResult", "Selftest", "controls_for", "run_selftest"]
