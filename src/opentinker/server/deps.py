"""The routes' request dependencies: the ``X-API-Key`` header (a key or a token from
``/auth/token``) and the tenant it authenticates (:mod:`~opentinker.server.auth`).

A route that takes :data:`Tenant` answers 401 without a valid credential; one that takes
:data:`Credential` (or ``Depends(api_key)``) gets the header as sent, or None. The routes are
module-level ``APIRouter``s; one that takes :data:`ServerDep` gets the app's
:class:`~opentinker.server.state.Server` (``app.state.server``, set by ``create_app``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader

if TYPE_CHECKING:
    from opentinker.server.state import Server

api_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="a tml-… API key")


async def tenant_of(request: Request, key: Annotated[str | None, Depends(api_key)]) -> str:
    """The tenant of the request's API key (401 without a valid one)."""
    return request.app.state.server.auth.tenant(key)


Tenant = Annotated[str, Depends(tenant_of)]
Credential = Annotated[str | None, Depends(api_key)]


async def current_server(request: Request) -> Server:
    """The app's :class:`~opentinker.server.state.Server` (everything the process holds)."""
    return request.app.state.server


ServerDep = Annotated["Server", Depends(current_server)]
