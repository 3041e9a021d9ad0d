"""``ServiceClient``: the entry point. No URL → the engine runs embedded, in this process.

A program written for the ``tinker`` SDK runs embedded by changing only how the client is built::

    service = opentinker.ServiceClient()                   # embedded
    service = opentinker.ServiceClient(base_url=URL, api_key=KEY)   # -> the official tinker SDK client
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from opentinker.service import LoRAConfig, UnknownPolicyError
from opentinker.service.checkpoints import CheckpointRecord, checkpoint_view, parse_tinker_path
from opentinker.service.convert import optimizer_type
from opentinker.service.custom_loss import CustomLoss, trace_custom_loss
from opentinker.service.futures import ready
from opentinker.service.lifecycle import lifecycle_of
from opentinker.service.runtime import LOCAL_TENANT, Runtime, default_runtime
from opentinker.service.sampling import SamplingClient, sampling_client
from opentinker.service.sessions import FINISH_REASONS, session_of, session_view
from opentinker.service.training import TrainingClient

__all__ = ["LOCAL_TENANT", "ReleasesModels", "RestClient", "ServiceClient"]


class ServiceClient:
    def __new__(cls, base_url: str | None = None, api_key: str | None = None, **kwargs: Any) -> Any:
        if base_url is not None:
            import tinker

            return tinker.ServiceClient(base_url=base_url, api_key=api_key, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        runtime: Runtime | None = None,
        tenant: str = LOCAL_TENANT,
        user_metadata: dict[str, str] | None = None,
        project_id: str | None = None,
        display_name: str | None = None,
        **_: Any,
    ) -> None:
        """A session of ``tenant`` in ``runtime`` holding ``user_metadata``, ``project_id`` and
        ``display_name``, as the server's ``create_session`` holds them (``RestClient.get_session``
        shows them); a bad ``project_id`` raises ``ValueError``."""
        self.runtime = runtime or default_runtime()
        self.tenant = tenant
        meta = {"user_metadata": user_metadata, "project_id": project_id, "display_name": display_name}
        self.session_id = self.runtime.sessions.create(tenant, meta).id
        self._life = lifecycle_of(self.runtime)
        self._life.seen(self.session_id)
        self._closed = False

    def _new_model_id(self) -> str:
        """A model id in this client's session (refused once the client is closed)."""
        if self._closed:
            raise RuntimeError("ServiceClient is closed")
        return self.runtime.new_model_id(self.session_id)

    # ---------------------------------------------------------------- training clients
    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
        optimizer: Any = None,
    ) -> TrainingClient:
        """A fresh model; ``user_metadata`` stays on its record, and its ``{"data_parallel": "k"}``
        makes it data-parallel over k trainer workers, as over HTTP (``ValueError`` for a degree
        the runtime cannot serve, nothing made)."""
        config = LoRAConfig(
            rank=rank, seed=seed, train_attn=train_attn, train_mlp=train_mlp, train_unembed=train_unembed
        )
        model_id = self._new_model_id()
        self.runtime.create_model(
            model_id,
            base_model,
            config,
            tenant=self.tenant,
            optimizer_type=optimizer_type(optimizer),
            user_metadata=user_metadata,
        ).result()
        return TrainingClient(self.runtime, model_id)

    def create_training_client_from_state(
        self, path: str, base_model: str | None = None, user_metadata: Any = None, **_: Any
    ) -> TrainingClient:
        return self._from_state(path, base_model, user_metadata, optimizer=False)

    def create_training_client_from_state_with_optimizer(
        self, path: str, base_model: str | None = None, user_metadata: Any = None, **_: Any
    ) -> TrainingClient:
        return self._from_state(path, base_model, user_metadata, optimizer=True)

    def _from_state(
        self, path: str, base_model: str | None, user_metadata: Any, *, optimizer: bool
    ) -> TrainingClient:
        model_id = self._new_model_id()
        self.runtime.create_model_from_checkpoint(
            model_id,
            path,
            tenant=self.tenant,
            optimizer=optimizer,
            base_model=base_model,
            user_metadata=user_metadata,
        ).result()
        return TrainingClient(self.runtime, model_id)

    def delete_model(self, model_id: str) -> None:
        """Drop a training model (OpenTinker extension): its adapter is freed; checkpoints stay."""
        self._life.free(model_id, "the model was deleted", tenant=self.tenant).result()

    # ---------------------------------------------------------------- sampling clients
    def create_custom_loss(
        self, fn: Callable[..., Any], input_ranks: Mapping[str, int]
    ) -> AwaitableConcurrentFuture[CustomLoss]:
        """A per-datum loss traced as the SDK traces it, run by the engine's restricted
        interpreter; pass it to ``TrainingClient.forward_backward_custom``."""
        return ready(trace_custom_loss(fn, input_ranks))

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None, **_: Any
    ) -> SamplingClient:
        if self._closed:
            raise RuntimeError("ServiceClient is closed")
        return sampling_client(self.runtime, self.tenant, model_path=model_path, base_model=base_model)

    # ---------------------------------------------------------------- misc
    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        names = self.runtime.supported_models()
        models = [types.SupportedModel(model_name=n, trainable=True, sampleable=True) for n in names]
        return types.GetServerCapabilitiesResponse(supported_models=models)

    def create_rest_client(self) -> RestClient:
        return RestClient(self.runtime, self.tenant)

    def close(self, status: str = "success", detail: str | None = None) -> AwaitableConcurrentFuture[None]:
        """Finish the session with ``status`` (``success``, ``errored`` or ``interrupted``; the
        first reason stays) and free the adapters of the session's models, as the
        server's ``/sessions/{id}/finish`` does for the SDK's ``close``: their checkpoints stay, the
        runtime goes on, and this client makes nothing more (``RuntimeError``). A second call does
        nothing. Returns a finished future, as the SDK's ``close`` does. ``detail`` is not kept."""
        if status not in FINISH_REASONS:
            raise ValueError(f"status must be one of {', '.join(FINISH_REASONS)}, got {status!r}")
        if self._closed:
            return ready(None)
        self._closed = True
        for f in self._life.finish(self.session_id, status):
            f.result()  # queued after what each model still had to run
        return ready(None)

    def __enter__(self) -> ServiceClient:
        if self._closed:
            raise RuntimeError("ServiceClient is closed")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        """``success`` without an exception, ``errored`` for an ``Exception``, else ``interrupted``
        (a ``KeyboardInterrupt``), as the SDK's ``with ServiceClient(...)`` finishes its session."""
        if exc_type is None:
            status = "success"
        elif issubclass(exc_type, Exception):
            status = "errored"
        else:
            status = "interrupted"
        self.close(status)

    async def create_lora_training_client_async(self, *a: Any, **k: Any) -> TrainingClient:
        return self.create_lora_training_client(*a, **k)

    async def create_training_client_from_state_async(
        self, path: str, base_model: str | None = None, user_metadata: Any = None, **_: Any
    ) -> TrainingClient:
        """The model is made on the scheduler's thread while the event loop stays free (many
        concurrent calls are made in one tick)."""
        model_id = self._new_model_id()
        fut = self.runtime.create_model_from_checkpoint(
            model_id,
            path,
            tenant=self.tenant,
            optimizer=False,
            base_model=base_model,
            user_metadata=user_metadata,
        )
        await asyncio.wrap_future(fut)
        return TrainingClient(self.runtime, model_id)

    async def delete_model_async(self, model_id: str) -> None:
        """:meth:`delete_model`, waiting without holding the event loop."""
        await asyncio.wrap_future(self._life.free(model_id, "the model was deleted", tenant=self.tenant))

    async def create_training_client_from_state_with_optimizer_async(
        self, *a: Any, **k: Any
    ) -> TrainingClient:
        return self.create_training_client_from_state_with_optimizer(*a, **k)

    async def create_sampling_client_async(self, *a: Any, **k: Any) -> SamplingClient:
        return self.create_sampling_client(*a, **k)

    async def get_server_capabilities_async(self) -> types.GetServerCapabilitiesResponse:
        return self.get_server_capabilities()


class RestClient:
    """The checkpoint and session REST calls of the SDK's ``RestClient``, embedded."""

    def __init__(self, runtime: Runtime, tenant: str) -> None:
        self.runtime = runtime
        self.tenant = tenant

    def get_session(
        self, session_id: str, *_: Any, **__: Any
    ) -> AwaitableConcurrentFuture[types.GetSessionResponse]:
        """The session's models (in creation order) and what it was made with; another tenant's
        session is unknown (``UnknownSession``). Embedded samplers have no ids: ``sampler_ids`` is empty."""
        row = self.runtime.sessions.get(self.tenant, session_id)
        models = [m for m in self.runtime.models if session_of(m) == row.id]
        return ready(types.GetSessionResponse.model_validate(session_view(row, models, [])))

    def list_sessions(
        self, limit: int = 20, offset: int = 0, *_: Any, **__: Any
    ) -> AwaitableConcurrentFuture[types.ListSessionsResponse]:
        """The tenant's session ids, newest first."""
        rows = self.runtime.sessions.list(self.tenant, limit=limit, offset=offset)
        return ready(types.ListSessionsResponse(sessions=[r.id for r in rows]))

    def _mine(self, rec: CheckpointRecord) -> bool:
        return self.runtime.owns(rec.meta, self.tenant)

    def list_checkpoints(
        self, training_run_id: str
    ) -> AwaitableConcurrentFuture[types.CheckpointsListResponse]:
        recs = [r for r in self.runtime.store.list(training_run_id) if self._mine(r)]
        return ready(types.CheckpointsListResponse(checkpoints=[_checkpoint(r) for r in recs]))

    def list_user_checkpoints(
        self, *_: Any, **__: Any
    ) -> AwaitableConcurrentFuture[types.CheckpointsListResponse]:
        recs = [r for r in self.runtime.store.list() if self._mine(r)]
        return ready(types.CheckpointsListResponse(checkpoints=[_checkpoint(r) for r in recs]))

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> AwaitableConcurrentFuture[None]:
        ref = parse_tinker_path(tinker_path)
        rec = self.runtime.store.record(ref)
        if not self._mine(rec):
            raise UnknownPolicyError(f"unknown checkpoint {tinker_path!r}")
        self.runtime.store.delete(ref)
        return ready(None)

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> AwaitableConcurrentFuture[None]:
        return self.delete_checkpoint_from_tinker_path(f"tinker://{training_run_id}/{checkpoint_id}")


def _checkpoint(rec: CheckpointRecord) -> types.Checkpoint:
    view = checkpoint_view(
        rec.ref.kind, rec.ref.name, rec.time.timestamp(), rec.ref.tinker_path, rec.size_bytes
    )
    return types.Checkpoint.model_validate(view)


@runtime_checkable
class ReleasesModels(Protocol):
    """A service client that can release a training model it made: ``delete_model_async`` frees
    the model's adapter at once (its checkpoints stay), so a library that pools adapters
    (test-time training) may reset a model in place with ``TrainingClient.load_state`` and drop it
    when done. The embedded :class:`ServiceClient` is one; the ``tinker`` SDK's client is not (it
    has no ``delete_model`` and deprecates ``load_state``: its server frees models with their
    session). Ask ``isinstance(service, ReleasesModels)``."""

    async def delete_model_async(self, model_id: str) -> None: ...
