"""The FastAPI app: every route of the Tinker wire protocol under ``/api/v1`` (see PROTOCOL.md).

Routes only authenticate, parse and delegate: :mod:`ops` maps requests onto the embedded clients,
:mod:`checkpoints` serves the REST checkpoint routes, :mod:`futures` answers ``/retrieve_future``.
A pure-ASGI middleware in front enforces the body-size limit (413) and undoes
``Content-Encoding: zstd`` before any route sees a body. OpenAPI docs are at ``/docs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.security import APIKeyHeader
from starlette.exceptions import HTTPException as StarletteHTTPException

from opentinker.client import Runtime
from opentinker.engine import EngineError
from opentinker.server import console
from opentinker.server import schemas as S
from opentinker.server.auth import Authenticator
from opentinker.server.checkpoints import CheckpointApi, reconcile
from opentinker.server.cluster import add_cluster_routes
from opentinker.server.config import ServerConfig
from opentinker.server.console_api import add_console
from opentinker.server.custom_losses import CreateCustomLossRequest
from opentinker.server.downloads import Downloads
from opentinker.server.errors import ApiError, Redactor, error_category, error_message
from opentinker.server.futures import FutureStore
from opentinker.server.lifecycle import (
    CancelFutureRequest,
    FuturesRetrieveRequest,
    JoinSamplingSessionRequest,
    Lifecycle,
    UnloadModelRequest,
)
from opentinker.server.limits import BODY_KEY, BodyLimit
from opentinker.server.ops import Operations
from opentinker.server.ordering import Sequencer
from opentinker.server.projects import AssignProjectRequest, CopyWeightsRequest, ProjectApi, check_project
from opentinker.server.refusals import note_refused
from opentinker.server.registry import Registry, SamplerNotLoaded
from opentinker.server.sessions import SessionApi, SessionSearchRequest
from opentinker.server.signing import UrlSigner
from opentinker.server.store import Store
from opentinker.server.tokens import TokenSigner, load_secret
from opentinker.server.traces import SessionTraces
from opentinker.server.usage import Ledger

log = logging.getLogger(__name__)
PROTO = "application/x-protobuf"
_api_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="a tml-… API key")


async def _tenant(request: Request, key: Annotated[str | None, Depends(_api_key)]) -> str:
    """The tenant of the request's API key (401 without a valid one)."""
    return request.app.state.server.auth.tenant(key)


Tenant = Annotated[str, Depends(_tenant)]
Credential = Annotated[str | None, Depends(_api_key)]


class Server:
    """Everything one server process holds, built from its config (and an optional runtime)."""

    def __init__(self, config: ServerConfig, runtime: Runtime | None = None) -> None:
        self.config = config
        self.runtime = runtime or Runtime(
            config.data_dir,
            device=config.device,
            prefix_cache_bytes=config.prefix_cache_bytes,
            rollout_workers=config.rollout_workers,
            rollout_backend=config.rollout_backend,
            rollout_options=(
                {"max_lora_rank": config.vllm_max_lora_rank} if config.rollout_backend == "vllm" else None
            ),
            ray=config.ray,
            worker_cpus=config.worker_cpus,
            worker_gpus=config.worker_gpus,
            trainer_workers=config.trainer_workers,
            trainer_options={
                "worker_cpus": config.trainer_cpus,
                "worker_gpus": config.trainer_gpus,
                "data_parallel": config.data_parallel,
            },
            auto_restore=config.auto_restore,
        )
        self.store = Store(config.data_dir)
        self.redact = Redactor([config.data_dir, self.runtime.data_dir])  # every message to a client
        signer = (
            TokenSigner(load_secret(config.data_dir), config.token_ttl_s) if config.token_ttl_s > 0 else None
        )
        self.auth = Authenticator(self.store, dev=config.dev, signer=signer)
        self.futures = FutureStore(
            max_pending=config.max_pending_per_tenant, result_ttl_s=config.result_ttl_s
        )
        self.sequencer = Sequencer()
        self.registry = Registry(self.runtime, self.store, self.sequencer, list(config.base_models))
        self.usage = Ledger(self.store.path, self.runtime.store)  # audit log and usage counters
        self.traces = SessionTraces(config.data_dir, self.runtime.tick_record)
        self.ops = Operations(config, self.registry, self.futures, self.sequencer, self.usage, self.traces)
        self.lifecycle = Lifecycle(config, self.registry, self.futures, self.ops)
        self.checkpoints = CheckpointApi(self.runtime.store, self.store, self.runtime.external)
        self.runtime.is_public = self.checkpoints.is_public  # published checkpoints: readable by all
        signer = UrlSigner(config.data_dir)
        self.downloads = Downloads(self.checkpoints, self.runtime.external, signer, self.traces, self.store)
        self.sessions = SessionApi(self.store, config.session_inactive_s)
        self.projects = ProjectApi(self.registry)
        reconcile(self.runtime.store, self.store, self.runtime.external)

    def audit_when_done(self, tenant: str, request_id: str, event: str, **details: Any) -> None:
        """Record ``event`` in the audit log when the request succeeds, with what its result names."""

        def record(result: Any) -> None:
            found = {k: result[k] for k in ("model_id", "path", "sampling_session_id") if k in result}
            if event == "checkpoint_create" and "path" not in found:  # ephemeral sampler weights
                self.usage.record(
                    tenant, "sampler_create", sampler_id=found.get("sampling_session_id"), **details
                )
                return
            extra = {**details, **found}
            if "path" in extra:
                extra["tinker_path"] = extra.pop("path")
            if event == "checkpoint_create":
                row = self.store.checkpoint(extra["tinker_path"])
                if row is not None:
                    extra |= {"size_bytes": row.size_bytes, "base_model": row.meta.get("base_model")}
                    extra |= {"session_id": row.model_id.split(":train:", 1)[0]}
            self.usage.record(tenant, event, **extra)

        self.usage.after(f"{request_id}:{event}", self.futures.future_of(request_id), record)

    def close(self) -> None:
        self.runtime.shutdown()
        self.usage.close()
        self.store.close()


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
        await refused(request, 400)
        return JSONResponse({"detail": server.redact(error_message(exc))}, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        await refused(request, 422)
        return await request_validation_exception_handler(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        await refused(request, exc.status_code)  # e.g. 404: a route this server does not serve
        return await http_exception_handler(request, exc)

    _routes(app, server)
    _admin_routes(app, server)
    add_cluster_routes(app, server)  # the operator's rollout-worker reads and scaling (cluster.py)
    add_console(app, server)  # the console at / and its read-only JSON routes (console_api.py)
    return app


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


def _routes(app: FastAPI, server: Server) -> None:
    ops, ckpts, reg = server.ops, server.checkpoints, server.registry
    audit = server.audit_when_done

    api = "/api/v1"

    # ---------------------------------------------------------------- service
    @app.get(f"{api}/healthz", tags=["service"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post(f"{api}/client/config", tags=["service"])
    async def client_config(req: S.ClientConfigRequest, t: Tenant) -> dict[str, Any]:
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

    @app.post(f"{api}/client/dynamic_config", tags=["service"])
    async def client_dynamic_config(req: S.ClientConfigRequest, t: Tenant) -> dict[str, Any]:
        return {"sample_cancel_enabled": True}  # abandoned samples are cancelled (lifecycle.py)

    @app.get(f"{api}/get_server_capabilities", tags=["service"])
    async def capabilities(t: Tenant) -> dict[str, Any]:
        models = []
        for name, base in reg.served.items():
            ctx = reg.base_info(base).max_context
            models.append(
                {"model_name": name, "max_context_length": ctx, "trainable": True, "sampleable": True}
            )
        return {"supported_models": models}

    # ---------------------------------------------------------------- auth
    @app.post(f"{api}/auth/token", tags=["auth"])
    async def auth_token(key: Credential) -> dict[str, str]:
        return {"jwt": server.auth.issue(key)}

    @app.get(f"{api}/auth/apikey/me", tags=["auth"])
    async def apikey_me(key: Credential) -> dict[str, Any]:
        return server.auth.key_info(key)

    @app.delete(f"{api}/auth/apikey/me", tags=["auth"])
    async def apikey_delete(key: Credential) -> dict[str, Any]:
        server.auth.delete_key(key)
        return {}

    @app.post(f"{api}/telemetry", tags=["service"])
    async def telemetry(t: Tenant) -> dict[str, str]:
        return {"status": "accepted"}

    # ---------------------------------------------------------------- sessions
    @app.post(f"{api}/create_session", tags=["sessions"])
    async def create_session(req: S.CreateSessionRequest, t: Tenant) -> dict[str, Any]:
        if req.project_id is not None:
            check_project(req.project_id)
        sess = reg.create_session(t, req.model_dump(mode="json"))
        server.usage.record(t, "session_create", session_id=sess.id, project_id=req.project_id)
        return {"session_id": sess.id, "type": "create_session"}

    @app.post(f"{api}/session_heartbeat", tags=["sessions"])
    async def heartbeat(req: S.SessionHeartbeatRequest, t: Tenant) -> dict[str, Any]:
        sess = reg.session(t, req.session_id)
        reg.touch(sess.id, server.store.touch_session, sess.id)
        return {"type": "session_heartbeat"}

    @app.post(f"{api}/sessions/{{session_id}}/finish", tags=["sessions"])
    async def finish(session_id: str, req: S.FinishSessionRequest, t: Tenant) -> dict[str, Any]:
        sess = reg.session(t, session_id, live=False)
        if not sess.finished:
            reg.finish_session(sess, str((req.reason or {}).get("type", "unknown")))
            server.usage.record(t, "session_finish", session_id=sess.id)
        return {}

    @app.get(f"{api}/sessions", tags=["sessions"])
    async def list_sessions(
        t: Tenant,
        limit: Annotated[int, Query(ge=1, le=1000)] = 20,
        offset: Annotated[int, Query(ge=0)] = 0,
        access_scope: S.AccessScope = "owned",
    ) -> dict[str, Any]:
        return server.sessions.list(t, limit, offset)

    @app.post(f"{api}/sessions/search", tags=["sessions"])
    async def search_sessions(req: SessionSearchRequest, t: Tenant) -> dict[str, Any]:
        return server.sessions.search(t, req)

    @app.get(f"{api}/sessions/{{session_id}}", tags=["sessions"])
    async def get_session(
        session_id: str, t: Tenant, access_scope: S.AccessScope = "owned"
    ) -> dict[str, Any]:
        return server.sessions.get(t, session_id)

    @app.get(f"{api}/sessions/{{session_id}}/trace_export", tags=["sessions"])
    async def trace_export(session_id: str, request: Request, t: Tenant) -> dict[str, Any]:
        server.sessions.get(t, session_id)  # another tenant's session is unknown (404)
        return await asyncio.to_thread(server.downloads.trace_url, t, str(request.base_url), session_id)

    @app.put(f"{api}/sessions/{{session_id}}/project", tags=["sessions"])
    async def assign_project(session_id: str, req: AssignProjectRequest, t: Tenant) -> dict[str, Any]:
        server.projects.assign(t, session_id, req)
        server.usage.record(t, "project_session_assign", session_id=session_id, project_id=req.project_id)
        return {}

    @app.post(f"{api}/copy_weights", tags=["checkpoints"])
    async def copy_weights(
        req: CopyWeightsRequest,
        t: Tenant,
        idempotency_key: Annotated[str | None, Header(alias="X-Idempotency-Key")] = None,
    ) -> dict[str, Any]:
        answer = await asyncio.to_thread(server.projects.copy_weights, t, req, idempotency_key)
        server.usage.record(t, "checkpoint_copy", source=req.source_path, tinker_path=answer["tinker_path"])
        return answer

    # ---------------------------------------------------------------- training
    @app.post(f"{api}/create_model", tags=["training"])
    async def create_model(req: S.CreateModelRequest, t: Tenant) -> dict[str, Any]:
        rid = ops.create_model(t, req)
        audit(t, rid, "training_run_create", session_id=req.session_id, base_model=req.base_model)
        return {"request_id": rid}

    @app.post(f"{api}/get_info", tags=["training"])
    async def get_info(req: S.GetInfoRequest, t: Tenant) -> dict[str, Any]:
        return ops.get_info(t, req.model_id)

    @app.post(
        f"{api}/forward_backward",
        tags=["training"],
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {PROTO: {"schema": {"type": "string", "format": "binary"}}},
            }
        },
        summary="forward_backward / forward (protobuf ForwardBackwardRequest; forward_only=true for forward)",
    )
    async def forward_backward(request: Request, t: Tenant) -> dict[str, Any]:
        return {"request_id": ops.forward_backward(t, await request.body())}

    @app.post(f"{api}/create_custom_loss", tags=["training"])
    async def create_custom_loss(req: CreateCustomLossRequest, t: Tenant) -> dict[str, Any]:
        return {"request_id": ops.create_custom_loss(t, req)}

    @app.post(f"{api}/optim_step", tags=["training"])
    async def optim_step(req: S.OptimStepRequest, t: Tenant) -> dict[str, Any]:
        return {"request_id": ops.optim_step(t, req)}

    @app.post(f"{api}/save_weights", tags=["checkpoints"])
    async def save_weights(req: S.SaveWeightsRequest, t: Tenant) -> dict[str, Any]:
        rid = ops.save_weights(t, req)
        audit(t, rid, "checkpoint_create", model_id=req.model_id)
        return {"request_id": rid}

    @app.post(f"{api}/save_weights_for_sampler", tags=["checkpoints"])
    async def save_weights_for_sampler(req: S.SaveWeightsForSamplerRequest, t: Tenant) -> dict[str, Any]:
        rid = ops.save_weights_for_sampler(t, req)
        audit(t, rid, "checkpoint_create", model_id=req.model_id)  # or sampler_create (ephemeral)
        return {"request_id": rid}

    @app.post(f"{api}/save_weights_external", tags=["checkpoints"])
    async def save_weights_external(req: S.SaveWeightsExternalRequest, t: Tenant) -> dict[str, Any]:
        return {"request_id": ops.save_weights_external(t, req)}

    @app.post(f"{api}/load_weights", tags=["checkpoints"])
    async def load_weights(req: S.LoadWeightsRequest, t: Tenant) -> dict[str, Any]:
        rid = ops.load_weights(t, req)
        if req.session_id is not None:  # a new training run from the checkpoint
            audit(t, rid, "training_run_create", session_id=req.session_id, from_checkpoint=req.path)
        audit(t, rid, "checkpoint_read", model_id=req.model_id, tinker_path=req.path, purpose="load_weights")
        return {"request_id": rid}

    # ---------------------------------------------------------------- sampling
    @app.post(f"{api}/create_sampling_session", tags=["sampling"])
    async def create_sampling_session(req: S.CreateSamplingSessionRequest, t: Tenant) -> dict[str, Any]:
        make = ops.create_sampling_session(t, req)
        sampler_id = await asyncio.to_thread(make)
        if req.model_path is not None:
            server.usage.record(t, "checkpoint_read", tinker_path=req.model_path, purpose="sampling")
        server.usage.record(t, "sampler_create", sampler_id=sampler_id, base_model=req.base_model)
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    @app.get(f"{api}/samplers/{{sampler_id}}", tags=["sampling"])
    async def get_sampler(sampler_id: str, t: Tenant) -> dict[str, Any]:
        return ops.get_sampler(t, sampler_id)

    @app.post(f"{api}/asample", tags=["sampling"])
    async def asample(req: S.SampleRequest, t: Tenant) -> dict[str, Any]:
        try:
            return ops.asample(t, req)
        except SamplerNotLoaded as e:  # a sampler of an earlier server process: load it once
            await asyncio.to_thread(reg.reload_sampler, e.row)
            return ops.asample(t, req)

    # ---------------------------------------------------------------- futures
    @app.post(f"{api}/retrieve_future", tags=["futures"])
    async def retrieve_future(req: S.FutureRetrieveRequest, t: Tenant) -> Response:
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

    @app.post(f"{api}/cancel_future", tags=["futures"])
    async def cancel_future(req: CancelFutureRequest, t: Tenant) -> dict[str, Any]:
        return server.lifecycle.cancel_future(t, req)

    @app.post(f"{api}/retrieve_futures", tags=["futures"])
    async def retrieve_futures(req: FuturesRetrieveRequest, t: Tenant) -> dict[str, Any]:
        return await server.lifecycle.retrieve_futures(t, req)

    @app.post(f"{api}/join_sampling_session", tags=["sampling"])
    async def join_sampling_session(req: JoinSamplingSessionRequest, t: Tenant) -> dict[str, Any]:
        return server.lifecycle.join_sampling_session(t, req)

    @app.post(f"{api}/unload_model", tags=["training"])
    async def unload_model(req: UnloadModelRequest, t: Tenant) -> dict[str, Any]:
        return server.lifecycle.unload_model(t, req)

    # ---------------------------------------------------------------- checkpoints (REST)
    @app.get(f"{api}/training_runs", tags=["checkpoints"])
    async def training_runs(
        t: Tenant,
        limit: Annotated[int, Query(ge=1, le=1000)] = 20,
        offset: Annotated[int, Query(ge=0)] = 0,
        project_id: str | None = None,
    ) -> dict[str, Any]:
        return ckpts.training_runs(t, limit, offset, project_id)

    @app.get(f"{api}/training_runs/{{model_id}}", tags=["checkpoints"])
    async def training_run(model_id: str, t: Tenant) -> dict[str, Any]:
        return ckpts.training_run(t, model_id)

    @app.get(f"{api}/training_runs/{{model_id}}/checkpoints", tags=["checkpoints"])
    async def list_checkpoints(model_id: str, t: Tenant) -> dict[str, Any]:
        return ckpts.checkpoints(t, model_id)

    @app.delete(f"{api}/training_runs/{{model_id}}/checkpoints/{{kind}}/{{name}}", tags=["checkpoints"])
    async def delete_checkpoint(model_id: str, kind: str, name: str, t: Tenant) -> dict[str, Any]:
        row = server.store.checkpoint(f"tinker://{model_id}/{kind}/{name}")
        ckpts.delete(t, model_id, kind, name)
        if row is not None:  # delete refused any checkpoint but the tenant's own
            server.usage.record(
                t,
                "checkpoint_delete",
                model_id=model_id,
                tinker_path=row.tinker_path,
                created=row.created,
                size_bytes=row.size_bytes,
                base_model=row.meta.get("base_model"),
            )
        return {}

    @app.post(f"{api}/weights_info", tags=["checkpoints"])
    async def weights_info(req: S.WeightsInfoRequest, t: Tenant) -> dict[str, Any]:
        return ckpts.weights_info(t, req.tinker_path)

    @app.get(f"{api}/checkpoints", tags=["checkpoints"])
    async def user_checkpoints(
        t: Tenant, limit: Annotated[int, Query(ge=1, le=1000)] = 100, offset: Annotated[int, Query(ge=0)] = 0
    ) -> dict[str, Any]:
        return ckpts.user_checkpoints(t, limit, offset)

    ckpt = f"{api}/training_runs/{{model_id}}/checkpoints/{{kind}}/{{name}}"

    @app.put(f"{ckpt}/ttl", tags=["checkpoints"])
    async def set_ttl(model_id: str, kind: str, name: str, req: S.CheckpointTtlRequest, t: Tenant) -> None:
        ckpts.set_ttl(t, model_id, kind, name, req.ttl_seconds)

    @app.post(f"{ckpt}/publish", tags=["checkpoints"])
    async def publish(model_id: str, kind: str, name: str, t: Tenant) -> None:
        ckpts.publish(t, model_id, kind, name, True)

    @app.delete(f"{ckpt}/publish", tags=["checkpoints"])
    async def unpublish(model_id: str, kind: str, name: str, t: Tenant) -> None:
        ckpts.publish(t, model_id, kind, name, False)

    @app.get(f"{ckpt}/external_weights_urls", tags=["checkpoints"])
    async def external_weights_urls(
        model_id: str, kind: str, name: str, request: Request, t: Tenant
    ) -> dict[str, Any]:
        return server.downloads.urls(t, str(request.base_url), model_id, kind, name)

    @app.get(f"{api}/downloads/{{model_id}}/{{kind}}/{{name}}/{{file}}", tags=["checkpoints"])
    async def download(
        model_id: str,
        kind: str,
        name: str,
        file: str,
        key: Annotated[str | None, Depends(_api_key)],
        tenant: str = "",
        expires: str = "",
        sig: str = "",
    ) -> FileResponse:
        """A file behind a signed URL (no API key needed; one of another tenant is refused)."""
        caller = server.auth.tenant(key) if key else None
        found = server.downloads.file(
            model_id, kind, name, file, tenant=tenant, expires=expires, sig=sig, caller=caller
        )
        return FileResponse(found, media_type="application/octet-stream", filename=file)


def _admin_routes(app: FastAPI, server: Server) -> None:
    """The organization-admin reads (``AdminClient``) and the console pages; see :mod:`usage`."""
    api, usage = "/api/v1", server.usage

    @app.get(f"{api}/audit", tags=["admin"])
    async def audit_log(t: Tenant, event_type: str = "all", day: str | None = None) -> dict[str, Any]:
        return usage.audit_log(t, event_type, day)

    @app.get(f"{api}/billing/usage/events", tags=["admin"])
    async def billing_usage(t: Tenant, starting_on: str, ending_before: str) -> dict[str, Any]:
        return usage.billing_usage(t, starting_on, ending_before)

    @app.get(f"{api}/billing/usage/checkpoints/current", tags=["admin"])
    async def storage_usage(t: Tenant, project_id: str | None = None) -> dict[str, Any]:
        return await asyncio.to_thread(usage.storage_now, t, project_id)  # it walks the folders

    def viewer(key: str | None) -> str | None:
        try:
            return server.auth.tenant(key) if key else None
        except ApiError:
            return None

    @app.get("/sessions", tags=["console"], include_in_schema=False)
    async def console_sessions() -> Response:
        return console.page("sessions", "all sessions", None, f"{api}/sessions")

    @app.get("/sessions/{session_id}", tags=["console"], include_in_schema=False)
    async def console_session(session_id: str, key: Annotated[str | None, Depends(_api_key)]) -> Response:
        row, who = server.store.session(session_id), viewer(key)
        facts = None
        if row is not None and row.tenant == who:
            facts = [("owner", row.tenant), ("finished", row.finished or "no")]
        return console.page("session", session_id, facts, console.api_path("sessions", session_id))

    @app.get("/training_runs/{model_id}", tags=["console"], include_in_schema=False)
    async def console_run(model_id: str, key: Annotated[str | None, Depends(_api_key)]) -> Response:
        who, facts = viewer(key), None
        if who is not None:
            with contextlib.suppress(ApiError):
                run = server.checkpoints.training_run(who, model_id)
                facts = [(k, str(v)) for k, v in run.items() if v is not None and not isinstance(v, dict)]
        return console.page("training run", model_id, facts, console.api_path("training_runs", model_id))

    @app.get("/checkpoints/{model_id}/{checkpoint_id:path}", tags=["console"], include_in_schema=False)
    async def console_checkpoint(
        model_id: str, checkpoint_id: str, key: Annotated[str | None, Depends(_api_key)]
    ) -> Response:
        who, facts = viewer(key), None
        path = f"tinker://{model_id}/{checkpoint_id}"
        row = server.store.checkpoint(path)
        if row is not None and row.tenant == who:
            facts = [("tinker_path", path), ("size_bytes", str(row.size_bytes))]
        return console.page("checkpoint", path, facts, console.api_path("training_runs", model_id))
