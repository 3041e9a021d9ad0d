"""The request-lifecycle routes of SDK 0.38: batch polling, cancelling, clone ids, unloading.

- ``/retrieve_futures``: one long-poll per sampling session (and clone) that reports which of its
  requests finished or failed (:mod:`completions`); the SDK then fetches each result through
  ``/retrieve_future``. ``retrieved_request_ids`` lets the server drop those results at once.
- ``/cancel_future``: the SDK sends it for a sample request whose future it abandoned. A request
  no tick has taken yet is dropped unsampled and its poll answers an error saying it was
  cancelled; one already decoding finishes (its result is simply never fetched).
- ``/join_sampling_session``: a client id for an unpickled ``SamplingClient``, unique within its
  sampling session, so that clones never share ``seq_id``s (the SDK numbers clone ``c``'s
  requests from ``c·10⁹``). The original client is 0; the ids of a session come from a counter
  that starts at a random point, so a clone from before a restart and one after it collide only
  with probability ~1e-9.
- ``/unload_model``: frees a training model (its adapter and optimizer state, after the requests
  already queued for it have run); later requests for it are refused with a message saying so;
  its checkpoints stay. Answered through a future whose result is ``{"model_id", "type"}``.

Each id in a body must be the caller's own: another tenant's sampler, model or request is unknown.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from opentinker.server.completions import CLONE_BLOCK, CompletionQueues
from opentinker.server.config import ServerConfig
from opentinker.server.errors import NotFound
from opentinker.server.futures import FutureStore
from opentinker.server.ops import Operations
from opentinker.server.registry import Registry, SamplerNotLoaded

MAX_ACKS = 10_000  # retrieved_request_ids in one poll (the SDK reports a poll's worth at a time)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class SamplingSessionTarget(_Body):
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str
    cloned_sampler_id: int = Field(default=0, ge=0, lt=CLONE_BLOCK)


class FuturesRetrieveRequest(_Body):
    target: SamplingSessionTarget
    prev_cursor: int = Field(default=0, ge=0, le=2**63 - 1)
    timeout: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    retrieved_request_ids: list[str] = Field(default_factory=list, max_length=MAX_ACKS)


class CancelFutureRequest(_Body):
    request_id: str


class JoinSamplingSessionRequest(_Body):
    sampling_session_id: str


class UnloadModelRequest(_Body):
    model_id: str


class Lifecycle:
    def __init__(
        self, config: ServerConfig, registry: Registry, futures: FutureStore, ops: Operations
    ) -> None:
        self.config = config
        self.reg = registry
        self.futures = futures
        self.ops = ops
        self.completions: CompletionQueues = ops.completions
        self._clones: dict[str, tuple[int, int]] = {}  # sampler -> (random start, joined so far)
        self._lock = threading.Lock()

    def _own_sampler(self, tenant: str, sampler_id: str) -> None:
        # SamplerNotLoaded: the tenant's, from an earlier process; loaded when it next samples
        with contextlib.suppress(SamplerNotLoaded):
            self.reg.sampler(tenant, sampler_id)

    async def retrieve_futures(self, tenant: str, req: FuturesRetrieveRequest) -> dict[str, Any]:
        self._own_sampler(tenant, req.target.sampling_session_id)
        self.futures.drop(req.retrieved_request_ids, tenant)
        limit = self.config.poll_timeout_s
        timeout = limit if req.timeout is None else min(req.timeout, limit)
        key = (req.target.sampling_session_id, req.target.cloned_sampler_id)
        events, cursor = await self.completions.poll(key, req.prev_cursor, timeout)
        return {"completions": events, "cursor": cursor}

    def cancel_future(self, tenant: str, req: CancelFutureRequest) -> dict[str, Any]:
        outcome = self.futures.cancel(req.request_id, tenant)
        if outcome == "unknown":
            raise NotFound(f"request {req.request_id!r} is unknown (or finished long ago)")
        return {"request_id": req.request_id, "state": outcome}

    def join_sampling_session(self, tenant: str, req: JoinSamplingSessionRequest) -> dict[str, Any]:
        self._own_sampler(tenant, req.sampling_session_id)
        with self._lock:
            start, joined = self._clones.get(req.sampling_session_id, (secrets.randbelow(CLONE_BLOCK - 1), 0))
            self._clones[req.sampling_session_id] = (start, joined + 1)
        return {"client_counter": 1 + (start + joined) % (CLONE_BLOCK - 1), "type": "join_sampling_session"}

    def unload_model(self, tenant: str, req: UnloadModelRequest) -> dict[str, Any]:
        done = self.reg.unload_model(tenant, req.model_id)
        answer = {"model_id": req.model_id, "type": "unload_model"}
        return {"request_id": self.ops.run(tenant, lambda: done, lambda _: answer)}
