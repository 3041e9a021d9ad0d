"""``TrainingClient``: the SDK's training client, embedded. One LoRA adapter = one model id.

Every call is queued on the scheduler in call order and returns at once with a future, so a
program can submit ``forward_backward`` then ``optim_step`` before waiting (both run in one tick).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from opentinker.engine import AdamParams, EngineError, ForwardRequest, ForwardResult, SnapshotInfo, Trainer
from opentinker.engine.checkpoint import CheckpointError
from opentinker.engine.custom_loss import CustomLoss as CustomLossGraph
from opentinker.engine.optim import check_step_params
from opentinker.scheduler import ModelQueue
from opentinker.service.checkpoints import CheckpointRef, check_name
from opentinker.service.convert import datum_to_example, forward_output
from opentinker.service.futures import ClientFuture, ReadyClient, client_future, map_future
from opentinker.service.inflight import inflight_of
from opentinker.service.runtime import ModelRecord, Runtime
from opentinker.service.sampling import SamplingClient
from opentinker.service.sessions import session_of

CustomLoss = Callable[[list[types.Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


class TrainingClient(ReadyClient):
    def __init__(self, runtime: Runtime, model_id: str) -> None:
        self._runtime = runtime
        self.model_id = model_id
        rec = runtime.model(model_id)
        self._base_model = rec.base_model
        self._scheduler = runtime.base_stack(rec.base_model).scheduler

    # ---------------------------------------------------------------- helpers
    def _record(self) -> ModelRecord:
        rec = self._runtime.model(self.model_id)
        self._runtime.sessions.seen(session_of(self.model_id))  # its session is active
        return rec

    def _request(
        self, data: Sequence[types.Datum], loss_fn: str, config: Any, backward: bool, custom_loss: Any = None
    ) -> ForwardRequest:
        self._record()
        vision = self._runtime.vision(self._base_model)
        examples = [datum_to_example(d, i, vision) for i, d in enumerate(data)]
        cfg = {k: v for k, v in (config or {}).items()}
        return ForwardRequest(self.model_id, examples, loss_fn, cfg, backward, custom_loss)

    def _call(self, fn: Callable[[Trainer], Any]) -> Any:
        """Queue ``fn`` in this model's order; returns the concurrent future."""
        self._record()
        return self._scheduler.submit_call(ModelQueue(self.model_id), fn)

    # ---------------------------------------------------------------- compute
    def forward(
        self,
        data: list[types.Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, float] | None = None,
        *,
        custom_loss: CustomLossGraph | None = None,
    ) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        req = self._request(data, loss_fn, loss_fn_config, backward=False, custom_loss=custom_loss)
        return map_future(self._scheduler.submit_forward(self.model_id, req), forward_output)

    def forward_backward(
        self,
        data: list[types.Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, float] | None = None,
        *,
        custom_loss: CustomLossGraph | None = None,
    ) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        req = self._request(data, loss_fn, loss_fn_config, backward=True, custom_loss=custom_loss)
        return map_future(self._scheduler.submit_forward(self.model_id, req), forward_output)

    def forward_backward_custom(
        self, data: list[types.Datum], loss_fn: CustomLoss | CustomLossGraph, **_: Any
    ) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        """Any differentiable loss of the logprobs, as Tinker does it: a forward for the logprobs,
        the loss and its gradient g = dL/dlogprobs on the client, then a ``cross_entropy``
        forward_backward with weights -g (same gradient as the loss). Runs as one queued step."""
        if isinstance(loss_fn, CustomLossGraph):  # made by create_custom_loss: one fused step
            return self.forward_backward(data, "custom", custom_loss=loss_fn)
        examples = [
            datum_to_example(d, i, self._runtime.vision(self._base_model)) for i, d in enumerate(data)
        ]
        self._record()
        plain = [
            type(ex)(ex.tokens_T, {"target_tokens": ex.inputs["target_tokens"]}, ex.images)
            if "target_tokens" in ex.inputs
            else ex
            for ex in examples
        ]

        def run(engine: Trainer) -> types.ForwardBackwardOutput:
            fwd = engine.forward_backward(ForwardRequest(self.model_id, plain, backward=False))
            logprobs = [o["logprobs"].clone().requires_grad_(True) for o in fwd.outputs]
            loss, metrics = loss_fn(data, logprobs)
            loss.backward()
            weighted = []
            for ex, lp in zip(plain, logprobs, strict=True):
                grad = lp.grad if lp.grad is not None else torch.zeros_like(lp)
                weighted.append(
                    type(ex)(
                        ex.tokens_T,
                        {"target_tokens": ex.inputs["target_tokens"], "weights": -grad},
                        ex.images,
                    )
                )
            res = engine.forward_backward(ForwardRequest(self.model_id, weighted, "cross_entropy"))
            out = forward_output(ForwardResult(fwd.outputs, {**res.metrics, **metrics}))
            out.metrics["loss:sum"] = float(loss.detach())
            return out

        return map_future(self._call(run), lambda x: x)

    def optim_step(
        self, optim_params: types.OptimParams | None = None, *, adam_params: types.AdamParams | None = None
    ) -> AwaitableConcurrentFuture[types.OptimStepResponse]:
        p = adam_params or optim_params
        if p is None:
            raise ValueError("optim_step needs AdamParams")
        check_step_params(getattr(p, "type", None))  # DimuonParams & co. name their type
        assert isinstance(p, types.AdamParams)  # the only family check_step_params lets through
        params = AdamParams(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm)
        params.validate()  # refuse here, before queuing: the model is untouched
        self._record()
        fut = self._scheduler.submit_optim(self.model_id, params)
        return map_future(fut, lambda m: types.OptimStepResponse(metrics=m))

    # ---------------------------------------------------------------- state
    def save_state(
        self, name: str, ttl_seconds: int | None = None, overwrite: bool = False, user_metadata: Any = None
    ) -> AwaitableConcurrentFuture[types.SaveWeightsResponse]:
        ref = CheckpointRef(self.model_id, "weights", check_name(name))
        fut = self._call(lambda eng: self._save(eng, ref, optimizer=True, overwrite=overwrite))
        return map_future(fut, lambda path: types.SaveWeightsResponse(path=path))

    def save_weights_for_sampler(
        self, name: str, ttl_seconds: int | None = None, user_metadata: Any = None
    ) -> AwaitableConcurrentFuture[types.SaveWeightsForSamplerResponse]:
        ref = CheckpointRef(self.model_id, "sampler_weights", check_name(name))
        fut = self._call(lambda eng: self._save(eng, ref, optimizer=False, overwrite=True))
        return map_future(fut, lambda path: types.SaveWeightsForSamplerResponse(path=path))

    def _save(self, engine: Trainer, ref: CheckpointRef, *, optimizer: bool, overwrite: bool) -> str:
        rec = self._record()
        meta = {
            "tenant": rec.tenant,
            "tinker_path": ref.tinker_path,
            "model_id": self.model_id,
            "parent": rec.parent,
            "sampler_versions": sorted(rec.sampled_versions),
        }
        if rec.data_parallel > 1:  # a model made from it keeps the degree where it can
            meta["data_parallel"] = rec.data_parallel
        store = self._runtime.store
        if store.exists(ref) and not overwrite:
            raise CheckpointError(f"checkpoint {ref.tinker_path} already exists (pass overwrite=True)")
        engine.save_state(self.model_id, store.folder(ref), optimizer=optimizer, meta=meta, overwrite=True)
        if optimizer:
            rec.sampled_versions.clear()
        return ref.tinker_path

    def save_weights_external(
        self,
        name: str,
        ttl_seconds: int | None = None,
        age_encryption_recipients: list[str] | None = None,
    ) -> AwaitableConcurrentFuture[types.SaveWeightsExternalResponse]:
        """The adapter in PEFT format at ``tinker://<model_id>/external_weights/<name>`` (see
        :mod:`opentinker.service.external`)."""
        fut = self._runtime.save_external(
            self.model_id, check_name(name), recipients=age_encryption_recipients
        )
        return map_future(fut, lambda rec: types.SaveWeightsExternalResponse(path=rec.tinker_path))

    def load_state(self, path: str) -> AwaitableConcurrentFuture[types.LoadWeightsResponse]:
        return self._load(path, optimizer=False)

    def load_state_with_optimizer(self, path: str) -> AwaitableConcurrentFuture[types.LoadWeightsResponse]:
        return self._load(path, optimizer=True)

    def _load(self, path: str, *, optimizer: bool) -> AwaitableConcurrentFuture[types.LoadWeightsResponse]:
        fut = self._runtime.load_checkpoint_into(self.model_id, path, optimizer=optimizer)
        return map_future(fut, lambda _: types.LoadWeightsResponse(path=path, model_id=self.model_id))

    # ---------------------------------------------------------------- sampling
    def save_weights_and_get_sampling_client(
        self, name: str | None = None, *, kind: types.SamplingClientKind = "snapshot", **_: Any
    ) -> ClientFuture[SamplingClient]:
        # a future of the client, as in the SDK 0.38: awaiting it leaves the event loop free
        # (other runs of ``run_rl_many`` keep going) while the scheduler takes the snapshot.
        # ``kind="inflight"``: the model's shared inflight target (service/inflight.py)
        if kind not in ("snapshot", "inflight"):
            raise ValueError(f"kind must be 'snapshot' or 'inflight', got {kind!r}")
        make = self._inflight_client if kind == "inflight" else self._sampling_client
        return client_future(self._runtime.snapshot(self.model_id), make)

    async def save_weights_and_get_sampling_client_async(
        self, name: str | None = None, *, kind: types.SamplingClientKind = "snapshot", **_: Any
    ) -> SamplingClient:
        return await self.save_weights_and_get_sampling_client(name, kind=kind)

    def _inflight_client(self, snap: SnapshotInfo) -> SamplingClient:
        return inflight_of(self._runtime).follow(self._base_model, self.model_id, snap.snapshot_id)

    def _sampling_client(self, snap: SnapshotInfo) -> SamplingClient:
        client = SamplingClient(self._runtime, self._base_model, snap.snapshot_id)
        # An ephemeral policy version lives as long as a client can sample it: release its
        # weights (queued, in order) once the last reference to the SamplingClient is gone.
        weakref.finalize(client, self._runtime.release_snapshot, self._base_model, snap.snapshot_id)
        return client

    def create_sampling_client(self, model_path: str, **_: Any) -> SamplingClient:
        return SamplingClient.for_checkpoint(self._runtime, model_path, tenant=self._record().tenant)

    # ---------------------------------------------------------------- info
    def get_info(self) -> types.GetInfoResponse:
        rec = self._record()
        base = self._runtime.base_model_info(rec.base_model)
        return types.GetInfoResponse(
            model_id=self.model_id,
            model_data=types.ModelData(
                arch=base.model_type, model_name=rec.base_model, tokenizer_id=base.path
            ),
            is_lora=True,
            lora_rank=rec.lora.rank,
            model_name=rec.base_model,
        )

    def get_tokenizer(self) -> Any:
        return self._runtime.tokenizer(self._base_model)

    # ---------------------------------------------------------------- *_async forms
    async def forward_async(
        self, *a: Any, **k: Any
    ) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        return self.forward(*a, **k)

    async def forward_backward_async(
        self, *a: Any, **k: Any
    ) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        return self.forward_backward(*a, **k)

    async def forward_backward_custom_async(
        self, *a: Any, **k: Any
    ) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        return self.forward_backward_custom(*a, **k)

    async def optim_step_async(self, *a: Any, **k: Any) -> AwaitableConcurrentFuture[types.OptimStepResponse]:
        return self.optim_step(*a, **k)

    async def save_state_async(
        self, *a: Any, **k: Any
    ) -> AwaitableConcurrentFuture[types.SaveWeightsResponse]:
        return self.save_state(*a, **k)

    async def load_state_async(self, path: str) -> AwaitableConcurrentFuture[types.LoadWeightsResponse]:
        return self.load_state(path)

    async def load_state_with_optimizer_async(
        self, path: str
    ) -> AwaitableConcurrentFuture[types.LoadWeightsResponse]:
        return self.load_state_with_optimizer(path)

    async def save_weights_for_sampler_async(
        self, *a: Any, **k: Any
    ) -> AwaitableConcurrentFuture[types.SaveWeightsForSamplerResponse]:
        return self.save_weights_for_sampler(*a, **k)

    async def get_info_async(self) -> types.GetInfoResponse:
        return self.get_info()


__all__ = ["EngineError", "TrainingClient"]
