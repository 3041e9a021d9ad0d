"""Meta-conformance: the whole public surface of the installed ``tinker`` SDK is served and reached.

Both lists are derived from the SDK itself (``tests/route_coverage.py``), never written by hand, so
a new SDK release that adds a route or a method fails until it is served and exercised:

- every HTTP route the SDK can call (the path strings passed to its HTTP helpers anywhere in the
  package, parsed with ``ast``) must be matched, with its method, by a route of our FastAPI app
  (here, in every tier);
- that a real SDK call reached each of those routes over HTTP, and that every public method and
  property of the SDK's clients was called and (unless it never sends a request) reached the
  server, is checked from the servers' own request logs at the end of a whole-suite run
  (``conftest.py``'s ``pytest_sessionfinish``); the tests below show that check can fail.

``PENDING_ROUTES`` names what is known to be unserved today, each with the work it waits for. The
test fails if anything *else* is missing, and also if a PENDING entry is served by now — so the set
only shrinks, and is emptied as that work lands.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.routing import APIRoute

from opentinker.server.app import create_app
from opentinker.server.config import ServerConfig
from tests import route_coverage
from tests.route_coverage import LOCAL_METHODS, concrete, problems, sdk_methods, sdk_routes

# (METHOD, SDK path template) known to be unserved today, and what serves them.
PENDING_ROUTES: set[tuple[str, str]] = set()


@pytest.fixture(scope="module")
def app_routes(tmp_path_factory: pytest.TempPathFactory) -> list[APIRoute]:
    app = create_app(ServerConfig(data_dir=tmp_path_factory.mktemp("surface-data")))
    try:
        return [r for r in app.routes if isinstance(r, APIRoute)]
    finally:
        app.state.server.close()


def _served(route: tuple[str, str], routes: list[APIRoute]) -> APIRoute | None:
    method, template = route
    path = concrete(template)
    return next((r for r in routes if method in r.methods and r.path_regex.match(path)), None)


def test_the_sdk_route_list_is_parsed() -> None:
    routes = sdk_routes()
    # a floor, so a parser that finds nothing cannot pass vacuously
    assert len(routes) >= 40, sorted(routes)
    assert ("POST", "/api/v1/forward_backward") in routes
    assert ("DELETE", "/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}") in routes
    assert ("GET", "/api/v1/auth/apikey/me") in routes  # from the CLI's _request("GET", …)
    methods = sdk_methods()
    assert len(methods) >= 100 and "TrainingClient.forward_backward" in methods


def test_every_sdk_route_is_served(app_routes: list[APIRoute]) -> None:
    routes = sdk_routes()
    missing = sorted(r for r in routes if not _served(r, app_routes) and r not in PENDING_ROUTES)
    assert not missing, "routes the SDK calls that the server does not serve:\n" + "\n".join(
        f"  {m} {p}" for m, p in missing
    )
    now_served = sorted(r for r in PENDING_ROUTES if _served(r, app_routes))
    assert not now_served, "served now, remove from PENDING_ROUTES: " + repr(now_served)
    stale = sorted(PENDING_ROUTES - routes)
    assert not stale, "PENDING_ROUTES entries the SDK does not call: " + repr(stale)


def _complete_log(app_routes: list[APIRoute]) -> tuple[list[dict], set[str]]:
    """A request log in which an SDK call reached every route, and every member reached one."""
    records = []
    for route in sorted(sdk_routes()):
        served = _served(route, app_routes)
        assert served is not None
        records.append({"method": route[0], "route": served.path, "user_agent": "AsyncTinker/Python 0.38.0"})
    some = records[0]
    records += [{**some, "sdk_method": name} for name in sdk_methods() if name not in LOCAL_METHODS]
    return records, set(sdk_methods())


def test_the_route_check_passes_on_a_complete_log(app_routes: list[APIRoute]) -> None:
    records, called = _complete_log(app_routes)
    assert problems(records, called, app_routes) == []


def test_the_route_check_names_what_no_sdk_call_reached(app_routes: list[APIRoute]) -> None:
    records, called = _complete_log(app_routes)
    fb = next(r for r in records if r["route"] == "/api/v1/forward_backward" and "sdk_method" not in r)
    # the same route reached by a test's own HTTP client (no SDK header, no SDK user agent)
    without = [r for r in records if r is not fb] + [{**fb, "user_agent": "python-httpx/0.28"}]
    assert problems(without, called, app_routes) == [
        "route POST /api/v1/forward_backward: no SDK call reached it (served as /api/v1/forward_backward)"
    ]
    assert problems(records, called - {"TrainingClient.save_state"}, app_routes) == [
        "member TrainingClient.save_state: no test called it"
    ]
    quiet = [r for r in records if r.get("sdk_method") != "RestClient.list_user_checkpoints"]
    assert problems(quiet, called, app_routes) == [
        "member RestClient.list_user_checkpoints: called, but no request it sent reached a server"
    ]
    # a heartbeat of the holder a member made carries its tag: it is no request of that member's
    beat = {"method": "POST", "route": "/api/v1/session_heartbeat", "user_agent": "AsyncTinker/Python 0.38.0"}
    assert problems(
        [*quiet, {**beat, "sdk_method": "RestClient.list_user_checkpoints"}], called, app_routes
    ) == ["member RestClient.list_user_checkpoints: called, but no request it sent reached a server"]
    assert (
        problems([*records, {**beat, "sdk_method": "SamplingClient.from_sampler_handle"}], called, app_routes)
        == []
    )


def test_the_servers_log_routes_only_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi.testclient import TestClient

    from opentinker.server.route_log import ENV, RouteLog, with_route_log

    app = create_app(ServerConfig(data_dir=tmp_path / "data"))
    try:
        monkeypatch.delenv(ENV, raising=False)
        assert with_route_log(app) is app
        monkeypatch.setenv(ENV, str(tmp_path / "log"))
        logged = with_route_log(app)
        assert isinstance(logged, RouteLog)
        with TestClient(logged) as client:
            client.get("/api/v1/healthz", headers={"X-OpenTinker-SDK-Method": "ServiceClient.x"})
            client.get("/api/v1/no-such-route")
        (line,) = (tmp_path / "log").glob("routes-*.jsonl")
        assert [
            (r["method"], r["route"], r["status"], r["sdk_method"])
            for r in map(_json, line.read_text().splitlines())
        ] == [("GET", "/api/v1/healthz", 200, "ServiceClient.x")]
    finally:
        app.state.server.close()


def _json(line: str) -> dict:
    import json

    return json.loads(line)


def test_pending_gaps_only_shrink() -> None:
    """A gap outside PENDING fails the run, and so does a PENDING entry that is no longer a gap."""
    pending = frozenset({"member A.b: no test called it", "route GET /api/v1/c: not served"})
    new = "member X.y: no test called it"
    assert route_coverage.unexpected(sorted(pending), pending) == []
    assert route_coverage.unexpected([*pending, new], pending) == [new]
    some = sorted(pending)[0]
    closed = route_coverage.unexpected(sorted(pending - {some}), pending)
    assert closed == [f"PENDING entry closed, delete it: {some}"]
    # the suite's own list: every gap it does not name is a failure (empty: every gap is one)
    assert (
        route_coverage.unexpected([new]) == [new]
        and route_coverage.unexpected(sorted(route_coverage.PENDING)) == []
    )
