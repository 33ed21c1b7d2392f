"""G3 checks are parametrized by the configured concurrency levels."""

from pathlib import Path

from gates.config import load_config


def pytest_generate_tests(metafunc):
    if "level" not in metafunc.fixturenames:
        return
    run_dir = metafunc.config.getoption("--kvgate-run-dir")
    levels = load_config(Path(run_dir) / "config.yaml").g3.levels if run_dir else []
    metafunc.parametrize("level", levels, ids=[f"c{level}" for level in levels])
