"""``search_checkpoints`` as the Tinker SDK 0.39 documents it (``RestClient.search_checkpoints``,
``CheckpointSearchRequest`` / ``CheckpointSearchResponse`` / ``CheckpointSearchCursor``):
``POST /api/v1/checkpoints/search``.

A search sees the caller's own checkpoints only (a tenant is one user in one organization here,
so the owners ``own`` and ``accessible`` name the same checkpoints, and ``user`` matches the
caller's own URN alone, as in ``search_sessions``); another tenant's are never listed, published
or not. The filters, all of which must hold:

- ``project_ids``: the project of the session that made the checkpoint's training run; naming a
  project the caller has no session in is a 404 naming it (the SDK: "an error");
- ``user_metadata``: exact key/value pairs of what the save attached (``save_state(...,
  user_metadata=...)``, kept with the checkpoint's index row);
- ``checkpoint_type``: ``training`` / ``sampler`` / ``external``;
- ``base_models``: any of them (by canonical name); an empty list matches nothing.

Pages run newest first by ``(created_at, checkpoint id)``, the id being the checkpoint's tinker
path (unique, unlike its name); ``next_cursor`` is the last one shown, and None once nothing is
left. Each checkpoint is the listings' JSON (``checkpoint_json``: with SDK 0.39's ``base_model``
and the save's ``user_metadata``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field
from tinker.types import OwnSearchOwner, SearchOwner

from opentinker.server.checkpoints import checkpoint_json
from opentinker.server.deps import ServerDep, Tenant
from opentinker.server.errors import NotFound
from opentinker.server.projects import check_project
from opentinker.server.sessions import owner_urn
from opentinker.server.store import CheckpointRow, Store
from opentinker.service import canonical_name
from opentinker.service.checkpoints import CHECKPOINT_TYPES
from opentinker.service.sessions import session_of

router = APIRouter()


class CheckpointSearchCursor(BaseModel):
    model_config = ConfigDict(extra="forbid")
    last_created_at: AwareDatetime
    last_checkpoint_uuid: str = Field(min_length=1, max_length=1024)


class CheckpointSearchRequest(BaseModel):
    """The SDK 0.39 ``CheckpointSearchRequest`` (its owner types are the SDK 0.38's own)."""

    model_config = ConfigDict(extra="forbid")
    project_ids: list[str] | None = Field(default=None, max_length=100)
    user_metadata: dict[str, str] = Field(default_factory=dict)
    checkpoint_type: Literal["training", "sampler", "external"] | None = None
    owner: SearchOwner = Field(default_factory=OwnSearchOwner)
    base_models: list[str] | None = Field(default=None, max_length=100)
    limit: int = Field(default=50, ge=1, le=200)
    cursor: CheckpointSearchCursor | None = None


class CheckpointSearch:
    def __init__(self, store: Store) -> None:
        self.store = store

    def search(self, tenant: str, req: CheckpointSearchRequest) -> dict[str, Any]:
        if req.project_ids is not None:
            known = self.store.projects(tenant)
            for p in req.project_ids:
                check_project(p)
                if p not in known:
                    raise NotFound(f"project_ids: unknown project {p!r}: no session of yours is in it")
        if req.owner.type == "user" and owner_urn(tenant) not in req.owner.owner_urns:
            return {"checkpoints": [], "next_cursor": None}
        after = None
        if req.cursor is not None:
            after = (req.cursor.last_created_at, req.cursor.last_checkpoint_uuid)
        bases = None if req.base_models is None else {canonical_name(b) for b in req.base_models}
        projects: dict[str, str] = {}
        rows, _ = self.store.checkpoints(tenant)  # newest first, unexpired
        rows.sort(key=lambda r: (r.created, r.tinker_path), reverse=True)
        page: list[CheckpointRow] = []
        more = False
        for row in rows:
            if after is not None and (_iso(row.created), row.tinker_path) >= after:
                continue
            if not self._matches(row, req, bases, projects):
                continue
            if len(page) == req.limit:
                more = True
                break
            page.append(row)
        last = page[-1] if more else None
        cursor = (
            None
            if last is None
            else {"last_created_at": _iso(last.created).isoformat(), "last_checkpoint_uuid": last.tinker_path}
        )
        return {"checkpoints": [checkpoint_json(r) for r in page], "next_cursor": cursor}

    def _matches(
        self,
        row: CheckpointRow,
        req: CheckpointSearchRequest,
        bases: set[str] | None,
        projects: dict[str, str],
    ) -> bool:
        if req.checkpoint_type is not None and CHECKPOINT_TYPES.get(row.kind) != req.checkpoint_type:
            return False
        if bases is not None and canonical_name(str(row.meta.get("base_model", ""))) not in bases:
            return False
        md = row.meta.get("user_metadata") or {}
        if any(md.get(k) != v for k, v in req.user_metadata.items()):
            return False
        if req.project_ids is not None:
            if row.model_id not in projects:
                session = self.store.session(session_of(row.model_id))
                projects[row.model_id] = "" if session is None else session.project_id
            if projects[row.model_id] not in req.project_ids:
                return False
        return True


def _iso(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


@router.post("/api/v1/checkpoints/search", tags=["checkpoints"])
async def search_checkpoints(server: ServerDep, req: CheckpointSearchRequest, t: Tenant) -> dict[str, Any]:
    return CheckpointSearch(server.store).search(t, req)
