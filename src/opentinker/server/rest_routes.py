"""The REST checkpoint routes (the SDK's ``RestClient``) under ``/api/v1``: training runs and
their checkpoints, deleting one, weights info, TTLs, publishing, the download URLs of external
weights and the signed-URL file route they point at; SDK 0.39's external weights upload (its
start, signed PUTs and finish: :mod:`~opentinker.server.weights_upload`).

The logic is :mod:`~opentinker.server.checkpoints` (listing, TTLs, publishing: tenant-filtered)
and :mod:`~opentinker.server.downloads` (signed URLs); a deletion is recorded in the audit log.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse

from opentinker.server import schemas as S
from opentinker.server.deps import ServerDep, Tenant, api_key
from opentinker.server.signing import UPLOAD_ROUTE
from opentinker.server.weights_upload import UploadFinishRequest, UploadStartRequest

API = "/api/v1"
CKPT = f"{API}/training_runs/{{model_id}}/checkpoints/{{kind}}/{{name}}"
router = APIRouter()


@router.get(f"{API}/training_runs", tags=["checkpoints"])
async def training_runs(
    server: ServerDep,
    t: Tenant,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    offset: Annotated[int, Query(ge=0)] = 0,
    project_id: str | None = None,
) -> dict[str, Any]:
    return server.checkpoints.training_runs(t, limit, offset, project_id)


@router.get(f"{API}/training_runs/{{model_id}}", tags=["checkpoints"])
async def training_run(server: ServerDep, model_id: str, t: Tenant) -> dict[str, Any]:
    return server.checkpoints.training_run(t, model_id)


@router.get(f"{API}/training_runs/{{model_id}}/checkpoints", tags=["checkpoints"])
async def list_checkpoints(server: ServerDep, model_id: str, t: Tenant) -> dict[str, Any]:
    return server.checkpoints.checkpoints(t, model_id)


@router.delete(f"{API}/training_runs/{{model_id}}/checkpoints/{{kind}}/{{name}}", tags=["checkpoints"])
async def delete_checkpoint(
    server: ServerDep, model_id: str, kind: str, name: str, t: Tenant
) -> dict[str, Any]:
    row = server.store.checkpoint(f"tinker://{model_id}/{kind}/{name}")
    server.checkpoints.delete(t, model_id, kind, name)
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


@router.post(f"{API}/weights_info", tags=["checkpoints"])
async def weights_info(server: ServerDep, req: S.WeightsInfoRequest, t: Tenant) -> dict[str, Any]:
    return server.checkpoints.weights_info(t, req.tinker_path)


@router.get(f"{API}/checkpoints", tags=["checkpoints"])
async def user_checkpoints(
    server: ServerDep,
    t: Tenant,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> dict[str, Any]:
    return server.checkpoints.user_checkpoints(t, limit, offset)


# one checkpoint's TTL, publishing, external-weights URLs and signed downloads


@router.put(f"{CKPT}/ttl", tags=["checkpoints"])
async def set_ttl(
    server: ServerDep, model_id: str, kind: str, name: str, req: S.CheckpointTtlRequest, t: Tenant
) -> None:
    server.checkpoints.set_ttl(t, model_id, kind, name, req.ttl_seconds)


@router.post(f"{CKPT}/publish", tags=["checkpoints"])
async def publish(server: ServerDep, model_id: str, kind: str, name: str, t: Tenant) -> None:
    server.checkpoints.publish(t, model_id, kind, name, True)


@router.delete(f"{CKPT}/publish", tags=["checkpoints"])
async def unpublish(server: ServerDep, model_id: str, kind: str, name: str, t: Tenant) -> None:
    server.checkpoints.publish(t, model_id, kind, name, False)


@router.get(f"{CKPT}/external_weights_urls", tags=["checkpoints"])
async def external_weights_urls(
    server: ServerDep, model_id: str, kind: str, name: str, request: Request, t: Tenant
) -> dict[str, Any]:
    return server.downloads.urls(t, str(request.base_url), model_id, kind, name)


@router.get(f"{API}/downloads/{{model_id}}/{{kind}}/{{name}}/{{file}}", tags=["checkpoints"])
async def download(
    server: ServerDep,
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


# SDK 0.39's external weights upload (server/weights_upload.py)


@router.post("/api/v1/external_weights_upload_start", tags=["checkpoints"])
async def upload_start(
    server: ServerDep, req: UploadStartRequest, request: Request, t: Tenant
) -> dict[str, Any]:
    return await asyncio.to_thread(server.uploads.start, t, str(request.base_url), req)


@router.put(f"{UPLOAD_ROUTE}/{{upload_id}}/{{file}}", tags=["checkpoints"])
async def upload_file(
    server: ServerDep,
    upload_id: str,
    file: str,
    request: Request,
    tenant: str = "",
    expires: str = "",
    sig: str = "",
) -> dict[str, Any]:
    """A file of an upload, behind its signed PUT URL (no API key needed)."""
    body = await request.body()
    await asyncio.to_thread(server.uploads.put, upload_id, file, tenant, expires, sig, body)
    return {}


@router.post("/api/v1/external_weights_upload_finish", tags=["checkpoints"])
async def upload_finish(server: ServerDep, req: UploadFinishRequest, t: Tenant) -> dict[str, Any]:
    return await asyncio.to_thread(server.uploads.finish, t, req)
