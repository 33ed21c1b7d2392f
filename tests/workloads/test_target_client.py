"""A target's own client carries its API key (workloads/traffic/target.py): G2's requests, the G4 soak's
probes and the sizing model's probes go through it, so a keyed endpoint that passed the pre-flight is not
refused by the gates after it."""

from __future__ import annotations

import pytest

from tests.servers import started_server
from workloads.traffic.datasets import context_request
from workloads.traffic.target import Target

KEY = "sk-test-target-client"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    yield from started_server(tmp_path_factory.mktemp("keyed"), api_key=KEY)


def test_a_targets_client_sends_the_key_its_variable_holds(keyed_server, monkeypatch):
    target = Target("candidate", f"{keyed_server.base_url}/v1", "kvgate-tiny", api_key_env="KVGATE_TEST_KEY")
    request = context_request(64, "keyed", None, 2, "test")
    monkeypatch.delenv("KVGATE_TEST_KEY", raising=False)
    assert target.api_key is None
    refused = target.client().send(request)
    assert not refused.ok and refused.http_status == 401, refused
    monkeypatch.setenv("KVGATE_TEST_KEY", KEY)
    client = target.client(target="probe")
    try:
        record = client.send(request)
    finally:
        client.close()
    assert record.ok and record.ttft_s is not None, record
    assert client.target == "probe" and target.client().target == "candidate"
