"""A body nested absurdly deep is a malformed body like any other: a 400 naming the problem.

Python's JSON decoder recurses once per level, so 100,000 levels raise ``RecursionError`` wherever
such a body is decoded (FastAPI's body parsing, the refusal bookkeeping of ``refusals.py``). The
server must answer every route with a 400 for it, show no traceback or server path, and go on
serving. Each route is taken from the app's own route table, so a route added later is covered.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from opentinker.server.app import create_app
from opentinker.server.config import ServerConfig
from opentinker.server.limits import MAX_JSON_DEPTH, nested_too_deeply
from tests.conftest import TEST_MODEL

KEY = "tml-deep-bodies-test-key-0001"
LEVELS = 100_000
BODIES = {
    "arrays": "[" * LEVELS + "]" * LEVELS,
    "objects": '{"a":' * LEVELS + "1" + "}" * LEVELS,
}
BODY_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    data = tmp_path_factory.mktemp("deep-bodies")
    app = create_app(ServerConfig(data, base_models=(TEST_MODEL,), dev=True, poll_timeout_s=5.0))
    with TestClient(app, headers={"X-API-Key": KEY}, raise_server_exceptions=False) as c:
        yield c


def _body_routes(client: TestClient) -> list[tuple[str, str]]:
    """``(method, url)`` of every route that takes a body, path parameters filled in."""
    out = []
    for route in client.app.routes:  # type: ignore[attr-defined]
        if isinstance(route, APIRoute):
            url = re.sub(r"\{[^}]+\}", "x", route.path)
            out += [(m, url) for m in sorted(route.methods & BODY_METHODS)]
    return out


def _refused_cleanly(status: int, text: str, data_dir: Path) -> str | None:
    """What is wrong with the answer to a too-deep body, or None."""
    if status != 400:
        return f"status {status}: {text[:200]}"
    if "nested too deeply" not in text:
        return f"message {text[:200]!r}"
    if "Traceback" in text or "/work" in text or str(data_dir) in text:
        return f"leaks {text[:200]!r}"
    return None


@pytest.mark.parametrize("shape", sorted(BODIES))
@pytest.mark.parametrize("content_type", ["application/json", "text/plain", None])
def test_every_route_refuses_a_deeply_nested_body_with_400(
    client: TestClient, shape: str, content_type: str | None
) -> None:
    routes = _body_routes(client)
    urls = {url for _, url in routes}
    for needed in (
        "optim_step",
        "forward_backward",
        "asample",
        "save_weights",
        "create_session",
        "load_weights",
    ):
        assert f"/api/v1/{needed}" in urls  # the training, sampling, checkpoint and session routes
    assert {"/v1/chat/completions", "/v1/completions"} <= urls  # and the OpenAI-compatible ones
    headers = {"content-type": content_type} if content_type else {}
    data_dir = client.app.state.server.config.data_dir  # type: ignore[attr-defined]
    wrong = {}
    for method, url in routes:
        r = client.request(method, url, content=BODIES[shape], headers=headers)
        problem = _refused_cleanly(r.status_code, r.text, data_dir)
        if problem:
            wrong[f"{method} {url}"] = problem
    assert not wrong, wrong
    # and the server goes on: a normal request right after is served
    r = client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "test"})
    assert r.status_code == 200 and r.json()["session_id"]


def test_a_deeply_nested_protobuf_body_is_a_400(client: TestClient) -> None:
    """Protobuf bodies are not JSON; one of nested groups (field 15: '{' opens, '|' closes) is
    refused by the protobuf decoder's own depth limit, as a body that is not a request."""
    body = b"{" * LEVELS + b"|" * LEVELS
    r = client.post(
        "/api/v1/forward_backward", content=body, headers={"content-type": "application/x-protobuf"}
    )
    assert r.status_code == 400 and "not a protobuf ForwardBackwardRequest" in r.json()["detail"], r.text
    assert "Traceback" not in r.text


def test_nesting_within_the_limit_and_brackets_in_strings_reach_the_route(client: TestClient) -> None:
    deep = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    r = client.post("/api/v1/optim_step", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 422  # the route's own validation answers: not an object
    brackets = "[{" * LEVELS
    body = {"tags": [brackets], "sdk_version": "test", "user_metadata": {"k": '\\"' + brackets}}
    r = client.post("/api/v1/create_session", json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("body", "deep"),
    [
        (b"[" * (MAX_JSON_DEPTH + 1), True),
        (b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH, False),
        (b"[]" * 10 * MAX_JSON_DEPTH, False),  # many brackets, never deep
        (json.dumps(["[" * 1000, "{" * 1000]).encode(), False),  # brackets inside strings
        (json.dumps(['\\"' + "[" * 1000]).encode(), False),  # an escaped quote does not end it
        (b'["\\\\"' + b"[" * (MAX_JSON_DEPTH + 1), True),  # an escaped backslash does not escape
        (("[" * (MAX_JSON_DEPTH + 1)).encode("utf-16"), True),  # json.loads reads UTF-16 too
    ],
)
def test_nesting_depth(body: bytes, deep: bool) -> None:
    assert nested_too_deeply(body) is deep
