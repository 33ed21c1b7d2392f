"""A service's start timed from outside, with a real `kvgate serve` on loopback: ready and first token in
order, its own startup record read when it gives one, and a service that dies or never answers said so."""

from __future__ import annotations

import sys

import pytest

from workloads.probes.service_load import ServiceStart, ServiceStartError, time_service_start
from workloads.traffic.processes import free_port


def _serve(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gates.cli", "serve", "--preset", "tiny", "--mode", "recompute",
            "--host", "127.0.0.1", "--port", str(port), *extra]


def test_a_real_server_is_timed_to_ready_and_to_its_first_token(tmp_path):
    port = free_port()
    start = time_service_start(_serve(port), f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}/v1",
                               "kvgate-tiny", log=tmp_path / "serve.log")
    assert 0 < start.ready_s < start.first_token_s
    phases = start.phases()
    assert list(phases)[-2:] == ["ready", "first_token"]
    assert sum(phases.values()) == pytest.approx(start.first_token_s)
    # the server is stopped afterwards: its port is free again
    with pytest.raises(ServiceStartError, match="exited before it was ready"):
        time_service_start([sys.executable, "-c", "import sys; print('kvgate serve: no weights'); sys.exit(2)"],
                           f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}/v1", "m",
                           log=tmp_path / "dead.log")
    assert "no weights" in (tmp_path / "dead.log").read_text()


def test_a_service_that_never_answers_is_said_so_within_the_timeout(tmp_path):
    port = free_port()
    with pytest.raises(ServiceStartError, match=r"was not ready at .* within 1 s"):
        time_service_start([sys.executable, "-c", "import time; time.sleep(30)"], f"http://127.0.0.1:{port}/health",
                           f"http://127.0.0.1:{port}/v1", "m", log=tmp_path / "silent.log", timeout_s=1)


def test_phases_follow_the_services_own_startup_record():
    start = ServiceStart(imports_done_s=0.8, weights_loaded_s=2.0, ready_s=2.5, first_token_s=2.6)
    assert start.phases() == pytest.approx({"imports": 0.8, "weights": 1.2, "ready": 0.5,
                                            "first_token": 0.1})
    unknown = ServiceStart(None, None, ready_s=3.0, first_token_s=3.5)        # an engine that says nothing
    assert unknown.phases() == pytest.approx({"ready": 3.0, "first_token": 0.5})
