"""The operator's cluster routes: read and scale the rollout and trainer workers of a running server.

    GET  /api/v1/cluster                          the workers now, per base model
    POST /api/v1/cluster/scale {"rollout_workers": K, "trainer_workers": T}   (either or both)

Only a key of a tenant named by ``--operator`` may call them (403 otherwise). A scale answers once
it is done: new rollout workers serve (they get the current snapshots on first use), removed ones
have drained (their running requests finished); new trainer workers take new models, removed ones
have handed each of their models over to another worker (its whole state, without losing a step)
and stopped. A request below one worker, for more workers than the cluster has free, or with no
or unknown fields, is refused at once with 400 (422 for a malformed body) and nothing changes;
both counts are checked before either scale starts, each alone and together (the new workers of
both kinds must fit in what the Ray cluster has free). A worker that fails to start, or a model that
could not be handed over, answers 503 naming it. ``opentinker cluster`` is the client.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.security import APIKeyHeader
from pydantic import BaseModel, ConfigDict

from opentinker.server.deps import ServerDep
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
    rollout_workers: int | None = None
    trainer_workers: int | None = None


API = "/api/v1/cluster"
router = APIRouter()


@router.get(API, tags=["admin"])
async def cluster_info(server: ServerDep, _: Operator) -> dict[str, Any]:
    return await asyncio.to_thread(server.runtime.scaleout.rollout_workers_info)


@router.post(f"{API}/scale", tags=["admin"])
async def cluster_scale(server: ServerDep, body: ScaleRequest, _: Operator) -> dict[str, Any]:
    rollout, trainer = body.rollout_workers, body.trainer_workers
    if rollout is None and trainer is None:
        raise ApiError("give rollout_workers and/or trainer_workers", 400)
    runtime = server.runtime
    out: dict[str, Any] = {}
    try:
        await asyncio.to_thread(runtime.scaleout.check_scale, rollout, trainer)  # both, before either acts
        if rollout is not None:
            out["rollout_workers"] = await asyncio.to_thread(runtime.scaleout.scale_rollout_workers, rollout)
        if trainer is not None:
            out["trainer_scale"] = await asyncio.to_thread(runtime.scaleout.scale_trainer_workers, trainer)
    except ValueError as e:
        raise ApiError(server.redact(str(e)), 400) from None
    except TimeoutError as e:
        raise ApiError(server.redact(str(e)), 504) from None
    except RuntimeError as e:  # a worker could not start, a model not handed over: named
        raise ApiError(server.redact(str(e)), 503) from None
    return {**out, **(await asyncio.to_thread(runtime.scaleout.rollout_workers_info))}
