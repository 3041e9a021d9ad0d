"""A server under a small memory budget, over real HTTP: 1,000 sessions, each with a model and its
heartbeats, against one ``opentinker serve``; models trained through the official SDK are paged out
by the others and train on when they come back; ``/metrics`` shows what is resident and paged."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from opentinker.server.auth import create_key
from opentinker.server.local import LocalServer
from tests.conftest import SDK_ENV, TEST_MODEL

KEY = "tml-paging-test-key-0001"
SESSIONS = 1000


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalServer, str]]:
    data_dir = tmp_path_factory.mktemp("paging-data")
    ops_key = create_key(data_dir, "ops")
    argv = ["--dev", "--base-model", TEST_MODEL, "--memory-budget", "2MiB", "--operator", "ops"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        for var in SDK_ENV:
            mp.delenv(var, raising=False)
        with LocalServer([*argv, "--poll-timeout", "5"], data_dir=data_dir) as srv:
            yield srv, ops_key


def _datum(seed: int) -> types.Datum:
    tokens = [(seed * 37 + 11 * i) % 1000 + 3 for i in range(10)]
    inputs: dict[str, Any] = {"target_tokens": tokens[1:], "weights": [1.0] * 9}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _result(http: httpx.Client, reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 200, reply.text
    body = reply.json()
    while True:  # a long poll answers try_again until the result is there
        out = http.post("/api/v1/retrieve_future", json={"request_id": body["request_id"]}).json()
        if out.get("type") != "try_again":
            return out


def _session_with_a_model(http: httpx.Client, i: int) -> str:
    sid = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
    body = {
        "session_id": sid,
        "model_seq_id": 0,
        "base_model": TEST_MODEL,
        "lora_config": {"rank": 1, "seed": i},
    }
    out = _result(http, http.post("/api/v1/create_model", json=body))
    assert "model_id" in out, out
    assert http.post("/api/v1/session_heartbeat", json={"session_id": sid}).status_code == 200
    return sid


def _metric(text: str, name: str) -> float:
    """The sum of ``name``'s samples (over base models)."""
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_a_thousand_sessions_and_paged_models_train_on(world: tuple[LocalServer, str]) -> None:
    server, ops_key = world
    service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    mine = [service.create_lora_training_client(TEST_MODEL, rank=4, seed=i).result() for i in range(4)]
    adam = types.AdamParams(learning_rate=1e-2)
    first = []
    for i, tc in enumerate(mine):
        first.append(tc.forward_backward([_datum(i)], "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(adam).result()

    headers = {"X-API-Key": KEY}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=120) as http:
        with ThreadPoolExecutor(8) as pool:
            sessions = list(pool.map(lambda i: _session_with_a_model(http, i), range(SESSIONS)))
        assert len(set(sessions)) == SESSIONS
        with ThreadPoolExecutor(8) as pool:  # a round of heartbeats from every session
            codes = list(
                pool.map(
                    lambda s: http.post("/api/v1/session_heartbeat", json={"session_id": s}).status_code,
                    sessions,
                )
            )
        assert set(codes) == {200}
        reply = http.get("/metrics", headers={"X-API-Key": ops_key})
        assert reply.status_code == 200, reply.text
        metrics = reply.text

    assert _metric(metrics, "opentinker_paged_out_models") > 0
    assert _metric(metrics, "opentinker_resident_model_bytes") <= 2 * 2**20
    assert _metric(metrics, "opentinker_page_outs_total") > 0
    # the SDK's models were paged out by the thousand others; they train on, each where it was
    for i, tc in enumerate(mine):
        again = tc.forward_backward([_datum(i)], "cross_entropy").result().metrics["loss:sum"]
        assert again < first[i]  # one step of training on this datum lowered its loss
        tc.optim_step(adam).result()
