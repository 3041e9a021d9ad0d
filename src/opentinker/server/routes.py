"""The Tinker SDK's operation routes under ``/api/v1``: service and auth, sessions (and their
projects), training, sampling, and futures (see PROTOCOL.md).

Routes only authenticate (:mod:`~opentinker.server.deps`), parse and delegate: :mod:`ops` maps
requests onto the embedded clients, :mod:`lifecycle` serves batch polling, cancels, sampler joins
and unloads, :mod:`futures` answers ``/retrieve_future``. An operation that runs later answers a
``request_id`` at once; its result comes through ``/retrieve_future`` (or ``/retrieve_futures``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse, Response

from opentinker.server import schemas as S
from opentinker.server.custom_losses import CreateCustomLossRequest
from opentinker.server.deps import Credential, ServerDep, Tenant
from opentinker.server.errors import error_category, error_message
from opentinker.server.lifecycle import (
    CancelFutureRequest,
    FuturesRetrieveRequest,
    JoinSamplingSessionRequest,
    UnloadModelRequest,
)
from opentinker.server.projects import AssignProjectRequest, CopyWeightsRequest, check_project
from opentinker.server.registry import SamplerNotLoaded
from opentinker.server.sessions import SessionSearchRequest

log = logging.getLogger(__name__)
PROTO = "application/x-protobuf"
API = "/api/v1"


router = APIRouter()
"""Every route of the Tinker protocol, one resource after another."""


@router.get(f"{API}/healthz", tags=["service"])
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.post(f"{API}/client/config", tags=["service"])
async def client_config(server: ServerDep, req: S.ClientConfigRequest, t: Tenant) -> dict[str, Any]:
    return {
        "pjwt_auth_enabled": server.auth.signer is not None,
        "credential_default_source": "api_key",
        "parallel_fwdbwd_chunks": True,
        "proto_compress_fwdbwd": False,
        # batch polling (/retrieve_futures) and server-allocated clone ids (lifecycle.py)
        "sample_use_retrieve_futures": server.config.batch_polling,
        "sample_join_sampling_session": True,
        "custom_loss_server_side": True,  # /create_custom_loss (server/custom_losses.py)
    }


@router.post(f"{API}/client/dynamic_config", tags=["service"])
async def client_dynamic_config(req: S.ClientConfigRequest, t: Tenant) -> dict[str, Any]:
    return {"sample_cancel_enabled": True}  # abandoned samples are cancelled (lifecycle.py)


@router.get(f"{API}/get_server_capabilities", tags=["service"])
async def capabilities(server: ServerDep, t: Tenant) -> dict[str, Any]:
    models = []
    for name, base in server.registry.served.items():
        ctx = server.registry.base_info(base).max_context
        models.append({"model_name": name, "max_context_length": ctx, "trainable": True, "sampleable": True})
    return {"supported_models": models}


@router.post(f"{API}/auth/token", tags=["auth"])
async def auth_token(server: ServerDep, key: Credential) -> dict[str, str]:
    return {"jwt": server.auth.issue(key)}


@router.get(f"{API}/auth/apikey/me", tags=["auth"])
async def apikey_me(server: ServerDep, key: Credential) -> dict[str, Any]:
    return server.auth.key_info(key)


@router.delete(f"{API}/auth/apikey/me", tags=["auth"])
async def apikey_delete(server: ServerDep, key: Credential) -> dict[str, Any]:
    server.auth.delete_key(key)
    return {}


@router.post(f"{API}/telemetry", tags=["service"])
async def telemetry(t: Tenant) -> dict[str, str]:
    return {"status": "accepted"}


@router.post(f"{API}/create_session", tags=["sessions"])
async def create_session(server: ServerDep, req: S.CreateSessionRequest, t: Tenant) -> dict[str, Any]:
    if req.project_id is not None:
        check_project(req.project_id)
    sess = server.registry.create_session(t, req.model_dump(mode="json"))
    server.usage.record(t, "session_create", session_id=sess.id, project_id=req.project_id)
    return {"session_id": sess.id, "type": "create_session"}


@router.post(f"{API}/session_heartbeat", tags=["sessions"])
async def heartbeat(server: ServerDep, req: S.SessionHeartbeatRequest, t: Tenant) -> dict[str, Any]:
    sess = server.registry.session(t, req.session_id)
    server.registry.seen(sess.id)
    return {"type": "session_heartbeat"}


@router.post(f"{API}/sessions/{{session_id}}/finish", tags=["sessions"])
async def finish(
    server: ServerDep, session_id: str, req: S.FinishSessionRequest, t: Tenant
) -> dict[str, Any]:
    sess = server.registry.session(t, session_id, live=False)
    if not sess.finished:
        server.registry.finish_session(sess, str((req.reason or {}).get("type", "unknown")))
        server.usage.record(t, "session_finish", session_id=sess.id)
    return {}


@router.get(f"{API}/sessions", tags=["sessions"])
async def list_sessions(
    server: ServerDep,
    t: Tenant,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    offset: Annotated[int, Query(ge=0)] = 0,
    access_scope: S.AccessScope = "owned",
) -> dict[str, Any]:
    return server.sessions.list(t, limit, offset)


@router.post(f"{API}/sessions/search", tags=["sessions"])
async def search_sessions(server: ServerDep, req: SessionSearchRequest, t: Tenant) -> dict[str, Any]:
    return server.sessions.search(t, req)


@router.get(f"{API}/sessions/{{session_id}}", tags=["sessions"])
async def get_session(
    server: ServerDep, session_id: str, t: Tenant, access_scope: S.AccessScope = "owned"
) -> dict[str, Any]:
    return server.sessions.get(t, session_id)


@router.get(f"{API}/sessions/{{session_id}}/trace_export", tags=["sessions"])
async def trace_export(server: ServerDep, session_id: str, request: Request, t: Tenant) -> dict[str, Any]:
    server.sessions.get(t, session_id)  # another tenant's session is unknown (404)
    return await asyncio.to_thread(server.downloads.trace_url, t, str(request.base_url), session_id)


@router.put(f"{API}/sessions/{{session_id}}/project", tags=["sessions"])
async def assign_project(
    server: ServerDep, session_id: str, req: AssignProjectRequest, t: Tenant
) -> dict[str, Any]:
    server.projects.assign(t, session_id, req)
    server.usage.record(t, "project_session_assign", session_id=session_id, project_id=req.project_id)
    return {}


@router.post(f"{API}/copy_weights", tags=["checkpoints"])
async def copy_weights(
    server: ServerDep,
    req: CopyWeightsRequest,
    t: Tenant,
    idempotency_key: Annotated[str | None, Header(alias="X-Idempotency-Key")] = None,
) -> dict[str, Any]:
    answer = await asyncio.to_thread(server.projects.copy_weights, t, req, idempotency_key)
    server.usage.record(t, "checkpoint_copy", source=req.source_path, tinker_path=answer["tinker_path"])
    return answer


@router.post(f"{API}/create_model", tags=["training"])
async def create_model(server: ServerDep, req: S.CreateModelRequest, t: Tenant) -> dict[str, Any]:
    rid = server.ops.create_model(t, req)
    server.audit_when_done(
        t, rid, "training_run_create", session_id=req.session_id, base_model=req.base_model
    )
    return {"request_id": rid}


@router.post(f"{API}/get_info", tags=["training"])
async def get_info(server: ServerDep, req: S.GetInfoRequest, t: Tenant) -> dict[str, Any]:
    return server.ops.get_info(t, req.model_id)


@router.post(
    f"{API}/forward_backward",
    tags=["training"],
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {PROTO: {"schema": {"type": "string", "format": "binary"}}},
        }
    },
    summary="forward_backward / forward (protobuf ForwardBackwardRequest; forward_only=true for forward)",
)
async def forward_backward(server: ServerDep, request: Request, t: Tenant) -> dict[str, Any]:
    return {"request_id": server.ops.forward_backward(t, await request.body())}


@router.post(f"{API}/create_custom_loss", tags=["training"])
async def create_custom_loss(server: ServerDep, req: CreateCustomLossRequest, t: Tenant) -> dict[str, Any]:
    return {"request_id": server.ops.create_custom_loss(t, req)}


@router.post(f"{API}/optim_step", tags=["training"])
async def optim_step(server: ServerDep, req: S.OptimStepRequest, t: Tenant) -> dict[str, Any]:
    return {"request_id": server.ops.optim_step(t, req)}


@router.post(f"{API}/save_weights", tags=["checkpoints"])
async def save_weights(server: ServerDep, req: S.SaveWeightsRequest, t: Tenant) -> dict[str, Any]:
    rid = server.ops.save_weights(t, req)
    server.audit_when_done(t, rid, "checkpoint_create", model_id=req.model_id)
    return {"request_id": rid}


@router.post(f"{API}/save_weights_for_sampler", tags=["checkpoints"])
async def save_weights_for_sampler(
    server: ServerDep, req: S.SaveWeightsForSamplerRequest, t: Tenant
) -> dict[str, Any]:
    rid = server.ops.save_weights_for_sampler(t, req)
    server.audit_when_done(
        t, rid, "checkpoint_create", model_id=req.model_id
    )  # or sampler_create (ephemeral)
    return {"request_id": rid}


@router.post(f"{API}/save_weights_external", tags=["checkpoints"])
async def save_weights_external(
    server: ServerDep, req: S.SaveWeightsExternalRequest, t: Tenant
) -> dict[str, Any]:
    return {"request_id": server.ops.save_weights_external(t, req)}


@router.post(f"{API}/load_weights", tags=["checkpoints"])
async def load_weights(server: ServerDep, req: S.LoadWeightsRequest, t: Tenant) -> dict[str, Any]:
    rid = server.ops.load_weights(t, req)
    if req.session_id is not None:  # a new training run from the checkpoint
        server.audit_when_done(
            t, rid, "training_run_create", session_id=req.session_id, from_checkpoint=req.path
        )
    server.audit_when_done(
        t, rid, "checkpoint_read", model_id=req.model_id, tinker_path=req.path, purpose="load_weights"
    )
    return {"request_id": rid}


@router.post(f"{API}/create_sampling_session", tags=["sampling"])
async def create_sampling_session(
    server: ServerDep, req: S.CreateSamplingSessionRequest, t: Tenant
) -> dict[str, Any]:
    make = server.ops.create_sampling_session(t, req)
    sampler_id = await asyncio.to_thread(make)
    if req.model_path is not None:
        server.usage.record(t, "checkpoint_read", tinker_path=req.model_path, purpose="sampling")
    server.usage.record(t, "sampler_create", sampler_id=sampler_id, base_model=req.base_model)
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}


@router.get(f"{API}/samplers/{{sampler_id}}", tags=["sampling"])
async def get_sampler(server: ServerDep, sampler_id: str, t: Tenant) -> dict[str, Any]:
    return server.ops.get_sampler(t, sampler_id)


@router.post(f"{API}/asample", tags=["sampling"])
async def asample(server: ServerDep, req: S.SampleRequest, t: Tenant) -> dict[str, Any]:
    try:
        return server.ops.asample(t, req)
    except SamplerNotLoaded as e:  # a sampler of an earlier server process: load it once
        await asyncio.to_thread(server.registry.reload_sampler, e.row)
        return server.ops.asample(t, req)


@router.post(f"{API}/retrieve_future", tags=["futures"])
async def retrieve_future(server: ServerDep, req: S.FutureRetrieveRequest, t: Tenant) -> Response:
    state, fut = await server.futures.wait(req.request_id, t, server.config.poll_timeout_s)
    if state == "unknown":
        msg = f"request {req.request_id!r} is unknown or lost (server restarted?)"
        return JSONResponse({"error": msg, "category": "user"})
    if state == "pending" or fut is None:
        queue_state, reason = server.futures.queue_state(req.request_id)
        answer = {"type": "try_again", "request_id": req.request_id, "queue_state": queue_state}
        return JSONResponse(answer if reason is None else {**answer, "queue_state_reason": reason})
    exc = fut.exception()
    if exc is not None:
        if error_category(exc) == "server":
            log.error("request %s failed", req.request_id, exc_info=exc)
        message = server.redact(error_message(exc))
        return JSONResponse({"error": message, "category": error_category(exc)})
    result = fut.result()
    if isinstance(result, bytes):
        return Response(result, media_type=PROTO)
    return JSONResponse(result)


@router.post(f"{API}/cancel_future", tags=["futures"])
async def cancel_future(server: ServerDep, req: CancelFutureRequest, t: Tenant) -> dict[str, Any]:
    return server.lifecycle.cancel_future(t, req)


@router.post(f"{API}/retrieve_futures", tags=["futures"])
async def retrieve_futures(server: ServerDep, req: FuturesRetrieveRequest, t: Tenant) -> dict[str, Any]:
    return await server.lifecycle.retrieve_futures(t, req)


@router.post(f"{API}/join_sampling_session", tags=["sampling"])
async def join_sampling_session(
    server: ServerDep, req: JoinSamplingSessionRequest, t: Tenant
) -> dict[str, Any]:
    return server.lifecycle.join_sampling_session(t, req)


@router.post(f"{API}/unload_model", tags=["training"])
async def unload_model(server: ServerDep, req: UnloadModelRequest, t: Tenant) -> dict[str, Any]:
    return server.lifecycle.unload_model(t, req)
