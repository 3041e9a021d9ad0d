"""The REST checkpoint routes (the SDK's ``RestClient``) under ``/api/v1``: training runs and
their checkpoints, deleting one, weights info, TTLs, publishing, the download URLs of external
weights and the signed-URL file route they point at.

The logic is :mod:`~opentinker.server.checkpoints` (listing, TTLs, publishing: tenant-filtered)
and :mod:`~opentinker.server.downloads` (signed URLs); a deletion is recorded in the audit log.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import FileResponse

from opentinker.server import schemas as S
from opentinker.server.deps import Tenant, api_key
from opentinker.server.state import Server


def add_rest_routes(app: FastAPI, server: Server) -> None:
    ckpts = server.checkpoints
    api = "/api/v1"

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

    _add_checkpoint_routes(app, server)


def _add_checkpoint_routes(app: FastAPI, server: Server) -> None:
    """One checkpoint's TTL, publishing, external-weights URLs and signed downloads."""
    ckpts = server.checkpoints
    api = "/api/v1"
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
        key: Annotated[str | None, Depends(api_key)],
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
