"""Meta-conformance: the whole public surface of the installed ``tinker`` SDK is served and tested.

Two lists are derived from the SDK itself, never written by hand, so a new SDK release that adds
a route or a method fails here until it is served and tested:

- every HTTP route the SDK can call: the path strings passed to its HTTP helpers anywhere in
  the package (``self._get/_post/…`` in ``tinker/resources``, ``client.get/post/delete`` in
  ``tinker/lib``, ``_request("GET", …)`` in ``tinker/cli``), parsed with ``ast`` — each must be
  matched, with its method, by a route of our FastAPI app;
- every public method (and property) of ``ServiceClient``, ``TrainingClient``,
  ``SamplingClient``, ``RestClient`` and ``AdminClient``, found with ``inspect`` — each must be
  called (``.name(``; a property: ``.name``) by at least one test in ``tests/``.

``PENDING_ROUTES`` / ``PENDING_METHODS`` name what is known to be missing today, each with the
work it waits for. The test fails if anything *else* is missing, and also if a PENDING entry is
served or called by now — so the sets only shrink, and are emptied as that work lands.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import tinker
from fastapi.routing import APIRoute

from opentinker.server.app import create_app
from opentinker.server.config import ServerConfig

SDK_ROOT = Path(tinker.__file__).parent
TESTS = Path(__file__).parent
CLIENTS = (
    tinker.ServiceClient,
    tinker.TrainingClient,
    tinker.SamplingClient,
    tinker.RestClient,
    tinker.AdminClient,
)
HTTP_HELPERS = {"get", "post", "put", "patch", "delete", "_get", "_post", "_put", "_patch", "_delete"}

# What each SDK path parameter looks like at run time (a checkpoint id is "<kind>/<name>").
SAMPLE_PARAMS = {"checkpoint_id": "sampler_weights/ckpt-1", "sampling_session_id": "sess-1:sample:0"}

# (METHOD, SDK path template) known to be unserved today, and what serves them.
PENDING_ROUTES: set[tuple[str, str]] = set()

# "Client.method" known to be called by no test today, and what will call them.
PENDING_METHODS: set[str] = set()


# ---------------------------------------------------------------------------- the SDK's routes
def _template(node: ast.expr) -> str | None:
    """The path of a str literal or f-string, f-string fields as ``{name}``; None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        out = []
        for part in node.values:
            if isinstance(part, ast.Constant):
                out.append(str(part.value))
            elif isinstance(part, ast.FormattedValue):
                out.append("{" + ast.unparse(part.value).split(".")[-1] + "}")
        return "".join(out)
    return None


def sdk_routes() -> set[tuple[str, str]]:
    """Every ``(METHOD, path template)`` under ``/api/`` that the SDK's sources send."""
    found: set[tuple[str, str]] = set()
    for file in SDK_ROOT.rglob("*.py"):
        if file.name.endswith("_test.py") or file.name.startswith("test_") or "tests" in file.parts:
            continue  # the SDK's own tests call made-up paths
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
                continue
            name, args = node.func.attr, node.args
            if name in HTTP_HELPERS:
                method, path = name.lstrip("_").upper(), _template(args[0])
            elif name == "_request" and len(args) >= 2:
                method, path = _template(args[0]), _template(args[1])
            else:
                continue
            if method and path and path.startswith("/api/"):
                found.add((method.upper(), path))
    return found


def _concrete(template: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: SAMPLE_PARAMS.get(m[1], "id-1"), template)


@pytest.fixture(scope="module")
def app_routes(tmp_path_factory: pytest.TempPathFactory) -> list[APIRoute]:
    app = create_app(ServerConfig(data_dir=tmp_path_factory.mktemp("surface-data")))
    try:
        return [r for r in app.routes if isinstance(r, APIRoute)]
    finally:
        app.state.server.close()


def _served(route: tuple[str, str], routes: list[APIRoute]) -> bool:
    method, template = route
    path = _concrete(template)
    return any(method in r.methods and r.path_regex.match(path) for r in routes)


def test_the_sdk_route_list_is_parsed() -> None:
    routes = sdk_routes()
    # a floor, so a parser that finds nothing cannot pass vacuously
    assert len(routes) >= 40, sorted(routes)
    assert ("POST", "/api/v1/forward_backward") in routes
    assert ("DELETE", "/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}") in routes
    assert ("GET", "/api/v1/auth/apikey/me") in routes  # from the CLI's _request("GET", …)


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


# ---------------------------------------------------------------------------- the SDK's methods
def sdk_methods() -> dict[str, bool]:
    """``"Client.name"`` → whether it is a property (else a method), for every public member."""
    out: dict[str, bool] = {}
    for cls in CLIENTS:
        for name, member in inspect.getmembers(cls):
            if name.startswith("_"):
                continue
            if isinstance(member, property) or callable(member):
                out[f"{cls.__name__}.{name}"] = isinstance(member, property)
    return out


def _test_sources() -> str:
    here = Path(__file__).resolve()
    return "\n".join(p.read_text() for p in sorted(TESTS.rglob("*.py")) if p.resolve() != here)


def _called(name: str, is_property: bool, sources: str) -> bool:
    attr = name.split(".", 1)[1]
    pattern = rf"\.{attr}\b(?!\s*=[^=])" if is_property else rf"\.{attr}\("
    return re.search(pattern, sources) is not None


def test_every_public_method_is_called_by_a_test() -> None:
    methods, sources = sdk_methods(), _test_sources()
    assert len(methods) >= 100 and "TrainingClient.forward_backward" in methods
    uncalled = sorted(n for n, prop in methods.items() if not _called(n, prop, sources))
    missing = [n for n in uncalled if n not in PENDING_METHODS]
    assert not missing, "public SDK methods no test calls:\n" + "\n".join(f"  {n}" for n in missing)
    now_called = sorted(PENDING_METHODS - set(uncalled))
    assert not now_called, "called now, remove from PENDING_METHODS: " + repr(now_called)
