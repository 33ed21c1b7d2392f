"""Load processes are real locust forked from a process that imported it once (workloads/loadgen/locust_process.py):
each runs locust's own main on its command line, with its own random state and exit code, and a script that starts
one is not run again inside it."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.servers import REPO
from workloads.loadgen.locust_process import ForkedLocust, start_locust

LOCUSTFILE = """
    import gc, os, random
    from locust import User, constant, events, task

    @events.test_start.add_listener
    def said(environment, **kwargs):
        with open(os.environ["SAID"], "a") as out:
            out.write(f"{os.getpid()} {random.random()!r} {gc.get_freeze_count()}\\n")

    class Idle(User):
        wait_time = constant(0.05)

        @task
        def nothing(self):
            pass
"""


def _locustfile(tmp_path: Path) -> Path:
    path = tmp_path / "idle_locustfile.py"
    path.write_text(textwrap.dedent(LOCUSTFILE))
    return path


def _argv(locustfile: Path, seconds: int) -> list[str]:
    return ["-f", str(locustfile), "--headless", "-u", "1", "-r", "1", "-t", f"{seconds}s", "--only-summary",
            "--loglevel", "WARNING"]


def test_each_load_process_is_locust_with_its_own_random_state_and_exit_code(tmp_path):
    said, locustfile = tmp_path / "said.txt", _locustfile(tmp_path)
    codes = []
    for run in range(2):
        with open(tmp_path / f"locust-{run}.log", "w") as log:
            process = start_locust(_argv(locustfile, 1), {"SAID": str(said), "PATH": "/usr/bin:/bin"}, log)
            codes.append(process.wait(timeout=60))
    assert isinstance(process, ForkedLocust) and codes == [0, 0]
    lines = [line.split() for line in said.read_text().splitlines()]
    assert len(lines) == 2 and lines[0][0] != lines[1][0]          # two processes, each locust's test start
    assert lines[0][1] != lines[1][1]                                # forked from one parent, drawing apart
    # what they inherited (locust and the modules it loaded) is out of the collector's sight: no long pauses
    assert all(int(line[2]) > 10_000 for line in lines)
    assert "Response time percentiles" in (tmp_path / "locust-1.log").read_text()   # locust's summary, in its log


def test_a_load_process_told_to_stop_ends_and_says_how(tmp_path):
    with open(tmp_path / "locust.log", "w") as log:
        process = start_locust(_argv(_locustfile(tmp_path), 60), {"SAID": str(tmp_path / "said.txt")}, log)
        try:
            process.wait(timeout=2)
            raise AssertionError("a 60-s load ended within 2 s")
        except subprocess.TimeoutExpired:
            assert process.poll() is None
        process.send_signal(signal.SIGTERM)                        # locust stops its users and ends the test
        assert process.wait(timeout=30) == 0 and process.returncode == 0


def test_a_script_that_starts_a_load_process_is_not_run_again_inside_it(tmp_path):
    """multiprocessing would run a script's module code again (as __mp_main__) in the processes it forks."""
    locustfile = _locustfile(tmp_path)
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from workloads.loadgen.locust_process import start_locust
        print("the script ran", flush=True)
        with open({str(tmp_path / "locust.log")!r}, "w") as log:
            code = start_locust({_argv(locustfile, 1)!r}, {{"SAID": {str(tmp_path / "said.txt")!r}}}, log).wait(60)
        print("exit", code, flush=True)
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["the script ran", "exit 0"], result.stdout + result.stderr
