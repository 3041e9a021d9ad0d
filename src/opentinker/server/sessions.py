"""The session REST routes' logic (``RestClient``): ``get_session``, ``list_sessions``, ``search_sessions``.

Everything is per tenant: another tenant's session does not exist (404), and a search never
returns one. A tenant is one user in one organization here, so the SDK's ``access_scope``
(``owned`` / ``accessible``) and search owners ``own`` / ``accessible`` name the same sessions;
an ``owner_urns`` search matches the tenant's own URN (``tml:user:<tenant>``) only.

A session's status, as ``SessionSummary.status`` reports it: ``client_finished`` with the reason
its client gave once it is finished; ``active`` while heartbeats or requests keep coming; after
``session_inactive_s`` without either, ``None`` — the SDK's "neither finished nor known to be
running" — and its models are saved and evicted (:meth:`Registry.evict_idle`).

Search pages run newest first by ``(created_at, session_id)``; the cursor is the last one shown.
The tenant's sessions are filtered here, in Python: a self-hosted server holds thousands of
sessions, not millions, and every filter then means exactly what the SDK documents.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field
from tinker.types import SearchOwner, SessionStatusQuery

from opentinker.server.errors import NotFound
from opentinker.server.projects import check_project
from opentinker.server.store import Store
from opentinker.service.sessions import SessionRecord, Sessions, UnknownSession, session_view


class SearchCursor(BaseModel):
    model_config = ConfigDict(extra="forbid")
    last_created_at: AwareDatetime
    last_session_id: str = Field(max_length=256)


class SessionSearchRequest(BaseModel):
    """``POST /sessions/search`` as the SDK 0.38 sends it (its nested types are the SDK's own)."""

    model_config = ConfigDict(extra="forbid")
    session_id: str | None = Field(default=None, max_length=256)
    project_ids: list[str] | None = Field(default=None, max_length=100)
    user_metadata: dict[str, str] = Field(default_factory=dict)
    display_name: str | None = Field(default=None, min_length=1, max_length=1000)
    owner: SearchOwner = Field(default_factory=lambda: {"type": "own"})  # type: ignore[assignment]
    statuses: list[SessionStatusQuery] | None = Field(default=None, min_length=1)
    limit: int = Field(default=50, ge=1, le=200)
    cursor: SearchCursor | None = None


def owner_urn(tenant: str) -> str:
    return f"tml:user:{tenant}"


def _iso(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


class SessionApi:
    """The REST views of the service's sessions (:class:`Sessions`), with what only the server's
    store knows about them: their samplers, checkpoints and projects."""

    def __init__(self, sessions: Sessions, store: Store, inactive_s: float) -> None:
        self.sessions = sessions
        self.store = store
        self.inactive_s = inactive_s

    def _row(self, tenant: str, session_id: str) -> SessionRecord:
        try:
            return self.sessions.get(tenant, session_id)
        except UnknownSession as e:
            raise NotFound(str(e)) from None

    def status(self, row: SessionRecord) -> dict[str, Any] | None:
        return self.sessions.status(row, self.inactive_s)

    def get(self, tenant: str, session_id: str) -> dict[str, Any]:
        row = self._row(tenant, session_id)
        models, samplers, _, _ = self.store.session_contents(row.id)
        return session_view(row, models, samplers)

    def list(self, tenant: str, limit: int, offset: int) -> dict[str, Any]:
        return {"sessions": [r.id for r in self.sessions.list(tenant, limit=limit, offset=offset)]}

    def summary(self, row: SessionRecord) -> dict[str, Any]:
        _, _, count, size = self.store.session_contents(row.id)
        return {
            "session_id": row.id,
            "created_at": _iso(row.created).isoformat(),
            "owner": owner_urn(row.tenant),
            "project_id": row.project_id,
            "status": self.status(row),
            "checkpoints_count": count,
            "display_name": row.display_name,
            "user_metadata": row.user_metadata,
            "checkpoint_storage_bytes": size,
        }

    def search(self, tenant: str, req: SessionSearchRequest) -> dict[str, Any]:
        if req.project_ids is not None:
            known = self.store.projects(tenant)
            for p in req.project_ids:
                check_project(p)
                if p not in known:
                    raise NotFound(f"unknown project {p!r}: no session of yours is in it")
        if req.owner.type == "user" and owner_urn(tenant) not in req.owner.owner_urns:
            return {"sessions": [], "next_cursor": None}
        after = None if req.cursor is None else (req.cursor.last_created_at, req.cursor.last_session_id)
        page: list[SessionRecord] = []
        more = False
        for row in self.sessions.list(tenant):  # newest first
            if after is not None and (_iso(row.created), row.id) >= after:
                continue
            if not self._matches(row, req):
                continue
            if len(page) == req.limit:
                more = True
                break
            page.append(row)
        last = page[-1] if more else None
        cursor = (
            None
            if last is None
            else {"last_created_at": _iso(last.created).isoformat(), "last_session_id": last.id}
        )
        return {"sessions": [self.summary(r) for r in page], "next_cursor": cursor}

    def _matches(self, row: SessionRecord, req: SessionSearchRequest) -> bool:
        if req.session_id is not None or req.display_name is not None:
            by_id = req.session_id is not None and row.id == req.session_id
            name = (row.display_name or "").lower()
            by_name = req.display_name is not None and all(
                w in name for w in req.display_name.lower().split()
            )
            if not (by_id or by_name):
                return False
        if req.project_ids is not None and row.project_id not in req.project_ids:
            return False
        md = row.user_metadata or {}
        if any(md.get(k) != v for k, v in req.user_metadata.items()):
            return False
        if req.statuses is not None:
            status = self.status(row)
            if not any(_status_matches(q, status) for q in req.statuses):
                return False
        return True


def _status_matches(query: Any, status: dict[str, Any] | None) -> bool:
    if status is None or query.type != status["type"]:
        return False
    if query.type == "client_finished" and query.reasons is not None:
        return status["reason"]["type"] in query.reasons
    return True
