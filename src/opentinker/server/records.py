"""What the server makes for the ids it hands out, and writes down in its store: training models
(:meth:`Records.new_model`), sampler sessions (:meth:`Records.add_sampler` and its ephemeral
kinds), and the index rows of checkpoints just saved. :class:`~opentinker.server.registry.Registry`
resolves those ids again (and maps what the service raises to HTTP); the lifecycle of what they
name is the service's (:class:`~opentinker.service.lifecycle.Lifecycle`).

Model ids are ``<session_id>:train:<model_seq_id>`` (the SDK derives them itself after
create-from-state), sampler ids ``<session_id>:sample:<sampling_session_seq_id>``: both are built
by ``service/sessions.py``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from opentinker.server.checkpoints import expiry, external_row
from opentinker.server.errors import UserError
from opentinker.server.ordering import Sequencer
from opentinker.server.store import CheckpointRow, ModelRow, SamplerRow, Store
from opentinker.service import LoRAConfig, Runtime, SamplingClient, SnapshotInfo
from opentinker.service.checkpoints import parse_tinker_path
from opentinker.service.lifecycle import Lifecycle
from opentinker.service.runtime import ModelRecord
from opentinker.service.sessions import model_id_in


@dataclass
class Session:
    id: str
    tenant: str
    samplers: set[str] = field(default_factory=set)
    finished: bool = False


@dataclass
class Sampler:
    id: str
    tenant: str
    client: SamplingClient
    model_path: str | None
    owner: str | None = None  # the model an ephemeral snapshot was taken from
    foreign: bool = False  # made from another tenant's published checkpoint


class Records:
    """The making and recording half of the registry (its attributes are the registry's)."""

    runtime: Runtime
    store: Store
    seq: Sequencer
    life: Lifecycle
    samplers: dict[str, Sampler]
    _lock: threading.Lock

    def new_model(
        self,
        sess: Session,
        model_seq_id: int,
        base_model: str,
        *,
        config: LoRAConfig | None = None,
        optimizer_type: str = "adamw",
        checkpoint: str | None = None,
        optimizer: bool = False,
        user_metadata: dict[str, Any] | None = None,
    ) -> Future[ModelRecord]:
        """Create ``<session>:train:<seq>`` fresh (``config``, ``optimizer_type``) or from the
        tinker path ``checkpoint`` (with its optimizer state if ``optimizer``), through the same
        runtime methods as the embedded client: ``user_metadata`` is kept on the model and its
        ``{"data_parallel": "k"}`` picks the degree (default: the server's ``--data-parallel``).

        The runtime makes the model; here it is recorded durably, on the scheduler thread right
        after the engine made its adapter (before any later request for it can run).
        """
        model_id = model_id_in(sess.id, model_seq_id)
        if model_id in self.runtime.models or self.store.model(model_id) is not None:
            raise UserError(f"model {model_id!r} already exists (model_seq_id {model_seq_id} was used)")

        def created(rec: ModelRecord) -> None:
            now = time.time()
            row = ModelRow(
                model_id,
                sess.tenant,
                sess.id,
                rec.base_model,
                dataclasses.asdict(rec.lora),
                rec.parent,
                now,
                now,
                rec.user_metadata,
            )
            self.store.add_model(row)
            self.seq.open(model_id)

        if checkpoint is not None:
            return self.runtime.create_model_from_checkpoint(
                model_id,
                checkpoint,
                tenant=sess.tenant,
                optimizer=optimizer,
                base_model=base_model,
                on_created=created,
                user_metadata=user_metadata,
            )
        assert config is not None
        return self.runtime.create_model(
            model_id,
            base_model,
            config,
            tenant=sess.tenant,
            optimizer_type=optimizer_type,
            on_created=created,
            user_metadata=user_metadata,
        )

    def record_external(self, path: str, *, ttl_seconds: int | None = None) -> int:
        """Index the external weights just written at ``path``; returns their size in bytes."""
        model_id, _, name = path.removeprefix("tinker://").partition("/external_weights/")
        rec = self.runtime.external.record(model_id, name)
        assert rec is not None
        self.store.add_checkpoint(external_row(rec, expiry(ttl_seconds)))
        return rec.size_bytes

    def in_use_checkpoints(self) -> set[str]:
        """Tinker paths that a live sampler was made from (the TTL sweep keeps their files)."""
        with self._lock:
            return {s.model_path for s in self.samplers.values() if s.model_path is not None}

    def record_checkpoint(
        self,
        tenant: str,
        path: str,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> None:
        """Index the checkpoint just saved at ``path``, with what its save attached
        (``user_metadata``, kept in the index row's meta: ``search_checkpoints`` filters on it)."""
        rec = self.runtime.store.record(parse_tinker_path(path))
        row = CheckpointRow.from_record(rec, tenant, expiry(ttl_seconds))
        if user_metadata:
            row = dataclasses.replace(row, meta={**row.meta, "user_metadata": dict(user_metadata)})
        self.store.add_checkpoint(row)

    def add_sampler(
        self,
        sess: Session,
        sampler_id: str,
        client: SamplingClient,
        *,
        owner: str | None = None,
        ephemeral: bool = False,
    ) -> Sampler:
        """Serve ``client`` as ``sampler_id`` and record it; ``ephemeral``: it serves in-memory
        weights (an owned snapshot, or an inflight target), which another process cannot serve
        again (its row says so: never served again as a base-model sampler)."""
        sampler = Sampler(sampler_id, sess.tenant, client, client.model_path, owner)
        if client.model_path is not None:
            row = self.store.checkpoint(client.model_path)
            sampler.foreign = row is not None and row.tenant != sess.tenant
        self.store.add_sampler(
            SamplerRow(
                sampler_id, sess.tenant, sess.id, client.base_model, client.model_path,
                ephemeral or owner is not None,
            )
        )  # fmt: skip
        with self._lock:
            self.samplers[sampler_id] = sampler
            sess.samplers.add(sampler_id)
        return sampler

    def snapshot_sampler(
        self, sess: Session, sampler_id: str, snap: SnapshotInfo, base_model: str
    ) -> Sampler:
        client = SamplingClient(self.runtime, base_model, snap.snapshot_id)
        self.life.hold(sess.id, base_model, snap.snapshot_id, snap.adapter_id)
        return self.add_sampler(sess, sampler_id, client, owner=snap.adapter_id)

    def inflight_sampler(
        self, sess: Session, sampler_id: str, snap: SnapshotInfo, base_model: str
    ) -> Sampler:
        """A ``kind="inflight"`` sampler: ``snap`` becomes its model's inflight target, which
        every inflight sampler of that model follows (``service/inflight.py``)."""
        client = self.life.inflight.follow(
            base_model, snap.adapter_id, snap.snapshot_id, sampler_id=sampler_id
        )
        return self.add_sampler(sess, sampler_id, client, ephemeral=True)
