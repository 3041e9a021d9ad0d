"""Embedded ``kind="inflight"`` sampling clients: the SDK's inflight contract, in process.

``TrainingClient.save_weights_and_get_sampling_client(kind="inflight")`` snapshots the model's
weights and makes them the model's **inflight target**, shared by every inflight sampling client
of that model: the ones returned earlier serve their next requests on the new weights (their
``policy`` moves to the new snapshot), and their requests still decoding move to it from their
next token with keys and values kept (``StepDecoder.switch``'s rule). Each returned client is a
sampling session with a **KV-cache namespace** of its own (``SamplingClient.kv_namespace``): its
requests' finished sequences are kept in the prefix cache under that namespace, not under the
weights, so a later request of the same client reuses the keys and values of a cached prefix
even when they were computed under earlier weights. That is the approximation the SDK states
("active generation may span updates and use KV computed under earlier weights"); different
clients never share entries, and a new save makes a new namespace.

The target keeps its current snapshot and the one before (a request that read the old one just
before the save still finds it); older ones are released, queued after the model's requests.
When the last inflight client of a model is gone, its target's snapshots are released. The
server's registry does the same for its inflight samplers (``server/registry.py``).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass, field

from opentinker.service.runtime import Runtime
from opentinker.service.sampling import SamplingClient

_ids = itertools.count(1)
_lock = threading.Lock()
_targets: weakref.WeakKeyDictionary[Runtime, dict[str, _Target]] = weakref.WeakKeyDictionary()


@dataclass
class _Target:
    base_model: str
    current: str
    previous: str | None = None
    clients: weakref.WeakSet[SamplingClient] = field(default_factory=weakref.WeakSet)


def new_namespace() -> str:
    """A KV-cache namespace no other sampling session has (process-unique)."""
    return f"inflight-{next(_ids)}"


def inflight_client(runtime: Runtime, base_model: str, model_id: str, snapshot_id: str) -> SamplingClient:
    """A new inflight sampling client of ``model_id`` on ``snapshot_id``, which becomes the
    target of every earlier one (the module docstring's contract)."""
    client = SamplingClient(runtime, base_model, snapshot_id)
    client.follow = model_id
    client.kv_namespace = new_namespace()
    stale: list[str] = []
    with _lock:
        targets = _targets.setdefault(runtime, {})
        target = targets.get(model_id)
        if target is None:
            target = targets[model_id] = _Target(base_model, snapshot_id)
        else:
            if target.previous is not None:
                stale.append(target.previous)
            target.previous, target.current = target.current, snapshot_id
        for other in target.clients:
            other.policy = snapshot_id
        target.clients.add(client)
    weakref.finalize(client, _client_gone, weakref.ref(runtime), model_id, target)
    runtime.follow_inflight(base_model, model_id, snapshot_id)
    for snap in stale:
        runtime.release_snapshot(base_model, snap, queue=model_id)
    return client


def _client_gone(runtime_ref: weakref.ref[Runtime], model_id: str, target: _Target) -> None:
    """An inflight client was collected: the last one releases its target's snapshots."""
    runtime = runtime_ref()
    if runtime is None:
        return
    with _lock:
        if len(target.clients) > 0:
            return
        targets = _targets.get(runtime, {})
        if targets.get(model_id) is target:
            del targets[model_id]
    for snap in (target.current, target.previous):
        if snap is not None:
            runtime.release_snapshot(target.base_model, snap, queue=model_id)
