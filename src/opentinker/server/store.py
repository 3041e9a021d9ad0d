"""Durable server state in SQLite (WAL): tenants, API keys, sessions, models, samplers, checkpoints.

Why SQLite: one file under ``--data-dir``, safe for the server and the ``opentinker keys`` command to
use at the same time (WAL lets readers and one writer proceed together), and it survives a
``kill -9``. What is *not* here: adapter weights (the engine's checkpoints on disk hold those) and
futures (a request in flight at a crash is lost; its id answers a clear error after a restart).

The checkpoint folders are the truth about checkpoints; the ``checkpoints`` table is an index of
them with their tenant (and what only the index holds: each one's expiry time and published flag), rebuilt from the folders' manifests at start-up
(:func:`opentinker.server.checkpoints.reconcile`),
so a checkpoint written just before a crash is still listed.

The ``sessions`` table is the service's session store
(:class:`~opentinker.service.sessions.SessionStore`): the server's sessions outlive its process.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentinker.service.checkpoints import CheckpointRecord
from opentinker.service.sessions import DEFAULT_PROJECT, SessionRecord

SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (id TEXT PRIMARY KEY, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS api_keys (
    key_hash TEXT PRIMARY KEY, tenant TEXT NOT NULL, name TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL, revoked REAL);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created REAL NOT NULL, last_seen REAL NOT NULL,
    finished TEXT, meta TEXT NOT NULL DEFAULT '{}');
CREATE TABLE IF NOT EXISTS models (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session_id TEXT NOT NULL, base_model TEXT NOT NULL,
    lora TEXT NOT NULL, parent TEXT, created REAL NOT NULL, last_request REAL NOT NULL,
    user_metadata TEXT);
CREATE TABLE IF NOT EXISTS samplers (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session_id TEXT NOT NULL, base_model TEXT NOT NULL,
    model_path TEXT, ephemeral INTEGER NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (
    tinker_path TEXT PRIMARY KEY, tenant TEXT NOT NULL, model_id TEXT NOT NULL, kind TEXT NOT NULL,
    name TEXT NOT NULL, created REAL NOT NULL, size_bytes INTEGER NOT NULL, meta TEXT NOT NULL,
    expires_at REAL, public INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS checkpoints_by_model ON checkpoints (model_id);
CREATE INDEX IF NOT EXISTS models_by_tenant ON models (tenant);
"""


@dataclass(frozen=True)
class KeyRow:
    key_hash: str
    tenant: str
    name: str
    created: float
    revoked: float | None


@dataclass(frozen=True)
class ModelRow:
    id: str
    tenant: str
    session_id: str
    base_model: str
    lora: dict[str, Any]
    parent: str | None
    created: float
    last_request: float
    user_metadata: dict[str, str] | None


@dataclass(frozen=True)
class SamplerRow:
    id: str
    tenant: str
    session_id: str
    base_model: str
    model_path: str | None
    ephemeral: bool


@dataclass(frozen=True)
class CheckpointRow:
    tinker_path: str
    tenant: str
    model_id: str
    kind: str
    name: str
    created: float
    size_bytes: int
    meta: dict[str, Any]
    expires_at: float | None = None  # unix time it expires at (None = never)
    public: bool = False  # published: every tenant may load and sample it (read-only)

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and self.expires_at <= (time.time() if now is None else now)

    @classmethod
    def from_record(
        cls, rec: CheckpointRecord, tenant: str, expires_at: float | None = None
    ) -> CheckpointRow:
        """The index row of the checkpoint folder ``rec`` (what its manifest says), owned by ``tenant``."""
        ref, created = rec.ref, rec.time.timestamp()
        return cls(
            ref.tinker_path,
            tenant,
            ref.model_id,
            ref.kind,
            ref.name,
            created,
            rec.size_bytes,
            rec.meta,
            expires_at,
        )


class Store:
    def __init__(self, data_dir: str | Path) -> None:
        path = Path(data_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / "server.sqlite3"
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            # databases made before checkpoints had a TTL and a published flag
            cols = {r[1] for r in self._db.execute("PRAGMA table_info(checkpoints)").fetchall()}
            if "expires_at" not in cols:
                self._db.execute("ALTER TABLE checkpoints ADD COLUMN expires_at REAL")
            if "public" not in cols:
                self._db.execute("ALTER TABLE checkpoints ADD COLUMN public INTEGER NOT NULL DEFAULT 0")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _exec(self, sql: str, args: Iterable[Any] = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, tuple(args))

    def _all(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    # ------------------------------------------------------------------ tenants and keys
    def ensure_tenant(self, tenant: str) -> None:
        self._exec("INSERT OR IGNORE INTO tenants (id, created) VALUES (?, ?)", (tenant, time.time()))

    def add_key(self, key_hash: str, tenant: str, name: str = "") -> None:
        self.ensure_tenant(tenant)
        self._exec(
            "INSERT INTO api_keys (key_hash, tenant, name, created) VALUES (?, ?, ?, ?)",
            (key_hash, tenant, name, time.time()),
        )

    def key(self, key_hash: str) -> KeyRow | None:
        rows = self._all(
            "SELECT key_hash, tenant, name, created, revoked FROM api_keys WHERE key_hash=?", (key_hash,)
        )
        return KeyRow(*rows[0]) if rows else None

    def key_record(self, key_hash: str) -> tuple[int, str] | None:
        """The key's numeric id (its row id) and name, as ``GET /auth/apikey/me`` shows them."""
        rows = self._all("SELECT rowid, name FROM api_keys WHERE key_hash=?", (key_hash,))
        return (int(rows[0][0]), str(rows[0][1])) if rows else None

    def revoke_hash(self, key_hash: str) -> None:
        self._exec(
            "UPDATE api_keys SET revoked=? WHERE key_hash=? AND revoked IS NULL", (time.time(), key_hash)
        )

    def api_keys(self) -> list[KeyRow]:
        rows = self._all("SELECT key_hash, tenant, name, created, revoked FROM api_keys ORDER BY created")
        return [KeyRow(*r) for r in rows]

    def revoke_keys(self, prefix: str) -> int:
        """Revoke every live key whose hash starts with ``prefix`` (as ``keys list`` shows it)."""
        cur = self._exec(
            "UPDATE api_keys SET revoked=? WHERE key_hash LIKE ? AND revoked IS NULL",
            (time.time(), prefix + "%"),
        )
        return cur.rowcount

    # ------------------------------------------------------------------ sessions
    def add_session(self, session_id: str, tenant: str, meta: dict[str, Any]) -> None:
        now = time.time()
        self._exec(
            "INSERT OR IGNORE INTO sessions (id, tenant, created, last_seen, meta) VALUES (?, ?, ?, ?, ?)",
            (session_id, tenant, now, now, json.dumps(meta)),
        )

    def session(self, session_id: str) -> SessionRecord | None:
        rows = self._all(f"SELECT {_SESSION_COLS} FROM sessions WHERE id=?", (session_id,))
        return _session_row(rows[0]) if rows else None

    def sessions(
        self,
        tenant: str | None,
        *,
        before: tuple[float, str] | None = None,
        limit: int = -1,
        offset: int = 0,
    ) -> list[SessionRecord]:
        """``tenant``'s sessions (None: every tenant's), newest first (ties by id, descending),
        optionally only those strictly older than ``before`` = (created, id): the position a
        search cursor names."""
        where, args = _owner(tenant)
        if before is not None:
            where += " AND (created < ? OR (created = ? AND id < ?))"
            args += [before[0], before[0], before[1]]
        rows = self._all(
            f"SELECT {_SESSION_COLS} FROM sessions WHERE {where} ORDER BY created DESC, id DESC "
            "LIMIT ? OFFSET ?",
            (*args, limit, offset),
        )
        return [_session_row(r) for r in rows]

    def projects(self, tenant: str) -> set[str]:
        """The projects ``tenant``'s sessions are in (projects exist by being used)."""
        rows = self._all(
            "SELECT DISTINCT json_extract(meta, '$.project_id') FROM sessions WHERE tenant=?", (tenant,)
        )
        return {str(r[0]) for r in rows if r[0]} | {DEFAULT_PROJECT}

    def set_session_project(self, session_id: str, project_id: str) -> None:
        self._exec(
            "UPDATE sessions SET meta=json_set(meta, '$.project_id', ?) WHERE id=?", (project_id, session_id)
        )

    def session_contents(self, session_id: str) -> tuple[list[str], list[str], int, int]:
        """The session's model ids and sampler ids (in creation order), and the count and total
        size of its models' checkpoints."""
        models = self._all("SELECT id FROM models WHERE session_id=? ORDER BY created, id", (session_id,))
        samplers = self._all("SELECT id FROM samplers WHERE session_id=? ORDER BY created, id", (session_id,))
        count, size = self._all(
            "SELECT COUNT(*), COALESCE(SUM(c.size_bytes), 0) FROM checkpoints c "
            "JOIN models m ON c.model_id = m.id WHERE m.session_id=?",
            (session_id,),
        )[0]
        return [r[0] for r in models], [r[0] for r in samplers], int(count), int(size)

    def touch_session(self, session_id: str) -> None:
        self._exec("UPDATE sessions SET last_seen=? WHERE id=?", (time.time(), session_id))

    def finish_session(self, session_id: str, reason: str) -> None:
        self._exec("UPDATE sessions SET finished=? WHERE id=? AND finished IS NULL", (reason, session_id))

    # ------------------------------------------------------------------ models
    def add_model(self, row: ModelRow) -> None:
        self._exec(
            "INSERT OR REPLACE INTO models (id, tenant, session_id, base_model, lora, parent, created, "
            "last_request, user_metadata) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.id,
                row.tenant,
                row.session_id,
                row.base_model,
                json.dumps(row.lora),
                row.parent,
                row.created,
                row.last_request,
                None if row.user_metadata is None else json.dumps(row.user_metadata),
            ),
        )

    def touch_model(self, model_id: str) -> None:
        self._exec("UPDATE models SET last_request=? WHERE id=?", (time.time(), model_id))

    def model(self, model_id: str) -> ModelRow | None:
        rows = self._all(f"SELECT {_MODEL_COLS} FROM models WHERE id=?", (model_id,))
        return _model_row(rows[0]) if rows else None

    def models(
        self, tenant: str | None, limit: int, offset: int, project_id: str | None = None
    ) -> tuple[list[ModelRow], int]:
        """``tenant``'s models (None: every tenant's), newest first, and how many there are."""
        where, args = _owner(tenant)
        if project_id is not None and tenant is not None:  # runs of the project's sessions
            where += (
                " AND session_id IN (SELECT id FROM sessions WHERE tenant=? AND "
                "COALESCE(json_extract(meta, '$.project_id'), ?) = ?)"
            )
            args += [tenant, DEFAULT_PROJECT, project_id]
        rows = self._all(
            f"SELECT {_MODEL_COLS} FROM models WHERE {where} ORDER BY created DESC LIMIT ? OFFSET ?",
            (*args, limit, offset),
        )
        total = self._all(f"SELECT COUNT(*) FROM models WHERE {where}", args)[0][0]
        return [_model_row(r) for r in rows], int(total)

    # ------------------------------------------------------------------ samplers
    def add_sampler(self, row: SamplerRow) -> None:
        self._exec(
            "INSERT OR IGNORE INTO samplers (id, tenant, session_id, base_model, model_path, ephemeral, "
            "created) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                row.id,
                row.tenant,
                row.session_id,
                row.base_model,
                row.model_path,
                int(row.ephemeral),
                time.time(),
            ),
        )

    def sampler(self, sampler_id: str) -> SamplerRow | None:
        rows = self._all(
            "SELECT id, tenant, session_id, base_model, model_path, ephemeral FROM samplers WHERE id=?",
            (sampler_id,),
        )
        if not rows:
            return None
        r = rows[0]
        return SamplerRow(r[0], r[1], r[2], r[3], r[4], bool(r[5]))

    # ------------------------------------------------------------------ checkpoints
    def add_checkpoint(self, row: CheckpointRow) -> None:
        self._exec(
            "INSERT OR REPLACE INTO checkpoints (tinker_path, tenant, model_id, kind, name, created, "
            "size_bytes, meta, expires_at, public) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.tinker_path,
                row.tenant,
                row.model_id,
                row.kind,
                row.name,
                row.created,
                row.size_bytes,
                json.dumps(row.meta),
                row.expires_at,
                int(row.public),
            ),
        )

    def set_checkpoint_expiry(self, tinker_path: str, expires_at: float | None) -> None:
        self._exec("UPDATE checkpoints SET expires_at=? WHERE tinker_path=?", (expires_at, tinker_path))

    def set_checkpoint_public(self, tinker_path: str, public: bool) -> None:
        self._exec("UPDATE checkpoints SET public=? WHERE tinker_path=?", (int(public), tinker_path))

    def expired_checkpoints(self, now: float) -> list[CheckpointRow]:
        rows = self._all(
            f"SELECT {_CKPT_COLS} FROM checkpoints WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,)
        )
        return [_ckpt_row(r) for r in rows]

    def delete_checkpoint(self, tinker_path: str) -> None:
        self._exec("DELETE FROM checkpoints WHERE tinker_path=?", (tinker_path,))

    def checkpoint(self, tinker_path: str) -> CheckpointRow | None:
        rows = self._all(f"SELECT {_CKPT_COLS} FROM checkpoints WHERE tinker_path=?", (tinker_path,))
        return _ckpt_row(rows[0]) if rows else None

    def checkpoints(
        self, tenant: str | None, model_id: str | None = None, limit: int = -1, offset: int = 0
    ) -> tuple[list[CheckpointRow], int]:
        """``tenant``'s checkpoints (None: every tenant's), newest first, and how many there are."""
        # an expired checkpoint is gone from listings at once, before the sweep deletes its files
        where, args = _owner(tenant)
        where += " AND (expires_at IS NULL OR expires_at > ?)"
        args.append(time.time())
        if model_id is not None:
            where += " AND model_id=?"
            args.append(model_id)
        rows = self._all(
            f"SELECT {_CKPT_COLS} FROM checkpoints WHERE {where} ORDER BY created DESC LIMIT ? OFFSET ?",
            (*args, limit, offset),
        )
        total = self._all(f"SELECT COUNT(*) FROM checkpoints WHERE {where}", args)[0][0]
        return [_ckpt_row(r) for r in rows], int(total)

    def all_checkpoint_paths(self) -> set[str]:
        return {r[0] for r in self._all("SELECT tinker_path FROM checkpoints")}

    def checkpoint_totals(self) -> list[tuple[str, str, int, int]]:
        """(tenant, kind, count, recorded bytes) of every checkpoint not yet swept (``/metrics``)."""
        rows = self._all(
            "SELECT tenant, kind, COUNT(*), COALESCE(SUM(size_bytes), 0) FROM checkpoints GROUP BY tenant, kind"
        )
        return [(str(t), str(k), int(n), int(b)) for t, k, n, b in rows]


_SESSION_COLS = "id, tenant, created, last_seen, finished, meta"
_MODEL_COLS = "id, tenant, session_id, base_model, lora, parent, created, last_request, user_metadata"
_CKPT_COLS = "tinker_path, tenant, model_id, kind, name, created, size_bytes, meta, expires_at, public"


def _owner(tenant: str | None) -> tuple[str, list[Any]]:
    """The WHERE clause of one tenant's rows (None: every tenant's, for an operator)."""
    return ("tenant=?", [tenant]) if tenant is not None else ("1=1", [])


def _session_row(r: tuple[Any, ...]) -> SessionRecord:
    return SessionRecord(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]) if r[5] else {})


def _model_row(r: tuple[Any, ...]) -> ModelRow:
    return ModelRow(
        r[0], r[1], r[2], r[3], json.loads(r[4]), r[5], r[6], r[7], json.loads(r[8]) if r[8] else None
    )


def _ckpt_row(r: tuple[Any, ...]) -> CheckpointRow:
    return CheckpointRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], json.loads(r[7]), r[8], bool(r[9]))
