"""An opt-in request log, for the tests' proof of SDK coverage (tests/route_coverage.py).

With ``OPENTINKER_ROUTE_LOG=<folder>`` in its environment, ``opentinker serve`` appends one JSON
line per request that one of its routes matched to ``<folder>/routes-<pid>.jsonl``: the HTTP
method, the route's path template, the status, the user agent, and the ``X-OpenTinker-SDK-Method``
header (which the test session adds to requests a public ``tinker`` SDK method sends). Unset, no
middleware is added and nothing is written.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ENV = "OPENTINKER_ROUTE_LOG"
SDK_METHOD_HEADER = "x-opentinker-sdk-method"


class RouteLog:
    """ASGI middleware: after each HTTP request, the first route of ``routes`` that fully matches it
    (the one Starlette dispatched to) is appended to the log, with the request's tags."""

    def __init__(self, app: ASGIApp, folder: str, routes: list[BaseRoute]) -> None:
        self.app, self.routes = app, routes
        self.file = Path(folder) / f"routes-{os.getpid()}.jsonl"
        self.file.parent.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [0]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self._write(scope, status[0])

    def _write(self, scope: Scope, status: int) -> None:
        template = next(
            (getattr(r, "path", None) for r in self.routes if r.matches(scope)[0] == Match.FULL), None
        )
        if template is None:
            return  # no route (a 404 for an unserved path, or a method no route takes)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        line: dict[str, Any] = {
            "method": scope["method"],
            "route": template,
            "status": status,
            "user_agent": headers.get("user-agent", ""),
            "sdk_method": headers.get(SDK_METHOD_HEADER),
        }
        with self.lock, self.file.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


def with_route_log(app: Any) -> Any:
    """``app`` wrapped in a RouteLog when ``OPENTINKER_ROUTE_LOG`` is set; ``app`` itself otherwise."""
    folder = os.environ.get(ENV)
    return RouteLog(app, folder, app.router.routes) if folder else app
