"""The proof that the ``tinker`` SDK's whole public surface is exercised over HTTP (conftest.py).

For the whole test session, ``OPENTINKER_ROUTE_LOG`` names a temporary folder, so every
``opentinker serve`` child a test starts logs each request a route matched (the server's
``route_log.py``). In this process, every public method and property of the SDK's clients (and of
its CLI's ``TinkerAuthApi``) is wrapped so that, while the outermost one runs, each request it sends
carries ``X-OpenTinker-SDK-Method: Client.method`` (set on ``httpx``'s ``send``). A request is an SDK
call when it carries that header, or the SDK's own user agent (``Tinker/Python …``, from SDK code in
child processes: the cookbook's scripts).

``problems()`` then holds the SDK's surface against what the servers saw:

- every ``(METHOD, path)`` the SDK's sources can send (``sdk_routes``, parsed with ``ast``) is served
  by a route that some SDK call reached;
- every public method and property of ``CLIENTS`` was called by some test (the outermost SDK call:
  not only from inside another SDK method), and, unless it is in ``LOCAL_METHODS`` (members that
  never send a request), a request it sent reached the server; a ``LOCAL_METHODS`` entry that did
  reach it must leave that set.
"""

from __future__ import annotations

import ast
import contextvars
import functools
import inspect
import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
import tinker
from tinker.cli.auth_api import TinkerAuthApi

ENV = "OPENTINKER_ROUTE_LOG"
HEADER = "X-OpenTinker-SDK-Method"
SDK_ROOT = Path(tinker.__file__).parent
CLIENTS = (
    tinker.ServiceClient,
    tinker.TrainingClient,
    tinker.SamplingClient,
    tinker.RestClient,
    tinker.AdminClient,
)
HTTP_HELPERS = {"get", "post", "put", "patch", "delete", "_get", "_post", "_put", "_patch", "_delete"}
SDK_USER_AGENT = re.compile(r"^(Async)?Tinker/Python ")

# What each SDK path parameter looks like at run time (a checkpoint id is "<kind>/<name>").
SAMPLE_PARAMS = {"checkpoint_id": "sampler_weights/ckpt-1", "sampling_session_id": "sess-1:sample:0"}

# What a client holder's background tasks send (its heartbeat, config refresh, sampling-cancel drain,
# telemetry). A task inherits the context of the call that started it, so these carry the tag of
# whichever member made the holder (``SamplingClient.from_sampler_handle``'s heartbeats), and are
# no request of that member's: they count for the routes they reach, never for a member.
BACKGROUND_ROUTES = {
    ("POST", "/api/v1/session_heartbeat"),
    ("POST", "/api/v1/client/dynamic_config"),
    ("POST", "/api/v1/cancel_future"),
    ("POST", "/api/v1/telemetry"),
}

# Public members that send no request of their own, and why.
LOCAL_METHODS: dict[str, str] = {
    **{f"{c.__name__}.get_telemetry": "the client's own telemetry object" for c in CLIENTS},
    "ServiceClient.holder": "the client's internal holder (connection, loop)",
    "ServiceClient.get_console_url": "a URL built from the base URL",
    "TrainingClient.get_console_url": "a URL built from the base URL and the run's id",
    "TrainingClient.get_info": "fetched once when the client was created",
    "TrainingClient.get_info_async": "fetched once when the client was created",
    "TrainingClient.get_tokenizer": "loaded from the Hugging Face cache, no request",
    "SamplingClient.get_tokenizer": "loaded from the Hugging Face cache, no request",
    "SamplingClient.get_base_model": "known since the sampling session was created",
    "SamplingClient.get_base_model_async": "known since the sampling session was created",
    "SamplingClient.get_sampler_handle": "a picklable handle of ids",
    "SamplingClient.from_sampler_handle": "a client rebuilt from a handle, no request",
    "SamplingClient.on_queue_state_change": "a callback the SDK calls",
    "RestClient.whoami": "read from the claims of the JWT the SDK already holds (its docstring: no request)",
}

# Gaps the whole-suite check found and that no test closes yet, each as the check words it. The
# check fails on any gap not listed here and on an entry here that is no longer a gap (delete it):
# the set only shrinks.
PENDING: frozenset[str] = frozenset()

CALLED: set[str] = set()  # the public members a caller outside the SDK called, in this process
_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("opentinker_sdk_method", default=None)


# ---------------------------------------------------------------------------- the SDK's surface
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


def concrete(template: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: SAMPLE_PARAMS.get(m[1], "id-1"), template)


def sdk_methods() -> dict[str, bool]:
    """``"Client.name"`` → whether it is a property (else a method), for every public member."""
    out: dict[str, bool] = {}
    for cls in CLIENTS:
        for name, member in inspect.getmembers(cls):
            if not name.startswith("_") and (isinstance(member, property) or callable(member)):
                out[f"{cls.__name__}.{name}"] = isinstance(member, property)
    return out


# ---------------------------------------------------------------------------- tagging SDK calls
def _tagged(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, noting ``label`` as called and tagging the requests it sends, when no other public
    SDK member is running already (the outermost call is the one a caller made)."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def tagged_async(*args: Any, **kwargs: Any) -> Any:
            if _current.get() is not None:
                return await fn(*args, **kwargs)
            CALLED.add(label)
            token = _current.set(label)
            try:
                return await fn(*args, **kwargs)
            finally:
                _current.reset(token)

        return tagged_async

    @functools.wraps(fn)
    def tagged(*args: Any, **kwargs: Any) -> Any:
        if _current.get() is not None:
            return fn(*args, **kwargs)
        CALLED.add(label)
        token = _current.set(label)
        try:
            result = fn(*args, **kwargs)
        finally:
            _current.reset(token)
        # an async method behind a plain decorator: its body runs when awaited, tagged then too
        return _awaited_tagged(label, result) if inspect.iscoroutine(result) else result

    return tagged


async def _awaited_tagged(label: str, coro: Any) -> Any:
    token = _current.set(label)
    try:
        return await coro
    finally:
        _current.reset(token)


def _tag_class(cls: type) -> None:
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or not (isinstance(member, property) or callable(member)):
            continue
        label, raw = f"{cls.__name__}.{name}", inspect.getattr_static(cls, name)
        if isinstance(raw, property) and raw.fget is not None:
            setattr(cls, name, property(_tagged(label, raw.fget), raw.fset, raw.fdel, raw.__doc__))
        elif isinstance(raw, staticmethod | classmethod):
            setattr(cls, name, type(raw)(_tagged(label, raw.__func__)))
        elif inspect.isfunction(raw):
            setattr(cls, name, _tagged(label, raw))


def instrument_sdk() -> None:
    """Wrap the SDK's public members and ``httpx``'s ``send`` (once per process)."""
    if getattr(httpx.Client.send, "_opentinker_tagged", False):
        return
    for cls in (*CLIENTS, TinkerAuthApi):
        _tag_class(cls)
    sync_send, async_send = httpx.Client.send, httpx.AsyncClient.send

    def send(self: httpx.Client, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        if (label := _current.get()) is not None:
            request.headers[HEADER] = label
        return sync_send(self, request, **kwargs)

    async def send_async(self: httpx.AsyncClient, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        if (label := _current.get()) is not None:
            request.headers[HEADER] = label
        return await async_send(self, request, **kwargs)

    send._opentinker_tagged = True  # type: ignore[attr-defined]
    httpx.Client.send, httpx.AsyncClient.send = send, send_async  # type: ignore[method-assign]


# ---------------------------------------------------------------------------- the check
def read_log(folder: Path) -> list[dict[str, Any]]:
    lines = (line for f in sorted(folder.glob("routes-*.jsonl")) for line in f.read_text().splitlines())
    return [json.loads(line) for line in lines if line.strip()]


def problems(records: Iterable[dict[str, Any]], called: set[str], served: list[Any]) -> list[str]:
    """What of the SDK's surface no SDK call reached over HTTP, one line each (empty: all of it).
    ``served``: the server's ``APIRoute`` objects, in its order."""
    reached: set[tuple[str, str]] = set()
    by_member: dict[str, set[str]] = defaultdict(set)
    for r in records:
        if r.get("sdk_method") or SDK_USER_AGENT.match(r.get("user_agent", "")):
            reached.add((r["method"], r["route"]))
        if r.get("sdk_method") and (r["method"], r["route"]) not in BACKGROUND_ROUTES:
            by_member[r["sdk_method"]].add(f"{r['method']} {r['route']}")
    out = []
    for method, template in sorted(sdk_routes()):
        path = concrete(template)
        route = next((s for s in served if method in s.methods and s.path_regex.match(path)), None)
        if route is None:
            out.append(f"route {method} {template}: not served")
        elif (method, route.path) not in reached:
            out.append(f"route {method} {template}: no SDK call reached it (served as {route.path})")
    for name in sorted(sdk_methods()):
        if name not in called:
            out.append(f"member {name}: no test called it")
        elif name not in LOCAL_METHODS and not by_member[name]:
            out.append(f"member {name}: called, but no request it sent reached a server")
        elif name in LOCAL_METHODS and by_member[name]:
            out.append(f"member {name}: in LOCAL_METHODS but it reached {sorted(by_member[name])}")
    return out


def unexpected(gaps: list[str], pending: frozenset[str] = PENDING) -> list[str]:
    """The gaps not in ``pending`` (:data:`PENDING`), and its entries that are gaps no more."""
    new = [g for g in gaps if g not in pending]
    closed = [f"PENDING entry closed, delete it: {g}" for g in sorted(pending - set(gaps))]
    return new + closed
