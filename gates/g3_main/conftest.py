"""G3 checks are parametrized by the configured levels: concurrencies (c2), or rate multipliers (x2)."""

from pathlib import Path

from gates.config import load_config


def pytest_generate_tests(metafunc):
    if "level" not in metafunc.fixturenames:
        return
    run_dir = metafunc.config.getoption("--kvgate-run-dir")
    g3 = load_config(Path(run_dir) / "config.yaml").g3 if run_dir else None
    levels = g3.levels if g3 else []
    prefix = "c" if g3 is None or g3.replay == "closed_loop" else "x"
    metafunc.parametrize("level", levels, ids=[f"{prefix}{level:g}" for level in levels])
