"""The checkpoint REST routes' logic (``RestClient``): training runs, checkpoints, weights info,
TTLs and publishing.

Everything is filtered by tenant: another tenant's runs and checkpoints do not exist (404). The
folders under ``<data-dir>/checkpoints`` are the truth; :func:`reconcile` re-indexes them into the
store at start-up, so checkpoints written by an earlier process — even one killed mid-way — are
listed and loadable after a restart, and deleted folders drop out of the index.

**TTL.** Every save may name ``ttl_seconds`` and ``set_checkpoint_ttl`` changes it later (``None``
removes it); the documented range is 1 hour to 10 years (:data:`MIN_TTL_S`, :data:`MAX_TTL_S`),
anything else is refused before anything is saved or changed. From its expiry time on a checkpoint
is gone from every listing and can no longer be loaded, sampled or downloaded (404). Its files are
deleted by :meth:`CheckpointApi.sweep`, which the server runs at start-up and then every
``checkpoint_sweep_s`` (60 s by default) — except while a live sampler (a sampler session of this
process, not finished) was created from it: its weights stay on disk until that sampler's session
finishes, so the sampler keeps sampling (a restart or a reload never finds them torn away); the
next sweep after that deletes them. TTLs and the published flag live in the store only.

**Publishing.** Only a checkpoint's owner may publish or unpublish it. Publishing what is
already public (or unpublishing what is private) answers 400 saying so — not the 409 the SDK's
docstring names, because the SDK retries every 409 for five minutes before raising it. While published, every tenant may read it: weights info, a training client from
its state, a sampling client, the download URLs of external weights. Nothing else: other tenants
still get 404 for deleting, TTLs and publishing it, and it is never in their listings. Unpublishing
makes it 404 for them again, including for sampling sessions they made from it meanwhile.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

from opentinker.server.errors import BadRequest, NotFound, UserError
from opentinker.server.store import CheckpointRow, ModelRow, Store
from opentinker.service import EngineError
from opentinker.service.checkpoints import KINDS, CheckpointStore, checkpoint_ref
from opentinker.service.external import KIND as EXTERNAL
from opentinker.service.external import ExternalRecord, ExternalStore
from opentinker.service.runtime import checkpoint_owner
from opentinker.service.sessions import session_of

log = logging.getLogger(__name__)
MIN_TTL_S = 3600  # 1 hour, the SDK's documented lower bound
MAX_TTL_S = 315_576_000  # 10 years of 365.25 days, the documented upper bound
CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler", EXTERNAL: "external"}


def check_ttl(ttl_seconds: object) -> int | None:
    """``ttl_seconds`` if it is None or an integer in the documented range, else a user error."""
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int):
        raise UserError(f"ttl_seconds must be an integer number of seconds, got {ttl_seconds!r}")
    if not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise UserError(
            f"ttl_seconds must be between {MIN_TTL_S} (1 hour) and {MAX_TTL_S} (10 years), got {ttl_seconds}"
        )
    return ttl_seconds


def expiry(ttl_seconds: int | None, now: float | None = None) -> float | None:
    return None if ttl_seconds is None else (time.time() if now is None else now) + ttl_seconds


def external_row(rec: ExternalRecord, expires_at: float | None = None) -> CheckpointRow:
    return CheckpointRow(
        rec.tinker_path,
        rec.tenant,
        rec.model_id,
        EXTERNAL,
        rec.name,
        rec.created,
        rec.size_bytes,
        rec.meta,
        expires_at,
    )


def reconcile(disk: CheckpointStore, store: Store, external: ExternalStore | None = None) -> int:
    """Index every checkpoint folder on disk (and its model); forget rows whose folder is gone."""
    on_disk = disk.list()
    known = store.all_checkpoint_paths()
    added = 0
    exports = []
    if external is not None:
        external.clean_partial_writes()
        exports = external.list()
        for ext in exports:
            if ext.tinker_path not in known:
                store.add_checkpoint(external_row(ext))
                added += 1
    for rec in on_disk:
        path = rec.ref.tinker_path
        tenant = checkpoint_owner(rec.meta)
        if path not in known:
            store.add_checkpoint(CheckpointRow.from_record(rec, tenant))
            added += 1
        if store.model(rec.ref.model_id) is None:
            t = rec.time.timestamp()
            session = session_of(rec.ref.model_id)
            row = ModelRow(
                rec.ref.model_id,
                tenant,
                session,
                str(rec.meta.get("base_model", "")),
                dict(rec.meta.get("lora", {})),
                rec.meta.get("parent"),
                t,
                t,
                None,
            )
            store.add_model(row)
    for path in known - {r.ref.tinker_path for r in on_disk} - {e.tinker_path for e in exports}:
        store.delete_checkpoint(path)
    if added:
        log.info("indexed %d checkpoint(s) found on disk", added)
    return added


def checkpoint_json(row: CheckpointRow) -> dict[str, Any]:
    return {
        "checkpoint_id": f"{row.kind}/{row.name}",
        "checkpoint_type": CHECKPOINT_TYPES.get(row.kind, "sampler"),
        "time": _iso(row.created),
        "tinker_path": row.tinker_path,
        "size_bytes": row.size_bytes,
        "public": row.public,
        "expires_at": None if row.expires_at is None else _iso(row.expires_at),
        "user_metadata": row.meta.get("user_metadata"),  # what its save attached
        "base_model": row.meta.get("base_model") or None,  # SDK 0.39's Checkpoint.base_model
    }


class CheckpointApi:
    def __init__(self, disk: CheckpointStore, store: Store, external: ExternalStore | None = None) -> None:
        self.disk = disk
        self.store = store
        self.external = external or ExternalStore(disk.root.parent)

    def _run(self, tenant: str, model_id: str) -> ModelRow:
        row = self.store.model(model_id)
        if row is None or row.tenant != tenant:
            raise NotFound(f"unknown training run {model_id!r}")
        return row

    def _run_json(self, row: ModelRow) -> dict[str, Any]:
        ckpts, _ = self.store.checkpoints(row.tenant, row.id)
        last = {kind: next((c for c in ckpts if c.kind == kind), None) for kind in KINDS}
        return {
            "training_run_id": row.id,
            "base_model": row.base_model,
            "model_owner": row.tenant,
            "is_lora": True,
            "lora_rank": row.lora.get("rank"),
            "last_request_time": _iso(row.last_request),
            "last_checkpoint": checkpoint_json(last["weights"]) if last["weights"] else None,
            "last_sampler_checkpoint": checkpoint_json(last["sampler_weights"])
            if last["sampler_weights"]
            else None,
            "user_metadata": row.user_metadata,
        }

    def training_runs(
        self, tenant: str, limit: int, offset: int, project_id: str | None = None
    ) -> dict[str, Any]:
        rows, total = self.store.models(tenant, limit, offset, project_id)
        return {
            "training_runs": [self._run_json(r) for r in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total},
        }

    def training_run(self, tenant: str, model_id: str) -> dict[str, Any]:
        return self._run_json(self._run(tenant, model_id))

    def checkpoints(self, tenant: str, model_id: str) -> dict[str, Any]:
        self._run(tenant, model_id)
        rows, _ = self.store.checkpoints(tenant, model_id)
        return {"checkpoints": [checkpoint_json(r) for r in rows]}

    def user_checkpoints(self, tenant: str, limit: int, offset: int) -> dict[str, Any]:
        rows, total = self.store.checkpoints(tenant, limit=limit, offset=offset)
        return {
            "checkpoints": [checkpoint_json(r) for r in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total},
        }

    def _row(self, tenant: str, path: str) -> CheckpointRow:
        """``tenant``'s own, unexpired checkpoint at ``path`` (else 404)."""
        row = self.store.checkpoint(path)
        if row is None or row.tenant != tenant or row.expired():
            raise NotFound(f"unknown checkpoint {path!r}")
        return row

    def readable(self, tenant: str, path: str) -> CheckpointRow:
        """The unexpired checkpoint at ``path`` if ``tenant`` owns it or it is published (else 404)."""
        row = self.store.checkpoint(path)
        if row is None or (row.tenant != tenant and not row.public) or row.expired():
            raise NotFound(f"unknown checkpoint {path!r}")
        return row

    def is_public(self, path: str) -> bool:
        row = self.store.checkpoint(path)
        return row is not None and row.public and not row.expired()

    @staticmethod
    def path_of(model_id: str, kind: str, name: str) -> str:
        """The tinker path of a route's ``{model_id}/checkpoints/{kind}/{name}``, every part checked."""
        try:
            if kind == EXTERNAL:
                checkpoint_ref(model_id, "weights", name)  # the same rules for the id and the name
                return f"tinker://{model_id}/{EXTERNAL}/{name}"
            return checkpoint_ref(model_id, kind, name).tinker_path
        except EngineError as e:
            raise NotFound(str(e)) from e

    def delete(self, tenant: str, model_id: str, kind: str, name: str) -> None:
        path = self.path_of(model_id, kind, name)
        self._remove(self._row(tenant, path))

    def _remove(self, row: CheckpointRow) -> None:
        if row.kind == EXTERNAL:
            self.external.delete(row.model_id, row.name)
        else:
            ref = checkpoint_ref(row.model_id, row.kind, row.name)
            if self.disk.exists(ref):
                self.disk.delete(ref)
        self.store.delete_checkpoint(row.tinker_path)

    def set_ttl(self, tenant: str, model_id: str, kind: str, name: str, ttl_seconds: object) -> None:
        path = self.path_of(model_id, kind, name)
        try:
            ttl = check_ttl(ttl_seconds)
        except UserError as e:
            raise BadRequest(str(e)) from None
        self._row(tenant, path)
        self.store.set_checkpoint_expiry(path, expiry(ttl))

    def publish(self, tenant: str, model_id: str, kind: str, name: str, public: bool) -> None:
        path = self.path_of(model_id, kind, name)
        row = self._row(tenant, path)
        if row.public == public:  # 400, not the 409 the SDK names: it retries a 409 for 5 minutes
            raise BadRequest(f"checkpoint {path} is already {'public' if public else 'private'}")
        self.store.set_checkpoint_public(path, public)

    def sweep(self, in_use: set[str], now: float | None = None) -> list[str]:
        """Delete every expired checkpoint that no live sampler uses; returns their paths."""
        now = time.time() if now is None else now
        gone = []
        for row in self.store.expired_checkpoints(now):
            if row.tinker_path in in_use:
                continue  # kept until the sampler's session finishes (see the module docstring)
            try:
                self._remove(row)
            except (OSError, EngineError):
                log.exception("could not delete expired checkpoint %s", row.tinker_path)
                continue
            gone.append(row.tinker_path)
        if gone:
            log.info("deleted %d expired checkpoint(s)", len(gone))
        return gone

    def weights_info(self, tenant: str, tinker_path: str) -> dict[str, Any]:
        meta = self.readable(tenant, tinker_path).meta
        lora = meta.get("lora", {})
        return {
            "base_model": meta.get("base_model", ""),
            "is_lora": True,
            "lora_rank": lora.get("rank"),
            "train_unembed": lora.get("train_unembed"),
            "train_mlp": lora.get("train_mlp"),
            "train_attn": lora.get("train_attn"),
        }


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()
