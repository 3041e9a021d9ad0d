"""Sessions and tenants: what one client's models and samplers belong to, embedded and over HTTP.

A session is made by the SDK's ``ServiceClient(user_metadata=…, project_id=…, display_name=…)``
and records what it was made with (its ``meta``). It belongs to one tenant: another tenant's session
does not exist (:class:`UnknownSession`). It is active while heartbeats or requests keep coming,
until its client finishes it with a reason (:class:`SessionFinished` for a new model in it).

:class:`Sessions` is the service's one implementation of these rules; where the records live is a
:class:`SessionStore`: :class:`MemorySessionStore` for the embedded runtime, the server's SQLite
store for the server (which outlives its process). The server maps the errors to HTTP (404, 410).
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

DEFAULT_PROJECT = "default"  # the project of sessions created without one
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")  # a tenant's name, a project id
FINISH_REASONS = ("success", "errored", "interrupted")
TOUCH_EVERY_S = 5.0  # a session's last-seen time is written at most this often


class UnknownSession(LookupError):
    """No such session for this tenant (another tenant's is unknown too)."""


class SessionFinished(Exception):
    """The session was finished by its client: nothing new can be made in it."""


class InvalidProject(ValueError):
    """A project id that breaks the naming rule."""


def check_project(value: object) -> str:
    """``value`` if it is a valid project id, else :class:`InvalidProject` naming the rule."""
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        shown = repr(value)[:80]
        raise InvalidProject(
            f"invalid project id {shown}: use 1-64 letters, digits, '.', '_', '-', starting with a "
            "letter or digit"
        )
    return value


def check_tenant(name: str) -> str:
    """``name`` if it can name a tenant (what API keys are made for), else ``ValueError``."""
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"invalid tenant name {name!r}: letters, digits, '.', '_', '-' (max 64)")
    return name


def model_id_in(session_id: str, seq: int) -> str:
    """The id of a session's model number ``seq``: ``<session_id>:train:<seq>`` (the SDK's form)."""
    return f"{session_id}:train:{seq}"


def sampler_id_in(session_id: str, seq: int) -> str:
    """The id of a session's sampler number ``seq``: ``<session_id>:sample:<seq>`` (the SDK's form)."""
    return f"{session_id}:sample:{seq}"


def is_sampler_id(name: str) -> bool:
    """Whether ``name`` has the form of a sampler id (:func:`sampler_id_in`)."""
    return ":sample:" in name


def session_of(model_or_sampler_id: str) -> str:
    """The session a model or sampler id belongs to (the inverse of :func:`model_id_in` and
    :func:`sampler_id_in`)."""
    return model_or_sampler_id.split(":train:", 1)[0].split(":sample:", 1)[0]


@dataclass(frozen=True)
class SessionRecord:
    id: str
    tenant: str
    created: float
    last_seen: float
    finished: str | None  # the reason the client gave (success, errored, interrupted), or None
    meta: dict[str, Any] = field(default_factory=dict)  # what it was created with (+ project_id)

    @property
    def project_id(self) -> str:
        return str(self.meta.get("project_id") or DEFAULT_PROJECT)

    @property
    def display_name(self) -> str | None:
        name = self.meta.get("display_name")
        return None if name is None else str(name)

    @property
    def user_metadata(self) -> dict[str, str] | None:
        md = self.meta.get("user_metadata")
        return None if md is None else {str(k): str(v) for k, v in dict(md).items()}


def session_view(row: SessionRecord, models: list[str], samplers: list[str]) -> dict[str, Any]:
    """A session as the SDK's ``GetSessionResponse`` reads it (JSON), embedded and over HTTP alike."""
    return {
        "training_run_ids": models,
        "sampler_ids": samplers,
        "user_metadata": row.user_metadata,
        "display_name": row.display_name,
    }


class SessionStore(Protocol):
    """Where session records live (the server's SQLite store is one)."""

    def add_session(self, session_id: str, tenant: str, meta: dict[str, Any]) -> None: ...

    def session(self, session_id: str) -> SessionRecord | None: ...

    def sessions(self, tenant: str | None, *, limit: int = -1, offset: int = 0) -> list[SessionRecord]:
        """``tenant``'s sessions (None: every tenant's), newest first."""
        ...

    def touch_session(self, session_id: str) -> None: ...

    def finish_session(self, session_id: str, reason: str) -> None: ...


class MemorySessionStore:
    """Session records of one process (the embedded runtime's)."""

    def __init__(self) -> None:
        self._rows: dict[str, SessionRecord] = {}
        self._lock = threading.Lock()

    def add_session(self, session_id: str, tenant: str, meta: dict[str, Any]) -> None:
        now = time.time()
        with self._lock:
            self._rows.setdefault(session_id, SessionRecord(session_id, tenant, now, now, None, dict(meta)))

    def session(self, session_id: str) -> SessionRecord | None:
        return self._rows.get(session_id)

    def sessions(self, tenant: str | None, *, limit: int = -1, offset: int = 0) -> list[SessionRecord]:
        with self._lock:
            rows = [r for r in self._rows.values() if tenant is None or r.tenant == tenant]
        rows.sort(key=lambda r: (r.created, r.id), reverse=True)
        return rows[offset:] if limit < 0 else rows[offset : offset + limit]

    def touch_session(self, session_id: str) -> None:
        self._update(session_id, last_seen=time.time())

    def finish_session(self, session_id: str, reason: str) -> None:
        with self._lock:
            row = self._rows.get(session_id)
            if row is not None and row.finished is None:
                self._rows[session_id] = replace(row, finished=reason)

    def _update(self, session_id: str, **changes: Any) -> None:
        with self._lock:
            row = self._rows.get(session_id)
            if row is not None:
                self._rows[session_id] = replace(row, **changes)


class Sessions:
    """Create, look up, keep alive and finish sessions, per tenant, over a :class:`SessionStore`."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._touched: dict[str, float] = {}  # session id -> monotonic time of its last write
        self.active_at: dict[str, float] = {}  # session id -> monotonic time of its last activity

    def create(self, tenant: str, meta: Mapping[str, Any] | None = None) -> SessionRecord:
        """A new session of ``tenant`` holding ``meta`` (the SDK's ``user_metadata``,
        ``project_id``, ``display_name``); a bad ``project_id`` is refused, nothing made."""
        meta = dict(meta or {})
        if meta.get("project_id") is not None:
            check_project(meta["project_id"])
        session_id = f"sess-{uuid.uuid4().hex[:12]}"
        self.store.add_session(session_id, tenant, meta)
        row = self.store.session(session_id)
        assert row is not None
        return row

    def get(self, tenant: str, session_id: str) -> SessionRecord:
        """``tenant``'s session ``session_id`` (finished or not), else :class:`UnknownSession`."""
        row = self.store.session(session_id)
        if row is None or row.tenant != tenant:
            raise UnknownSession(f"unknown session {session_id!r}")
        return row

    def live(self, tenant: str, session_id: str) -> SessionRecord:
        """:meth:`get`, refusing a finished session (:class:`SessionFinished`)."""
        row = self.get(tenant, session_id)
        if row.finished is not None:
            raise SessionFinished(f"session {session_id!r} is finished")
        return row

    def list(self, tenant: str, *, limit: int = -1, offset: int = 0) -> list[SessionRecord]:
        """``tenant``'s sessions, newest first."""
        return self.store.sessions(tenant, limit=limit, offset=offset)

    def seen(self, session_id: str) -> None:
        """A heartbeat or a request of the session came: its last-seen time, written at most every
        :data:`TOUCH_EVERY_S` seconds."""
        now = self.active_at[session_id] = time.monotonic()
        if now - self._touched.get(session_id, 0.0) > TOUCH_EVERY_S:
            self._touched[session_id] = now
            self.store.touch_session(session_id)

    def finish(self, session_id: str, reason: str) -> None:
        """Mark it finished with the reason its client gave (the first reason stays)."""
        self.store.finish_session(session_id, reason)

    @staticmethod
    def status(row: SessionRecord, inactive_s: float) -> dict[str, Any] | None:
        """The SDK's ``SessionSummary.status``: ``client_finished`` with its reason, ``active``
        while seen within ``inactive_s``, else None (neither finished nor known to be running)."""
        if row.finished is not None:
            if row.finished in FINISH_REASONS:
                return {"type": "client_finished", "reason": {"type": row.finished}}
            return {
                "type": "client_finished",
                "reason": {"type": "interrupted"},
                "detail": f"finished with reason {row.finished!r}",
            }
        if time.time() - row.last_seen <= inactive_s:
            return {"type": "active"}
        return None
