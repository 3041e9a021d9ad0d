"""What the server holds live, per tenant: the ids of sessions, training models and samplers.

Each SDK session's models are the service's ``TrainingClient``s and its sampler sessions the
service's ``SamplingClient``s (what the embedded client hands out too), all over the one shared
:class:`~opentinker.service.Runtime`. This module resolves the ids the SDK sends to those objects —
refusing with 404 any id that is unknown *or another tenant's* — and records them in the store.
Their lifecycle (a session's finish, eviction of a quiet session's models, inflight targets) is
the service's :class:`~opentinker.service.lifecycle.Lifecycle`, which the embedded client calls
too; this module hears of each model leaving memory and forgets its ids.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from opentinker.server.checkpoints import expiry, external_row
from opentinker.server.errors import Gone, NotFound, UserError
from opentinker.server.ordering import Sequencer
from opentinker.server.store import CheckpointRow, ModelRow, SamplerRow, Store
from opentinker.service import (
    CheckpointError,
    EngineError,
    LoRAConfig,
    Runtime,
    SamplingClient,
    SnapshotInfo,
    TrainingClient,
    UnknownPolicyError,
    canonical_name,
)
from opentinker.service.checkpoints import CheckpointRef, parse_tinker_path
from opentinker.service.lifecycle import lifecycle_of
from opentinker.service.runtime import BaseModelInfo, ModelRecord
from opentinker.service.sessions import UnknownSession, model_id_in, session_of


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


class Registry:
    def __init__(self, runtime: Runtime, store: Store, sequencer: Sequencer, base_models: list[str]) -> None:
        self.runtime = runtime
        self.store = store
        self.seq = sequencer
        self.served: dict[str, str] = {}  # canonical name -> the engine's base model name
        for name in base_models:
            self.served[canonical_name(name)] = runtime.base_model_info(name).name
        self.sessions: dict[str, Session] = {}
        self.samplers: dict[str, Sampler] = {}
        self.trainers: dict[str, TrainingClient] = {}
        self._lock = threading.Lock()
        self._touched: dict[str, float] = {}
        self.unloaded: set[str] = set()  # models freed by /unload_model (their checkpoints stay)
        self.life = lifecycle_of(runtime)
        self.life.listen(self._departed)
        self.life.on_saved = self.record_checkpoint  # an eviction's save, indexed

    # ------------------------------------------------------------------ base models
    def base_model(self, name: str) -> str:
        base = self.served.get(canonical_name(name))
        if base is None:
            raise UserError(
                f"base model {name!r} is not served here; served: {', '.join(self.served) or 'none'}"
            )
        return base

    def base_info(self, base_model: str) -> BaseModelInfo:
        return self.runtime.base_model_info(base_model)

    # ------------------------------------------------------------------ sessions
    def create_session(self, tenant: str, meta: dict[str, Any]) -> Session:
        rec = self.runtime.sessions.create(tenant, meta)
        sess = Session(rec.id, tenant)
        with self._lock:
            self.sessions[sess.id] = sess
        self.life.seen(sess.id)
        return sess

    def session(self, tenant: str, session_id: str, *, live: bool = True) -> Session:
        with self._lock:
            sess = self.sessions.get(session_id)
        if sess is None or sess.tenant != tenant:
            try:
                row = self.runtime.sessions.get(tenant, session_id)
            except UnknownSession as e:
                raise NotFound(str(e)) from None
            # a session of an earlier server process: usable for new models and samplers
            sess = Session(row.id, tenant, finished=row.finished is not None)
            with self._lock:
                sess = self.sessions.setdefault(session_id, sess)
        if live and sess.finished:
            raise Gone(f"session {session_id!r} is finished")
        self.life.seen(sess.id)
        return sess

    def seen(self, session_id: str) -> None:
        """The session is active: a heartbeat or a request of one of its models just came."""
        self.life.seen(session_id)

    def touch(self, key: str, fn: Any, *args: Any) -> None:
        """Write a last-seen time at most every few seconds per id."""
        now = time.monotonic()
        if now - self._touched.get(key, 0.0) > 5.0:
            self._touched[key] = now
            fn(*args)

    def finish_session(self, sess: Session, reason: str) -> None:
        """Mark it finished and free what it held (the service's :meth:`Lifecycle.finish`)."""
        sess.finished = True
        self.life.finish(sess.id, reason)
        with self._lock:
            for sampler_id in sess.samplers:
                self.samplers.pop(sampler_id, None)
            sess.samplers.clear()

    def _departed(self, model_id: str, why: str, retired: list[str]) -> None:
        """A model left memory: its held requests fail; its inflight samplers are retired."""
        self.seq.close(model_id, f"model {model_id} left memory before this request's turn came: {why}")
        self.trainers.pop(model_id, None)
        with self._lock:
            for sampler_id in retired:
                self.samplers.pop(sampler_id, None)
            for sess in self.sessions.values():
                sess.samplers.difference_update(retired)

    # ------------------------------------------------------------------ models
    def model(self, tenant: str, model_id: str) -> TrainingClient:
        try:
            self.life.model(model_id, tenant)
        except UnknownPolicyError:
            row = self.store.model(model_id)
            if row is not None and row.tenant == tenant:
                if row.parent is not None and self._is_copy(row):
                    raise NotFound(
                        f"training run {model_id!r} holds a copy of {row.parent} and cannot be trained "
                        "on; create a training client from its checkpoint"
                    ) from None
                raise NotFound(
                    f"model {model_id!r} is not loaded: it was live in an earlier server process. "
                    "Create a training client from one of its checkpoints."
                ) from None
            raise NotFound(f"unknown model {model_id!r}") from None
        except EngineError as e:  # left memory: the service says why
            raise NotFound(str(e)) from None
        tc = self.trainers.get(model_id)
        if tc is None:
            tc = self.trainers[model_id] = TrainingClient(self.runtime, model_id)
        self.touch(model_id, self.store.touch_model, model_id)
        self.seen(session_of(model_id))
        return tc

    def _is_copy(self, row: ModelRow) -> bool:
        """Whether the run only holds checkpoints that ``copy_weights`` made."""
        ckpts, _ = self.store.checkpoints(row.tenant, row.id)
        return bool(ckpts) and all(c.meta.get("copied_from") for c in ckpts)

    def evict_idle(self, inactive_s: float) -> list[str]:
        """The service's :meth:`Lifecycle.evict_idle`: the models of quiet sessions, saved and freed."""
        return self.life.evict_idle(inactive_s)

    def unload_model(self, tenant: str, model_id: str) -> Future[None]:
        """Free ``tenant``'s model after the requests already queued for it; requests still held
        for their turn fail; later ones are refused. Unloading it again is a no-op."""
        if model_id in self.unloaded:
            row = self.store.model(model_id)
            if row is None or row.tenant != tenant:
                raise NotFound(f"unknown model {model_id!r}")
            done: Future[None] = Future()
            done.set_result(None)
            return done
        self.model(tenant, model_id)  # 404 unless it is the tenant's live model
        self.unloaded.add(model_id)
        refusal = (
            f"model {model_id!r} was unloaded; its checkpoints remain: create a training client from "
            "one of them to train on"
        )
        return self.life.free(model_id, "the model was unloaded", tenant=tenant, refusal=refusal)

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

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, tenant: str, path: str) -> tuple[CheckpointRef, dict[str, Any]]:
        """The checkpoint at ``path`` and its manifest metadata, if ``tenant`` owns it or it is
        published, and it has not expired (else 404)."""
        try:
            found = self.runtime.checkpoint(path, tenant)
        except (CheckpointError, UnknownPolicyError):
            raise NotFound(f"unknown checkpoint {path!r}") from None
        except EngineError as e:  # a malformed path: the message says what is expected
            raise NotFound(str(e)) from None
        row = self.store.checkpoint(found[0].tinker_path)
        if row is not None and row.expired():
            raise NotFound(f"unknown checkpoint {path!r} (it expired)")
        return found

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

    def record_checkpoint(self, tenant: str, path: str, *, ttl_seconds: int | None = None) -> None:
        rec = self.runtime.store.record(parse_tinker_path(path))
        row = CheckpointRow.from_record(rec, tenant, expiry(ttl_seconds))
        self.store.add_checkpoint(row)

    # ------------------------------------------------------------------ samplers
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

    def sampler(self, tenant: str, sampler_id: str) -> Sampler:
        with self._lock:
            sampler = self.samplers.get(sampler_id)
        gone = self.life.inflight.gone.get(sampler_id) if sampler is None else None
        if gone is not None:
            row = self.store.sampler(sampler_id)
            if row is not None and row.tenant == tenant:
                raise NotFound(gone)
        if sampler is not None and sampler.tenant == tenant:
            if sampler.foreign and sampler.model_path and not self.runtime.is_public(sampler.model_path):
                # another tenant's checkpoint, unpublished since: as unknown as the checkpoint
                raise NotFound(f"unknown checkpoint {sampler.model_path!r} (it is no longer published)")
            return sampler
        row = self.store.sampler(sampler_id)
        if row is None or row.tenant != tenant:
            raise NotFound(f"unknown sampler {sampler_id!r}")
        if row.ephemeral or row.model_path is None:
            if row.model_path is None and not row.ephemeral:  # a base-model sampler: recreate it
                sess = self.session(tenant, row.session_id, live=False)
                return self.add_sampler(sess, sampler_id, SamplingClient(self.runtime, row.base_model, None))
            raise NotFound(
                f"sampler {sampler_id!r} served an in-memory snapshot that is gone (the server restarted "
                "or its session finished); save weights for the sampler again"
            )
        raise SamplerNotLoaded(row)

    def reload_sampler(self, row: SamplerRow) -> Sampler:
        """Serve a durable sampler of an earlier process again (blocking: it loads weights)."""
        assert row.model_path is not None
        sess = self.session(row.tenant, row.session_id, live=False)
        client = SamplingClient.for_checkpoint(self.runtime, row.model_path, tenant=row.tenant)
        return self.add_sampler(sess, row.id, client)


class SamplerNotLoaded(NotFound):
    """A sampler over saved weights, known from an earlier process: load it, then retry."""

    def __init__(self, row: SamplerRow) -> None:
        super().__init__(f"sampler {row.id!r} is not loaded (its weights are at {row.model_path})")
        self.row = row
