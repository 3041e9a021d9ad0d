"""The operator's cluster routes: read and scale the rollout workers of a running server.

    GET  /api/v1/cluster                          the workers now, per base model
    POST /api/v1/cluster/scale {"rollout_workers": K}

Only a key of a tenant named by ``--operator`` may call them (403 otherwise). A scale answers once
it is done: new workers serve (they get the current snapshots on first use), removed ones have
drained (their running requests finished). A request below one worker, or for more workers than
the cluster can place, is refused at once with 400 and nothing changes; a worker that fails to
start answers 503 naming it, and the pool stays as it was. ``opentinker cluster`` is the client.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.security import APIKeyHeader
from pydantic import BaseModel, ConfigDict

from opentinker.server.errors import ApiError

_api_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="an operator's tml-… API key")


async def _operator(request: Request, key: Annotated[str | None, Depends(_api_key)]) -> str:
    """The caller's tenant, which must be an operator (401 without a valid key, 403 otherwise)."""
    server = request.app.state.server
    tenant = server.auth.tenant(key)
    if tenant not in server.config.operator_tenants:
        raise ApiError("the cluster routes need an operator's key (a tenant named by --operator)", 403)
    return tenant


Operator = Annotated[str, Depends(_operator)]


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rollout_workers: int


def add_cluster_routes(app: FastAPI, server: Any) -> None:
    """The routes over ``server`` (``opentinker.server.app.Server``)."""
    api = "/api/v1/cluster"

    @app.get(api, tags=["admin"])
    async def cluster_info(_: Operator) -> dict[str, Any]:
        return server.runtime.rollout_workers_info()

    @app.post(f"{api}/scale", tags=["admin"])
    async def cluster_scale(body: ScaleRequest, _: Operator) -> dict[str, Any]:
        try:
            counts = await asyncio.to_thread(server.runtime.scale_rollout_workers, body.rollout_workers)
        except ValueError as e:
            raise ApiError(server.redact(str(e)), 400) from None
        except TimeoutError as e:
            raise ApiError(server.redact(str(e)), 504) from None
        except RuntimeError as e:  # a worker could not start: named, the pool unchanged
            raise ApiError(server.redact(str(e)), 503) from None
        return {"rollout_workers": counts, **server.runtime.rollout_workers_info()}
