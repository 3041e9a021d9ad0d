"""The console pages: what ``get_console_url()`` of the SDK's clients points at, served here.

The ``tinker`` SDK builds console URLs on its hosted console's origin with fixed paths
(``/sessions``, ``/sessions/<id>``, ``/training_runs/<id>``, ``/checkpoints/<run>/<id>``, see
``tinker/lib/console_urls.py``); the unmodified SDK cannot be pointed elsewhere. This server
serves the same paths, so the URL that ``ServiceClient.get_console_url()`` or
``TrainingClient.get_console_url()`` returns opens on this server once its origin is replaced by
the server's (:func:`local_console_url`).

A page always says which session, training run or checkpoint it is about. A browser sends no
API key, so without one a page shows nothing else (an id of another tenant must not be
confirmed to exist); with the owner's ``X-API-Key`` it adds what the server knows about it.
"""

from __future__ import annotations

import contextlib
import html
from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated
from urllib.parse import quote, urlsplit, urlunsplit

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse, Response

from opentinker.server.deps import ServerDep, api_key
from opentinker.server.errors import ApiError

if TYPE_CHECKING:
    from opentinker.server.state import Server

SDK_CONSOLE_PATHS = ("/sessions", "/training_runs/", "/checkpoints/")


def local_console_url(sdk_url: str, base_url: str) -> str:
    """The URL the SDK's ``get_console_url()`` returned, on this server's origin instead."""
    path = urlsplit(sdk_url)
    if not path.path.startswith(SDK_CONSOLE_PATHS):
        raise ValueError(f"not a console URL of the tinker SDK: {sdk_url!r}")
    ours = urlsplit(base_url)
    return urlunsplit((ours.scheme, ours.netloc, path.path, path.query, ""))


def page(title: str, subject: str, facts: Iterable[tuple[str, str]] | None, api: str) -> HTMLResponse:
    """One console page: ``title`` names the resource, ``facts`` (owner only) describe it."""
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in (facts or []))
    body = (
        f"<table>{rows}</table>"
        if facts is not None
        else "<p>Send the owner's <code>X-API-Key</code> header to see its details, or read them "
        f"through the API: <code>{html.escape(api)}</code>.</p>"
    )
    text = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>OpenTinker · {html.escape(title)}</title></head><body>"
        f"<h1>OpenTinker console</h1><h2>{html.escape(title)}</h2>"
        f"<p><code>{html.escape(subject)}</code></p>{body}</body></html>"
    )
    return HTMLResponse(text)


def api_path(*parts: str) -> str:
    return "/api/v1/" + "/".join(quote(p, safe="") for p in parts)


API = "/api/v1"
router = APIRouter()
"""The pages at the SDK's console paths (their facts read from the app's server)."""


def viewer(server: Server, key: str | None) -> str | None:
    try:
        return server.auth.tenant(key) if key else None
    except ApiError:
        return None


@router.get("/sessions", tags=["console"], include_in_schema=False)
async def console_sessions() -> Response:
    return page("sessions", "all sessions", None, f"{API}/sessions")


@router.get("/sessions/{session_id}", tags=["console"], include_in_schema=False)
async def console_session(
    server: ServerDep, session_id: str, key: Annotated[str | None, Depends(api_key)]
) -> Response:
    row, who = server.store.session(session_id), viewer(server, key)
    facts = None
    if row is not None and row.tenant == who:
        facts = [("owner", row.tenant), ("finished", row.finished or "no")]
    return page("session", session_id, facts, api_path("sessions", session_id))


@router.get("/training_runs/{model_id}", tags=["console"], include_in_schema=False)
async def console_run(
    server: ServerDep, model_id: str, key: Annotated[str | None, Depends(api_key)]
) -> Response:
    who, facts = viewer(server, key), None
    if who is not None:
        with contextlib.suppress(ApiError):
            run = server.checkpoints.training_run(who, model_id)
            facts = [(k, str(v)) for k, v in run.items() if v is not None and not isinstance(v, dict)]
    return page("training run", model_id, facts, api_path("training_runs", model_id))


@router.get("/checkpoints/{model_id}/{checkpoint_id:path}", tags=["console"], include_in_schema=False)
async def console_checkpoint(
    server: ServerDep, model_id: str, checkpoint_id: str, key: Annotated[str | None, Depends(api_key)]
) -> Response:
    who, facts = viewer(server, key), None
    path = f"tinker://{model_id}/{checkpoint_id}"
    row = server.store.checkpoint(path)
    if row is not None and row.tenant == who:
        facts = [("tinker_path", path), ("size_bytes", str(row.size_bytes))]
    return page("checkpoint", path, facts, api_path("training_runs", model_id))
