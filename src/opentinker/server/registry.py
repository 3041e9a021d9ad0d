"""What the server holds live, per tenant: the ids of sessions, training models and samplers.

Each SDK session's models are the service's ``TrainingClient``s and its sampler sessions the
service's ``SamplingClient``s (what the embedded client hands out too), all over the one shared
:class:`~opentinker.service.Runtime`. This module resolves the ids the SDK sends to those objects —
refusing with 404 any id that is unknown *or another tenant's*; :mod:`.records` makes them and
writes them down.
Their lifecycle (a session's finish, eviction of a quiet session's models, inflight targets) is
the service's :class:`~opentinker.service.lifecycle.Lifecycle`, which the embedded client calls
too; this module hears of each model leaving memory and forgets its ids.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

from opentinker.server.errors import Gone, NotFound, UserError
from opentinker.server.ordering import Sequencer
from opentinker.server.records import Records, Sampler, Session
from opentinker.server.store import ModelRow, SamplerRow, Store
from opentinker.service import (
    CheckpointError,
    EngineError,
    Runtime,
    SamplingClient,
    TrainingClient,
    UnknownPolicyError,
    canonical_name,
)
from opentinker.service.checkpoints import CheckpointRef
from opentinker.service.lifecycle import lifecycle_of
from opentinker.service.runtime import BaseModelInfo
from opentinker.service.sessions import UnknownSession, session_of


class Registry(Records):
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
