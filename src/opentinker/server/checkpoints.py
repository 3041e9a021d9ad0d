"""The checkpoint REST routes' logic (``RestClient``): training runs, checkpoints, weights info.

Everything is filtered by tenant: another tenant's runs and checkpoints do not exist (404). The
folders under ``<data-dir>/checkpoints`` are the truth; :func:`reconcile` re-indexes them into the
store at start-up, so checkpoints written by an earlier process — even one killed mid-way — are
listed and loadable after a restart, and deleted folders drop out of the index.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from opentinker.client.checkpoints import KINDS, CheckpointStore, checkpoint_ref
from opentinker.client.runtime import checkpoint_owner
from opentinker.engine import EngineError
from opentinker.server.errors import NotFound
from opentinker.server.store import CheckpointRow, ModelRow, Store

log = logging.getLogger(__name__)


def reconcile(disk: CheckpointStore, store: Store) -> int:
    """Index every checkpoint folder on disk (and its model); forget rows whose folder is gone."""
    on_disk = disk.list()
    known = store.all_checkpoint_paths()
    added = 0
    for rec in on_disk:
        path = rec.ref.tinker_path
        tenant = checkpoint_owner(rec.meta)
        if path not in known:
            store.add_checkpoint(
                CheckpointRow(
                    path,
                    tenant,
                    rec.ref.model_id,
                    rec.ref.kind,
                    rec.ref.name,
                    rec.time.timestamp(),
                    rec.size_bytes,
                    rec.meta,
                )
            )
            added += 1
        if store.model(rec.ref.model_id) is None:
            t = rec.time.timestamp()
            session = rec.ref.model_id.split(":train:", 1)[0]
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
    for path in known - {r.ref.tinker_path for r in on_disk}:
        store.delete_checkpoint(path)
    if added:
        log.info("indexed %d checkpoint(s) found on disk", added)
    return added


def checkpoint_json(row: CheckpointRow) -> dict[str, Any]:
    return {
        "checkpoint_id": f"{row.kind}/{row.name}",
        "checkpoint_type": "training" if row.kind == "weights" else "sampler",
        "time": _iso(row.created),
        "tinker_path": row.tinker_path,
        "size_bytes": row.size_bytes,
    }


class CheckpointApi:
    def __init__(self, disk: CheckpointStore, store: Store) -> None:
        self.disk = disk
        self.store = store

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
        row = self.store.checkpoint(path)
        if row is None or row.tenant != tenant:
            raise NotFound(f"unknown checkpoint {path!r}")
        return row

    def delete(self, tenant: str, model_id: str, kind: str, name: str) -> None:
        try:
            ref = checkpoint_ref(model_id, kind, name)
        except EngineError as e:
            raise NotFound(str(e)) from e
        self._row(tenant, ref.tinker_path)
        if self.disk.exists(ref):
            self.disk.delete(ref)
        self.store.delete_checkpoint(ref.tinker_path)

    def weights_info(self, tenant: str, tinker_path: str) -> dict[str, Any]:
        meta = self._row(tenant, tinker_path).meta
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
