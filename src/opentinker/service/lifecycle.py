"""The lifecycle of sessions, models and samplers, written once for both front-ends.

:class:`Lifecycle` is what the embedded ``ServiceClient`` and the HTTP server both call to end
what they made: a session's finish frees its live models and the snapshots its samplers hold; a
model leaves memory by an explicit delete (``/unload_model``), its session's finish, or, with no
memory budget (``memory_budget="off"``, or models on trainer workers), **eviction**: a session that goes quiet (no heartbeat and no request for ``inactive_s``) has its
models' state (weights and optimizer) saved first, to ``tinker://<model>/weights/evicted-<unix
time>``, in the model's order, and only once that save has succeeded is its adapter freed. Until
then the model's requests are refused, so nothing it does after the save is lost; a failed save
leaves it loaded, tried again ``inactive_s`` later. A model that left memory is refused with why
(the runtime's ``model`` raises its reason), and its inflight target (:mod:`.inflight`) goes with
it. What only a front-end keeps (the server's ordering of held requests, its id maps, its durable
index of checkpoints) hears of each departure through :meth:`Lifecycle.listen`.

Under a memory budget nothing is evicted: a quiet session's models are paged out first and stay
servable (``engine/paging.py``); a model the budget cannot hold is refused at create
(:meth:`Lifecycle.check_room`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from opentinker.engine import Engine, EngineError, Trainer, UnknownPolicyError
from opentinker.lora import LoRAConfig
from opentinker.models.registry import canonical_name
from opentinker.scheduler import ModelQueue
from opentinker.service.inflight import PerRuntime, inflight_of
from opentinker.service.runtime import ModelRecord, Runtime
from opentinker.service.sessions import session_of
from opentinker.service.training import TrainingClient

log = logging.getLogger(__name__)

# (model id, why it left, the inflight samplers retired with it)
Departure = Callable[[str, str, list[str]], None]
Saved = Callable[[str, str], None]  # (tenant, tinker path): an eviction saved a model's state


class ModelEvicting(EngineError):
    """The model's state is being saved before it is evicted: refused until that is done."""


@dataclass(frozen=True)
class Held:
    """A snapshot one of a session's samplers serves, released when the session finishes."""

    base_model: str
    snapshot_id: str
    queue: str  # the model it was taken from


class Lifecycle:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.inflight = inflight_of(runtime)
        self._lock = threading.Lock()
        self._held: dict[str, list[Held]] = {}
        self._listeners: list[Departure] = []
        self.on_saved: Saved | None = None  # the server indexes an eviction's checkpoint
        self.evicting: set[str] = set()  # models whose state is being saved before eviction
        self.evicted: dict[str, str] = {}  # model id -> the checkpoint its state was saved to
        self._evict_failed: dict[str, float] = {}  # model id -> when its last eviction save failed
        self._quiet: set[str] = set()  # models paged out for their session's quiet spell

    def listen(self, departure: Departure) -> None:
        """Call ``departure(model_id, why, retired_samplers)`` when a model leaves memory, before
        its adapter is freed."""
        self._listeners.append(departure)

    # ------------------------------------------------------------------ sessions
    def seen(self, session_id: str) -> None:
        """The session is active: a heartbeat or a request of one of its models just came (the
        embedded training clients say so on each call)."""
        self.runtime.sessions.seen(session_id)

    def hold(self, session_id: str, base_model: str, snapshot_id: str, queue: str) -> None:
        """A sampler of ``session_id`` serves ``snapshot_id``: released when the session finishes."""
        with self._lock:
            self._held.setdefault(session_id, []).append(Held(base_model, snapshot_id, queue))

    def live_models(self, session_id: str) -> list[str]:
        """The session's models in memory, in creation order."""
        return [
            m
            for m, rec in list(self.runtime.models.items())
            if session_of(m) == session_id and not rec.deleted
        ]

    def finish(self, session_id: str, reason: str) -> list[Future[None]]:
        """Mark the session finished with ``reason`` and free what it held: its models (queued
        after what each still has to run; returned) and the snapshots its samplers serve."""
        self.runtime.sessions.finish(session_id, reason)
        why = f"its session {session_id} is finished"
        closed = f"model {{}} is closed (its session {session_id} is finished)"
        freed = [self.free(m, why, refusal=closed.format(repr(m))) for m in self.live_models(session_id)]
        with self._lock:
            held = self._held.pop(session_id, [])
        for h in held:
            self.runtime.release_snapshot(h.base_model, h.snapshot_id, queue=h.queue)
        return freed

    # ------------------------------------------------------------------ models
    def free(
        self, model_id: str, why: str, *, tenant: str | None = None, refusal: str | None = None
    ) -> Future[None]:
        """Take ``model_id`` out of memory (``why``: for the departure's listeners and its inflight
        samplers; ``refusal``: what its later requests are told, default "was deleted"); its
        adapter is freed after the requests already queued for it. Unknown or another tenant's:
        ``UnknownPolicyError``; already gone: the refusal, as ``EngineError``."""
        self.runtime.model(model_id, tenant)
        retired = self.inflight.drop(model_id, why)
        for departure in self._listeners:
            departure(model_id, why, retired)
        return self.runtime.delete_model(model_id, tenant, why=refusal)

    def model(self, model_id: str, tenant: str | None = None) -> ModelRecord:
        """The live model, refused while it is being saved for eviction (:class:`ModelEvicting`)."""
        rec = self.runtime.model(model_id, tenant)
        if model_id in self.evicting:
            raise ModelEvicting(
                f"model {model_id!r} was evicted from memory because its session was inactive (no "
                "heartbeat or request for a while); its state is being saved: restore it with "
                "create_training_client_from_state_with_optimizer"
            )
        return rec

    # ------------------------------------------------------------------ memory
    def pages_models(self) -> bool:
        """Whether models' state pages under a memory budget (models trained in this process)."""
        return self.runtime.budget.limit is not None and self.runtime.config.trainer_workers == 0

    def page_out(self, model_id: str) -> Future[None]:
        """Page ``model_id``'s state out now, in its order (a quiet session's models go first)."""
        rec = self.runtime.model(model_id)

        def out(eng: Trainer) -> None:
            if isinstance(eng, Engine):
                eng.pages.page_out([model_id])

        return self.runtime.base_stack(rec.base_model).scheduler.submit_call(ModelQueue(model_id), out)

    def check_room(self, base_model: str, config: LoRAConfig) -> None:
        """Refuse, changing nothing, a model the memory budget cannot hold (``Engine.check_room``);
        a base model not loaded yet is left to the creation (which loads it, or names why not)."""
        if canonical_name(base_model) in self.runtime.loaded_base_models():
            self.runtime.base_stack(base_model).engine.check_room(config)

    # ------------------------------------------------------------------ inactive sessions
    def evict_idle(self, inactive_s: float) -> list[str]:
        """Start evicting the live models of every session quiet for ``inactive_s``; returns them
        (the module docstring's rule). A session never seen is never evicted. The refusal while a
        save runs is :meth:`model`'s, which the server resolves every request through; embedded,
        no sweeper runs, and a program that calls this itself calls it between its requests.

        Under a memory budget (models trained in this process) nothing is evicted: a quiet
        session's models are paged out first instead, and stay servable (:meth:`_page_out_idle`)."""
        if self.pages_models():
            return self._page_out_idle(inactive_s)
        now = time.monotonic()
        started = []
        for model_id, rec in sorted(self.runtime.models.items()):
            seen = self.runtime.sessions.active_at.get(session_of(model_id))
            if rec.deleted or seen is None or now - seen <= inactive_s:
                continue
            if model_id in self.evicting or now - self._evict_failed.get(model_id, -inactive_s) < inactive_s:
                continue
            self._evict(rec)
            started.append(model_id)
        return started

    def _page_out_idle(self, inactive_s: float) -> list[str]:
        """Page out the models of every session quiet for ``inactive_s`` (once per quiet spell),
        each in its model's order; returns them. A later request pages a model back in."""
        now = time.monotonic()
        out = []
        for model_id, rec in list(self.runtime.models.items()):
            seen = self.runtime.sessions.active_at.get(session_of(model_id))
            if rec.deleted or seen is None or now - seen <= inactive_s:
                self._quiet.discard(model_id)
                continue
            if model_id not in self._quiet:
                self._quiet.add(model_id)
                self.page_out(model_id)
                out.append(model_id)
        return out

    def _evict(self, rec: ModelRecord) -> None:
        model_id = rec.model_id
        self.evicting.add(model_id)
        try:
            fut = (
                TrainingClient(self.runtime, model_id)
                .save_state(f"evicted-{int(time.time())}", overwrite=True)
                .future()
            )
        except BaseException:
            self.evicting.discard(model_id)
            raise

        def saved(f: Future[Any]) -> None:
            try:
                path = f.result().path
                if self.on_saved is not None:
                    self.on_saved(rec.tenant, path)
            except BaseException:
                log.exception("saving the state of inactive model %s failed; it stays loaded", model_id)
                self._evict_failed[model_id] = time.monotonic()
                self.evicting.discard(model_id)
                return
            self.evicted[model_id] = path
            refusal = (
                f"model {model_id!r} was evicted from memory because its session was inactive (no "
                f"heartbeat or request for a while); its state is saved at {path}: restore it with "
                "create_training_client_from_state_with_optimizer"
            )
            try:
                self.free(model_id, f"the model was evicted (its state is saved at {path})", refusal=refusal)
            except (EngineError, UnknownPolicyError):
                pass  # freed meanwhile (its session finished): nothing left to evict
            finally:
                self.evicting.discard(model_id)
            log.info("inactive model %s saved to %s and evicted", model_id, path)

        fut.add_done_callback(saved)


lifecycle_of = PerRuntime(Lifecycle)  # the one lifecycle of a runtime, both front-ends' entry
