"""The FastAPI app: the Tinker wire protocol under ``/api/v1`` (see PROTOCOL.md), the console,
and what runs beside them while the server serves.

:func:`create_app` builds the :class:`~opentinker.server.state.Server` (everything the process
holds, ``app.state.server``, which the routes reach through :data:`~opentinker.server.deps.ServerDep`)
and includes the route groups, each a module-level ``APIRouter`` in its own module: the SDK's operations
(:mod:`routes`), the REST checkpoint routes (:mod:`rest_routes`), the admin reads
(:mod:`admin_routes`), the console pages at the SDK's console paths (:mod:`console`), the
operator's cluster routes (:mod:`cluster`), the console (:mod:`console_api`) and the operator's
``/metrics`` (:mod:`metrics_route`). Routes only
authenticate, parse and delegate. A pure-ASGI middleware in front enforces the body-size limit
(413) and undoes ``Content-Encoding: zstd`` before any route sees a body; every error answers with
its message redacted, and a refused training request spends its ``seq_id``. Beside the routes, the
app's lifespan runs the reorder buffer's gap timeout, idle-session eviction and the checkpoint
sweep. OpenAPI docs are at ``/docs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from opentinker.server import (
    admin_routes,
    checkpoint_search,
    cluster,
    console,
    console_api,
    metrics_route,
    openai_responses_route,
    openai_routes,
    rest_routes,
    routes,
)
from opentinker.server.config import ServerConfig
from opentinker.server.errors import ApiError, error_message, image_format_refusal
from opentinker.server.limits import BODY_KEY, BodyLimit
from opentinker.server.openai_schemas import route_error
from opentinker.server.refusals import note_refused
from opentinker.server.state import Server
from opentinker.service import EngineError, PagingFull, Runtime

log = logging.getLogger(__name__)


def _engine_status(exc: EngineError) -> tuple[int, dict[str, str] | None]:
    """400, or 507 Insufficient Storage with Retry-After while page files cannot be written."""
    if isinstance(exc, PagingFull):
        return 507, {"Retry-After": str(exc.retry_after)}
    return 400, None


def create_app(config: ServerConfig, runtime: Runtime | None = None) -> FastAPI:
    server = Server(config, runtime)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = [
            asyncio.create_task(_watch_gaps(server)),
            asyncio.create_task(_watch_sessions(server)),
            asyncio.create_task(_sweep_checkpoints(server)),
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            server.close()

    app = FastAPI(
        title="OpenTinker",
        version="0.1.0",
        description="A self-hosted Tinker-compatible training and sampling service (the `tinker` SDK is its client).",
        lifespan=lifespan,
    )
    app.state.server = server
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)

    async def refused(request: Request, status: int) -> None:
        """A refused training request spends its seq_id (see refusals.py)."""

        def owns(model_id: str) -> bool:
            try:
                server.registry.model(server.auth.tenant(request.headers.get("X-API-Key")), model_id)
            except (ApiError, EngineError):
                return False
            return True

        body, kind = request.scope.get(BODY_KEY), request.headers.get("content-type", "")
        note_refused(server.sequencer, status, body, kind, owns)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        await refused(request, exc.status)
        headers = getattr(exc, "headers", None)  # e.g. WWW-Authenticate on a refused token
        return JSONResponse({"detail": server.redact(exc.message)}, status_code=exc.status, headers=headers)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        status, headers = _engine_status(exc)
        await refused(request, status)
        return JSONResponse({"detail": server.redact(error_message(exc))}, status, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        if (message := image_format_refusal(exc.errors())) is not None:  # a gif ImageChunk: 400
            await refused(request, 400)
            return JSONResponse({"detail": message}, status_code=400)
        await refused(request, 422)
        return await request_validation_exception_handler(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        await refused(request, exc.status_code)  # e.g. 404: a route this server does not serve
        if request.url.path.startswith("/v1/"):  # OpenAI's clients read only OpenAI's error shape
            err = route_error(request.method, request.url.path, exc.status_code)
            return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)
        return await http_exception_handler(request, exc)

    app.include_router(routes.router)  # the SDK's operations
    app.include_router(rest_routes.router)  # the REST checkpoint routes
    app.include_router(checkpoint_search.router)  # SDK 0.39's search_checkpoints
    app.include_router(admin_routes.router)  # AdminClient's reads
    app.include_router(console.router)  # the pages at the SDK's console paths
    app.include_router(cluster.router)  # the operator's rollout-worker reads and scaling
    console_api.mount_static(app, "server")  # the console's page at / (console_api.py)
    app.include_router(console_api.router)  # the console's read-only JSON routes
    app.include_router(metrics_route.router)  # GET /metrics, Prometheus' text format, operators only
    app.include_router(openai_routes.router)  # /v1/chat/completions, /v1/completions, /v1/models
    app.include_router(openai_responses_route.router)  # /v1/responses
    return app


def embedded_app(
    runtime: Runtime | None = None,
    *,
    base_models: list[str],
    data_dir: str | None = None,
    chat_template: str | None = None,
) -> FastAPI:
    """The whole server as an ASGI app for in-process use, over ``runtime`` (or a new one): the
    Tinker routes and the OpenAI-compatible ones, in ``--dev`` mode (any ``tml-`` key is its own
    tenant). E.g. ``openai.AsyncOpenAI(base_url="http://embedded/v1", api_key="tml-me",
    http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app)))``. Its state lives in
    ``data_dir`` (default: the runtime's); ``app.state.server.close()`` ends it."""
    from opentinker.service.runtime import default_data_dir

    folder = data_dir or (runtime.data_dir if runtime is not None else default_data_dir())
    config = ServerConfig(
        data_dir=Path(folder), base_models=tuple(base_models), dev=True, chat_template=chat_template
    )
    return create_app(config, runtime)


async def _watch_gaps(server: Server) -> None:
    while True:
        await asyncio.sleep(min(1.0, server.config.gap_timeout_s / 4))
        server.sequencer.skip_gaps(server.config.gap_timeout_s)


async def _watch_sessions(server: Server) -> None:
    """Evict the models of sessions gone quiet (their state saved first; see registry)."""
    period = min(5.0, max(0.5, server.config.session_inactive_s / 10))
    while True:
        await asyncio.sleep(period)
        try:
            server.registry.evict_idle(server.config.session_inactive_s)
        except Exception:
            log.exception("evicting inactive sessions' models failed")


async def _sweep_checkpoints(server: Server) -> None:
    """Delete expired checkpoints at start-up, then every ``checkpoint_sweep_s``."""
    while True:
        try:
            in_use = server.registry.in_use_checkpoints()
            await asyncio.to_thread(server.checkpoints.sweep, in_use)
        except Exception:
            log.exception("checkpoint sweep failed")
        await asyncio.sleep(server.config.checkpoint_sweep_s)
