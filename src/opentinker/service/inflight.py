"""``kind="inflight"`` samplers: the SDK's inflight contract, embedded and over HTTP alike.

``TrainingClient.save_weights_and_get_sampling_client(kind="inflight")`` (and the server's
``save_weights_for_sampler`` with ``kind="inflight"``) snapshots the model's weights and makes them
the model's **inflight target**, shared by every inflight sampling client of that model: the ones
returned earlier serve their next requests on the new weights (their ``policy`` moves to the new
snapshot), and their requests still decoding move to it from their next token with keys and
values kept (``StepDecoder.switch``'s rule). Each returned client is a sampling session with a
**KV-cache namespace** of its own (``SamplingClient.kv_namespace``): its requests' finished
sequences are kept in the prefix cache under that namespace, not under the weights, so a later
request of the same client reuses the keys and values of a cached prefix even when they were
computed under earlier weights. That is the approximation the SDK states ("active generation may
span updates and use KV computed under earlier weights"); different clients never share entries,
and a new save makes a new namespace.

The target keeps its current snapshot and the one before (a request that read the old one just
before the save still finds it); older ones are released, queued after the model's requests.
When the last inflight client of a model is collected, or the model leaves memory
(:meth:`InflightTargets.drop`), its target's snapshots are released; the samplers it served are
then retired, and why is kept for the newest :data:`GONE_KEPT` of them.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from opentinker.service.runtime import Runtime
from opentinker.service.sampling import SamplingClient

GONE_KEPT = 10_000  # retired inflight samplers whose refusal still says why their weights went

_ids = itertools.count(1)
T = TypeVar("T")


class PerRuntime(Generic[T]):
    """One ``T`` per runtime, made by ``make(runtime)`` on first use and gone with the runtime."""

    def __init__(self, make: Callable[[Runtime], T]) -> None:
        self._make = make
        self._of: weakref.WeakKeyDictionary[Runtime, T] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __call__(self, runtime: Runtime) -> T:
        with self._lock:
            if runtime not in self._of:
                self._of[runtime] = self._make(runtime)
            return self._of[runtime]


@dataclass
class InflightTarget:
    """The shared weights of one training model's inflight samplers."""

    base_model: str
    owner: str  # the training model (the snapshots' queue)
    current: str
    previous: str | None = None
    clients: weakref.WeakSet[SamplingClient] = field(default_factory=weakref.WeakSet)
    sampler_ids: list[str] = field(default_factory=list)  # the ids the server gave them


def new_namespace() -> str:
    """A KV-cache namespace no other sampling session has (process-unique)."""
    return f"inflight-{next(_ids)}"


class InflightTargets:
    """Every training model's inflight target in one runtime (the module docstring's contract)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.targets: dict[str, InflightTarget] = {}  # training model -> its target
        self.gone: dict[str, str] = {}  # retired sampler id -> why its weights went (newest first out)
        self._lock = threading.Lock()

    def follow(
        self, base_model: str, model_id: str, snapshot_id: str, *, sampler_id: str | None = None
    ) -> SamplingClient:
        """A new inflight sampling client of ``model_id`` on ``snapshot_id``, which becomes the
        target of every earlier one; ``sampler_id``: the id it is served under (its KV-cache
        namespace is then ``sampler:<id>``, else a fresh one)."""
        client = SamplingClient(self.runtime, base_model, snapshot_id)
        client.follow = model_id
        client.kv_namespace = f"sampler:{sampler_id}" if sampler_id is not None else new_namespace()
        stale = None
        with self._lock:
            target = self.targets.get(model_id)
            if target is None:
                target = self.targets[model_id] = InflightTarget(base_model, model_id, snapshot_id)
            else:
                stale, target.previous, target.current = target.previous, target.current, snapshot_id
            for other in target.clients:
                other.policy = snapshot_id
            target.clients.add(client)
            if sampler_id is not None:
                target.sampler_ids.append(sampler_id)
        weakref.finalize(client, self._collected, model_id, target)
        self.runtime.follow_inflight(base_model, model_id, snapshot_id)
        if stale is not None:
            self.runtime.release_snapshot(base_model, stale, queue=model_id)
        return client

    def drop(self, model_id: str, why: str) -> list[str]:
        """``model_id`` left memory: release its target's snapshots and retire the samplers that
        followed it (returned); their refusal says ``why``. Requests already decoding finish (their
        rows keep the weights alive)."""
        with self._lock:
            target = self.targets.pop(model_id, None)
            if target is None:
                return []
            for sampler_id in target.sampler_ids:
                self.gone[sampler_id] = (
                    f"sampler {sampler_id!r} followed the inflight weights of model {model_id!r}, which "
                    f"are gone: {why}; save weights for a sampler again"
                )
            for old in list(itertools.islice(self.gone, max(0, len(self.gone) - GONE_KEPT))):
                del self.gone[old]  # the oldest reasons: such a sampler then gets a plain refusal
            for client in target.clients:
                client.retired = (
                    f"this sampling client followed the inflight weights of model {model_id!r}, which "
                    f"are gone: {why}; save weights for a sampler again"
                )
        self._release(target)
        return list(target.sampler_ids)

    def _collected(self, model_id: str, target: InflightTarget) -> None:
        """An inflight client was collected: the last one releases its target's snapshots."""
        with self._lock:
            if len(target.clients) > 0 or self.targets.get(model_id) is not target:
                return
            del self.targets[model_id]
        self._release(target)

    def _release(self, target: InflightTarget) -> None:
        for snapshot_id in (target.current, target.previous):
            if snapshot_id is not None:
                self.runtime.release_snapshot(target.base_model, snapshot_id, queue=target.owner)


inflight_of = PerRuntime(InflightTargets)  # the one set of inflight targets of a runtime
