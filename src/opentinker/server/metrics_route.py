"""``GET /metrics``: the server's :class:`~opentinker.server.metrics.ServerMetrics` in Prometheus'
text format, for an operator (a tenant named by ``--operator``): 401 without a valid key, 403 for
any other tenant's. The key comes as ``X-API-Key`` or ``Authorization: Bearer <key>`` (Prometheus'
scrape config). The series themselves are :mod:`~opentinker.server.metrics`'.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from fastapi.security import APIKeyHeader
from prometheus_client import CONTENT_TYPE_LATEST

from opentinker.server.deps import ServerDep
from opentinker.server.errors import ApiError

_api_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="an operator's tml-… API key")


async def _operator(request: Request, key: Annotated[str | None, Depends(_api_key)]) -> str:
    """The caller's tenant, which must be an operator: 401 without a valid key, 403 otherwise."""
    server = request.app.state.server
    if not key:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else None
    tenant = server.auth.tenant(key)
    if tenant not in server.config.operator_tenants:
        raise ApiError("/metrics needs an operator's key (a tenant named by --operator)", 403)
    return tenant


router = APIRouter()
"""``GET /metrics`` over the server's ``server.metrics``."""


@router.get("/metrics", tags=["admin"], response_class=Response)
async def metrics(server: ServerDep, _: Annotated[str, Depends(_operator)]) -> Response:
    body = await asyncio.to_thread(server.metrics.exposition)  # reads locks the engines hold
    return Response(body, media_type=CONTENT_TYPE_LATEST)
