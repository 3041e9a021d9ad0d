"""What the server holds live, per tenant: sessions, training models, sampler sessions.

Each SDK session's models are the service's ``TrainingClient``s and its sampler sessions the
service's ``SamplingClient``s (what the embedded client hands out too), all over the one shared
:class:`~opentinker.service.Runtime` (one engine and one scheduler per base model). This module resolves the ids the SDK sends to those objects — refusing with 404 any id
that is unknown *or another tenant's* — and records them in the store.

A session that goes quiet — no heartbeat and no request for ``session_inactive_s`` — is inactive,
and :meth:`Registry.evict_idle` takes its models out of memory: each one's state (weights and
optimizer) is saved first, to ``tinker://<model>/weights/evicted-<unix time>``, in the model's
order, and only once that save has succeeded is its adapter freed. A request for an evicted model
then names that checkpoint, which ``create_training_client_from_state_with_optimizer`` restores.

Model ids are ``<session_id>:train:<model_seq_id>`` (the SDK derives them itself after
create-from-state), sampler ids ``<session_id>:sample:<sampling_session_seq_id>``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
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
from opentinker.service.runtime import BaseModelInfo, ModelRecord
from opentinker.service.sessions import UnknownSession, model_id_in, session_of

log = logging.getLogger(__name__)
GONE_KEPT = 10_000  # inflight samplers whose 404 still says why their weights went (the newest)


@dataclass
class Session:
    id: str
    tenant: str
    models: set[str] = field(default_factory=set)
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


@dataclass
class InflightTarget:
    """The shared weights target of a training model's ``kind="inflight"`` samplers: its newest
    inflight save (``current``) and the one before (kept until the next save, so a request that
    read it just before an update still finds it)."""

    base_model: str
    owner: str  # the training model (the snapshots' queue)
    current: str
    previous: str | None = None
    clients: list[SamplingClient] = field(default_factory=list)
    sampler_ids: list[str] = field(default_factory=list)


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
        self.inflight: dict[str, InflightTarget] = {}  # training model -> its inflight samplers' target
        self.trainers: dict[str, TrainingClient] = {}
        self._lock = threading.Lock()
        self._touched: dict[str, float] = {}
        self._seen: dict[str, float] = {}  # session id -> monotonic time of its last heartbeat/request
        self.evicting: set[str] = set()  # models whose state is being saved before eviction
        self.evicted: dict[str, str] = {}  # model id -> the checkpoint its state was saved to
        self._evict_failed: dict[str, float] = {}  # model id -> when its last eviction save failed
        self.unloaded: set[str] = set()  # models freed by /unload_model (their checkpoints stay)
        # inflight samplers whose model left memory: why their weights are gone (their 404), the
        # newest GONE_KEPT
        self.gone: dict[str, str] = {}

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
            self._seen[sess.id] = time.monotonic()
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
        self._seen[sess.id] = time.monotonic()
        return sess

    def seen(self, session_id: str) -> None:
        """The session is active: a heartbeat or a request of one of its models just came."""
        self._seen[session_id] = time.monotonic()
        self.runtime.sessions.seen(session_id)

    def touch(self, key: str, fn: Any, *args: Any) -> None:
        """Write a last-seen time at most every few seconds per id."""
        now = time.monotonic()
        if now - self._touched.get(key, 0.0) > 5.0:
            self._touched[key] = now
            fn(*args)

    def finish_session(self, sess: Session, reason: str) -> None:
        """Mark it finished and free what it held: its adapters and its ephemeral snapshots."""
        sess.finished = True
        self.runtime.sessions.finish(sess.id, reason)
        with self._lock:
            models, samplers = list(sess.models), list(sess.samplers)
        for model_id in models:
            self.seq.close(model_id, f"session {sess.id} is finished")
            rec = self.runtime.models.get(model_id)
            if rec is not None and not rec.deleted:
                self.runtime.delete_model(model_id)  # queued after what the model still has to run
            self.trainers.pop(model_id, None)
        for model_id in models:
            self.drop_inflight(model_id, f"its session {sess.id} is finished")
        for sampler_id in samplers:
            sampler = self.samplers.pop(sampler_id, None)
            if sampler is not None and sampler.owner is not None and sampler.client.policy is not None:
                self.runtime.release_snapshot(
                    sampler.client.base_model, sampler.client.policy, queue=sampler.owner
                )

    # ------------------------------------------------------------------ models
    def drop_inflight(self, model_id: str, why: str) -> None:
        """Release the snapshots held only for ``model_id``'s inflight samplers (its current and
        previous inflight saves) and retire those samplers: their requests get a 404 saying
        ``why``. Requests already decoding finish (their rows keep the weights alive)."""
        with self._lock:
            target = self.inflight.pop(model_id, None)
            if target is None:
                return
            for sampler_id in target.sampler_ids:
                self.gone[sampler_id] = (
                    f"sampler {sampler_id!r} followed the inflight weights of model {model_id!r}, which "
                    f"are gone: {why}; save weights for a sampler again"
                )
                self.samplers.pop(sampler_id, None)
            for old in list(itertools.islice(self.gone, max(0, len(self.gone) - GONE_KEPT))):
                del self.gone[old]  # the oldest reasons: such a sampler then gets a plain 404
            for sess in self.sessions.values():
                sess.samplers.difference_update(target.sampler_ids)
        for snapshot_id in (target.current, target.previous):
            if snapshot_id is not None:
                self.runtime.release_snapshot(target.base_model, snapshot_id, queue=target.owner)

    def model(self, tenant: str, model_id: str) -> TrainingClient:
        try:
            self.runtime.model(model_id, tenant)
            if model_id in self.evicting:
                raise EngineError("evicting")
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
        except EngineError:
            if model_id in self.unloaded:
                raise NotFound(
                    f"model {model_id!r} was unloaded; its checkpoints remain: create a training "
                    "client from one of them to train on"
                ) from None
            path = self.evicted.get(model_id)
            if path is not None or model_id in self.evicting:
                where = f"its state is saved at {path}" if path else "its state is being saved"
                raise NotFound(
                    f"model {model_id!r} was evicted from memory because its session was inactive "
                    f"(no heartbeat or request for a while); {where}: restore it with "
                    "create_training_client_from_state_with_optimizer"
                ) from None
            raise NotFound(f"model {model_id!r} is closed (its session finished)") from None
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

    # ------------------------------------------------------------------ inactive sessions
    def evict_idle(self, inactive_s: float) -> list[str]:
        """Start evicting the live models of every session quiet for ``inactive_s``; returns them.

        Each model's state is saved in its order (after what it has queued); it is dropped only
        when the save succeeded. Until then its requests are refused, so nothing it does after
        the save can be lost. A failed save leaves it loaded; it is tried again ``inactive_s`` later.
        """
        now = time.monotonic()
        with self._lock:
            idle = [
                s
                for s in self.sessions.values()
                if not s.finished and s.models and now - self._seen.get(s.id, now) > inactive_s
            ]
        started = []
        for sess in idle:
            with self._lock:
                models = sorted(sess.models)
            for model_id in models:
                if (
                    model_id in self.evicting
                    or now - self._evict_failed.get(model_id, -inactive_s) < inactive_s
                ):
                    continue
                rec = self.runtime.models.get(model_id)
                if rec is None or rec.deleted:
                    continue
                self._evict(sess, model_id)
                started.append(model_id)
        return started

    def _evict(self, sess: Session, model_id: str) -> None:
        self.evicting.add(model_id)
        tc = self.trainers.get(model_id) or TrainingClient(self.runtime, model_id)
        name = f"evicted-{int(time.time())}"
        try:
            fut = tc.save_state(name, overwrite=True).future()
        except BaseException:
            self.evicting.discard(model_id)
            raise

        def saved(f: Future[Any]) -> None:
            try:
                path = f.result().path
                self.record_checkpoint(sess.tenant, path)
            except BaseException:
                log.exception("saving the state of inactive model %s failed; it stays loaded", model_id)
                self._evict_failed[model_id] = time.monotonic()
                self.evicting.discard(model_id)
                return
            self.evicted[model_id] = path
            self.seq.close(model_id, f"model {model_id} was evicted; its state is saved at {path}")
            self.runtime.delete_model(model_id)
            self.trainers.pop(model_id, None)
            self.drop_inflight(model_id, f"the model was evicted (its state is saved at {path})")
            with self._lock:
                sess.models.discard(model_id)
            self.evicting.discard(model_id)
            log.info("session %s is inactive: model %s saved to %s and evicted", sess.id, model_id, path)

        fut.add_done_callback(saved)

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
        self.seq.close(model_id, f"model {model_id} was unloaded before this request's turn came")
        freed = self.runtime.delete_model(model_id, tenant)
        self.trainers.pop(model_id, None)
        self.drop_inflight(model_id, "the model was unloaded")
        with self._lock:
            for sess in self.sessions.values():
                sess.models.discard(model_id)
        return freed

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
            with self._lock:
                sess.models.add(model_id)
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
        return self.add_sampler(sess, sampler_id, client, owner=snap.adapter_id)

    def inflight_sampler(
        self, sess: Session, sampler_id: str, snap: SnapshotInfo, base_model: str
    ) -> Sampler:
        """A ``kind="inflight"`` sampler: ``snap`` becomes its model's inflight target, and every
        inflight sampler of that model (this one and the earlier ones) serves its next requests on
        it. Their requests already decoding continue on it from their next token, keys and values
        kept (the sampling loop's ``FollowInflight``; the exact rule is ``StepDecoder.switch``'s)."""
        stale = None
        client = SamplingClient(self.runtime, base_model, snap.snapshot_id)
        client.follow = snap.adapter_id
        client.kv_namespace = f"sampler:{sampler_id}"  # its own KV-cache namespace (service/inflight.py)
        with self._lock:
            target = self.inflight.get(snap.adapter_id)
            if target is None:
                target = self.inflight[snap.adapter_id] = InflightTarget(
                    base_model, snap.adapter_id, snap.snapshot_id
                )
            else:
                stale, target.previous, target.current = target.previous, target.current, snap.snapshot_id
            for other in target.clients:
                other.policy = snap.snapshot_id
            target.clients.append(client)
            target.sampler_ids.append(sampler_id)
        self.runtime.follow_inflight(base_model, snap.adapter_id, snap.snapshot_id)
        if stale is not None:
            self.runtime.release_snapshot(base_model, stale, queue=snap.adapter_id)
        # the target owns (releases) its snapshots
        return self.add_sampler(sess, sampler_id, client, ephemeral=True)

    def sampler(self, tenant: str, sampler_id: str) -> Sampler:
        with self._lock:
            sampler = self.samplers.get(sampler_id)
        if sampler is None and sampler_id in self.gone:
            row = self.store.sampler(sampler_id)
            if row is not None and row.tenant == tenant:
                raise NotFound(self.gone[sampler_id])
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
