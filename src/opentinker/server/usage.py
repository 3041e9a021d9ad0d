"""The tenant's audit log and usage counters: what ``AdminClient`` (and ``RestClient``'s
deprecated admin methods) read from ``/api/v1/audit`` and ``/api/v1/billing/usage/*``.

What is recorded, all in the server's SQLite file (tables of their own, so this module needs no
change to :mod:`store`):

- ``audit_events``: one row per action a tenant took — ``session_create``, ``training_run_create``,
  ``checkpoint_create``, ``checkpoint_read``, ``checkpoint_delete``, ``sampler_create``, … —
  with when, and ``event_details`` naming who (the tenant) and what (ids, paths, sizes). Written
  when the action *happened* (an asynchronous save is recorded when its result exists, not when
  it was asked for), so a failed save leaves no entry.
- ``usage_counts``: tokens per tenant, UTC hour, session, base model and kind (``training``:
  tokens of every forward/forward-backward datum; ``sampling_prefill``: prompt tokens of each
  sample request; ``sampling_sample``: tokens generated), added up as the operations finish.

Billing events are built from those rows: token events from ``usage_counts``, checkpoint events
(count saved per hour) from ``checkpoint_create`` entries, storage events (GB-hours per hour) by
integrating the size of each checkpoint over the part of the hour it existed (live ones from
the checkpoint index, deleted ones from their ``checkpoint_delete`` entry). A self-hosted server
has no prices, so every cost and rate is ``null``. Current storage is measured from the bytes
of the tenant's checkpoint folders on disk, not from recorded sizes; a file hard-linked into
several checkpoints (``copy_weights``) is counted once. Projects are the sessions' (``default``
for a session created without one), as :mod:`projects` keeps them.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

from opentinker.server.errors import BadRequest
from opentinker.server.projects import check_project
from opentinker.server.store import DEFAULT_PROJECT
from opentinker.service import EngineError
from opentinker.service.checkpoints import CheckpointStore, parse_tinker_path
from opentinker.service.sessions import session_of

SCHEMA = """
CREATE TABLE IF NOT EXISTS audit_events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, tenant TEXT NOT NULL, time REAL NOT NULL,
    event TEXT NOT NULL, details TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS audit_by_tenant_time ON audit_events (tenant, time);
CREATE TABLE IF NOT EXISTS usage_counts (
    tenant TEXT NOT NULL, bucket REAL NOT NULL, session_id TEXT NOT NULL, base_model TEXT NOT NULL,
    kind TEXT NOT NULL, cached INTEGER NOT NULL, tokens INTEGER NOT NULL,
    PRIMARY KEY (tenant, bucket, session_id, base_model, kind, cached));
"""

# event_type of GET /audit → the resource prefixes it selects (None: every event)
EVENT_TYPES: dict[str, tuple[str, ...] | None] = {
    "all": None,
    "checkpoints": ("checkpoint_",),
    "projects": ("project_",),
    "teams": ("team_",),
    "organizations": ("organization_",),
}
MAX_WINDOW = timedelta(days=14)  # the SDK's documented limit for one billing query
GIGABYTE = 1e9
HOUR = 3600.0


def _hour(t: float) -> float:
    return t - t % HOUR


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


class Ledger:
    """Append-only records of what each tenant did and used; every query is for one tenant."""

    def __init__(self, db_path: str | Path, disk: CheckpointStore) -> None:
        self.disk = disk
        # its own connection to the server's database file (WAL: safe beside the Store's)
        self._db = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None, timeout=30)
        self._lock = threading.Lock()
        self._hooked: OrderedDict[str, None] = OrderedDict()  # request ids with a result hook
        # called with (tenant, kind, tokens, base_model) for every count: /metrics' counters
        self.observers: list[Callable[[str, str, int, str], None]] = []
        with self._lock:
            self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _all(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    # ------------------------------------------------------------------ recording
    def record(self, tenant: str, event: str, **details: Any) -> None:
        """One audit entry: ``tenant`` did ``event`` (``<resource>_<action>``) now."""
        body = {"actor": tenant, **{k: v for k, v in details.items() if v is not None}}
        self._all(
            "INSERT INTO audit_events (tenant, time, event, details) VALUES (?, ?, ?, ?)",
            (tenant, time.time(), event, json.dumps(body, default=str)),
        )

    def count(
        self, tenant: str, kind: str, tokens: int, *, session_id: str, base_model: str, cached: bool = False
    ) -> None:
        """Add ``tokens`` of ``kind`` to this hour's counter of the tenant's session."""
        if tokens <= 0:
            return
        self.observe(tenant, kind, tokens, base_model=base_model)
        self._all(
            "INSERT INTO usage_counts (tenant, bucket, session_id, base_model, kind, cached, tokens) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, bucket, session_id, base_model, kind, "
            "cached) DO UPDATE SET tokens = tokens + excluded.tokens",
            (tenant, _hour(time.time()), session_id, base_model, kind, int(cached), tokens),
        )

    def observe(self, tenant: str, kind: str, tokens: int, *, base_model: str) -> None:
        """Tell the observers of ``tokens`` of ``kind`` without billing them (:meth:`count` bills
        and tells): e.g. the prompt tokens a sample took from the prefix cache."""
        if tokens > 0:
            for fn in self.observers:
                fn(tenant, kind, tokens, base_model)

    def after(self, key: str, future: Future | None, fn: Callable[[Any], None]) -> None:
        """Call ``fn(result)`` once when ``future`` succeeds, once per ``key`` (a request id and
        what is recorded: the SDK's retries get the same request id back, and count once)."""
        if future is None:
            return
        with self._lock:
            if key in self._hooked:
                return
            self._hooked[key] = None
            while len(self._hooked) > 100_000:
                self._hooked.popitem(last=False)

        def done(f: Future) -> None:
            if not f.cancelled() and f.exception() is None:
                fn(f.result())

        future.add_done_callback(done)

    # ------------------------------------------------------------------ GET /audit
    def audit_log(self, tenant: str, event_type: str, day: str | None) -> dict[str, Any]:
        if event_type not in EVENT_TYPES:
            raise BadRequest(f"unknown event_type {event_type!r}: expected one of {', '.join(EVENT_TYPES)}")
        try:
            when = date.fromisoformat(day) if day is not None else datetime.now(UTC).date()
        except ValueError:
            raise BadRequest(f"day must be a date as YYYY-MM-DD, got {day!r}") from None
        start = datetime(when.year, when.month, when.day, tzinfo=UTC).timestamp()
        rows = self._all(
            "SELECT time, event, details FROM audit_events WHERE tenant=? AND time>=? AND time<? "
            "ORDER BY time, id",
            (tenant, start, start + 24 * HOUR),
        )
        prefixes = EVENT_TYPES[event_type]
        entries = []
        for t, event, details in rows:
            if prefixes is not None and not event.startswith(prefixes):
                continue
            d = json.loads(details)
            entry: dict[str, Any] = {"timestamp": _iso(t), "event": event, "event_details": d}
            if event.startswith("checkpoint_"):  # the SDK's deprecated flat fields
                entry.update(model_id=d.get("model_id"), tinker_path=d.get("tinker_path"))
                if event == "checkpoint_read":
                    entry["purpose"] = d.get("purpose")
            entries.append(entry)
        return {"entries": entries}

    # ------------------------------------------------------------------ GET /billing/usage/events
    def billing_usage(self, tenant: str, starting_on: str, ending_before: str) -> dict[str, Any]:
        start, end = _window(starting_on, ending_before)
        events: list[dict[str, Any]] = []
        sessions: set[str] = set()
        rows = self._all(
            "SELECT bucket, session_id, base_model, kind, cached, tokens FROM usage_counts "
            "WHERE tenant=? AND bucket>=? AND bucket<?",
            (tenant, start, end),
        )
        for bucket, session_id, base_model, kind, cached, tokens in rows:
            info: dict[str, Any] = {"type": kind, "token_count": int(tokens)}
            if kind == "sampling_prefill":
                info["cached"] = bool(cached)
            events.append(self._event(tenant, bucket, info, base_model=base_model, session_id=session_id))
            sessions.add(session_id)
        saves: dict[tuple[float, str, str], int] = defaultdict(int)
        for t, d in self._events(tenant, "checkpoint_create", start, end):
            saves[(_hour(t), str(d.get("session_id", "")), str(d.get("base_model", "")))] += 1
        for (bucket, session_id, base_model), n in saves.items():
            info = {"type": "checkpoint", "count": n}
            events.append(self._event(tenant, bucket, info, base_model=base_model, session_id=session_id))
            sessions.add(session_id)
        for bucket, (base_model, gb_hours) in self._storage(tenant, start, end).items():
            info = {"type": "storage", "free": False, "gigabyte_hours": gb_hours}
            events.append(self._event(tenant, bucket[0], info, base_model=base_model or None))
        # the documented order: by bucket, then by descending token count
        events.sort(key=lambda e: (e["bucket_start"], -e["event_info"].get("token_count", 0)))
        meta = self._session_metadata(tenant, sessions)
        return {"data": events, "sessions": meta, "cost_data_through": None}

    def _event(
        self,
        tenant: str,
        bucket: float,
        info: dict[str, Any],
        *,
        base_model: str | None,
        session_id: str | None = None,
    ) -> dict[str, Any]:
        return {
            "bucket_start": _iso(bucket),
            "bucket_end": _iso(bucket + HOUR),
            "base_model": base_model or None,
            "user_name": tenant,
            "session_id": session_id or None,
            "project_id": self._project_of(session_id) if session_id else None,
            "estimated_cost_usd": None,  # a self-hosted server has no price list
            "event_info": info,
        }

    def _events(
        self, tenant: str, event: str, start: float, end: float
    ) -> list[tuple[float, dict[str, Any]]]:
        rows = self._all(
            "SELECT time, details FROM audit_events WHERE tenant=? AND event=? AND time>=? AND time<?",
            (tenant, event, start, end),
        )
        return [(t, json.loads(d)) for t, d in rows]

    def _storage(self, tenant: str, start: float, end: float) -> dict[tuple[float, str], tuple[str, float]]:
        """GB-hours per (hour, base model): each checkpoint's size over the time it existed."""
        now = time.time()
        spans: list[tuple[float, float, int, str]] = []  # (created, gone, bytes, base model)
        for created, size, meta in self._all(
            "SELECT created, size_bytes, meta FROM checkpoints WHERE tenant=?", (tenant,)
        ):
            spans.append((created, now, int(size), str(json.loads(meta).get("base_model", ""))))
        for t, d in self._events(tenant, "checkpoint_delete", 0.0, end):
            if "created" in d and "size_bytes" in d:
                spans.append((float(d["created"]), t, int(d["size_bytes"]), str(d.get("base_model", ""))))
        out: dict[tuple[float, str], tuple[str, float]] = {}
        for created, gone, size, base in spans:
            lo, hi = max(created, start), min(gone, end, now)
            bucket = _hour(lo)
            while bucket < hi:
                overlap = min(hi, bucket + HOUR) - max(lo, bucket)
                if overlap > 0:
                    key = (bucket, base)
                    prev = out.get(key, (base, 0.0))[1]
                    out[key] = (base, prev + size / GIGABYTE * overlap / HOUR)
                bucket += HOUR
        return out

    def _project_of(self, session_id: str) -> str | None:
        rows = self._all("SELECT meta FROM sessions WHERE id=?", (session_id,))
        if not rows:
            return None
        project = json.loads(rows[0][0] or "{}").get("project_id")
        return str(project) if project else DEFAULT_PROJECT

    def _session_metadata(self, tenant: str, ids: set[str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for sid in sorted(ids):
            rows = self._all("SELECT meta FROM sessions WHERE id=? AND tenant=?", (sid, tenant))
            meta = json.loads(rows[0][0] or "{}").get("user_metadata") if rows else None
            out[sid] = {"user_metadata": {str(k): str(v) for k, v in meta.items()} if meta else None}
        return out

    # ------------------------------------------------------------------ GET /billing/usage/checkpoints/current
    def storage_now(self, tenant: str, project_id: str | None) -> dict[str, Any]:
        """The tenant's live checkpoints, counted and measured on disk, grouped by project."""
        if project_id is not None:
            check_project(project_id)
        groups: dict[str | None, list[int]] = defaultdict(lambda: [0, 0])
        seen: set[tuple[int, int]] = set()  # (device, inode): a copy hard-links its source's files
        rows = self._all("SELECT tinker_path FROM checkpoints WHERE tenant=? ORDER BY created", (tenant,))
        for (path,) in rows:
            try:
                ref = parse_tinker_path(path)
                if not self.disk.exists(ref):
                    continue  # deleted since it was indexed
                size = 0
                for f in self.disk.folder(ref).iterdir():
                    st = f.stat()
                    if f.is_file() and (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        size += st.st_size
            except (EngineError, OSError):
                continue
            project = self._project_of(session_of(ref.model_id))
            if project_id is not None and project != project_id:
                continue
            groups[project][0] += 1
            groups[project][1] += size
        data = [
            {
                "project_id": project,
                "user_name": tenant,
                "checkpoint_count": n,
                "size_bytes": size,
                "size_gigabytes": size / GIGABYTE,
                "estimated_monthly_cost_usd": None,
            }
            for project, (n, size) in sorted(groups.items(), key=lambda kv: kv[0] or "")
        ]
        return {"effective_rate_usd_per_gigabyte_month": None, "data": data}


def _window(starting_on: str, ending_before: str) -> tuple[float, float]:
    """The billing window as epoch seconds, checked as the SDK documents it."""
    bounds = []
    for name, text in (("starting_on", starting_on), ("ending_before", ending_before)):
        try:
            t = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise BadRequest(f"{name} must be an RFC 3339 time, got {text!r}") from None
        if t.tzinfo is None:
            raise BadRequest(f"{name} must carry a UTC offset (e.g. 2026-07-13T00:00:00Z), got {text!r}")
        t = t.astimezone(UTC)
        if (t.minute, t.second, t.microsecond) != (0, 0, 0):
            raise BadRequest(f"{name} must be aligned to a UTC hour boundary, got {text!r}")
        bounds.append(t)
    start, end = bounds
    if start > datetime.now(UTC):
        raise BadRequest(f"starting_on {starting_on!r} is in the future")
    if end <= start:
        raise BadRequest(f"ending_before {ending_before!r} must be after starting_on {starting_on!r}")
    if end - start > MAX_WINDOW:
        raise BadRequest(
            f"the window from {starting_on!r} to {ending_before!r} is longer than {MAX_WINDOW.days} days"
        )
    return start.timestamp(), end.timestamp()
