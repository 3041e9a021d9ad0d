"""``SamplingClient``: the SDK's sampling client, embedded. Pinned to one policy version."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from opentinker.engine import EngineError
from opentinker.sampling import SampleRequest, SampleResult
from opentinker.sampling.handles import SampleHandle
from opentinker.sampling.types import Tokens, TokenSink
from opentinker.service.convert import check_prompt_extras, model_input_parts, sample_response
from opentinker.service.convert import sampling_params as to_sampling_params
from opentinker.service.futures import ReadyClient, map_future
from opentinker.service.runtime import Runtime

__all__ = ["SamplingClient", "Submitted", "TokenSink", "Tokens"]


@dataclass(frozen=True)
class Submitted:
    """A sample request as :meth:`SamplingClient.submit` made it: its handle (request id and
    raw future, for ``held_back`` / ``cancel`` / ``abort``) and the future of its response."""

    handle: SampleHandle
    response: AwaitableConcurrentFuture[types.SampleResponse]


class SamplingClient(ReadyClient):
    """Samples from one immutable policy: a snapshot id, or None for the bare base model."""

    def __init__(
        self, runtime: Runtime, base_model: str, policy: str | None, model_path: str | None = None
    ) -> None:
        self._runtime = runtime
        self._scheduler = runtime.base_stack(base_model).scheduler
        self.base_model = runtime.base_model_info(base_model).name
        self.policy = policy
        self.model_path = model_path
        self.follow: str | None = None  # an inflight sampler: the training model it follows
        # an inflight sampler's KV-cache namespace: its requests' prefix-cache entries are keyed by
        # it, not by the weights, so they survive the weights it follows (service/inflight.py)
        self.kv_namespace: str | None = None
        self.retired: str | None = None  # why it serves nothing more (inflight weights gone)

    @classmethod
    def for_checkpoint(cls, runtime: Runtime, model_path: str, *, tenant: str) -> SamplingClient:
        """Serve ``tenant``'s saved checkpoint (weights or sampler_weights) as an immutable policy
        version (blocking: it may load weights)."""
        version = runtime.load_checkpoint_policy(model_path, tenant).result()
        return cls(runtime, version.base_model, version.policy, model_path=model_path)

    def sample(
        self,
        prompt: types.ModelInput,
        num_samples: int,
        sampling_params: types.SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: types.TensorData | None = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> AwaitableConcurrentFuture[types.SampleResponse]:
        return self.submit(
            prompt,
            num_samples,
            sampling_params,
            include_prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
            target_prompt_logprobs=target_prompt_logprobs,
            prompt_alt_tokens_k=prompt_alt_tokens_k,
            prompt_logprobs_last_n=prompt_logprobs_last_n,
        ).response

    def sample_streamed(
        self,
        sink: TokenSink,
        prompt: types.ModelInput,
        num_samples: int,
        sampling_params: types.SamplingParams,
        *,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
    ) -> AwaitableConcurrentFuture[types.SampleResponse]:
        """As :meth:`sample`, and the samples' tokens handed to ``sink`` while they decode (by the
        sampling loop and rollout workers; where sampling runs otherwise, they come only with the
        result). The result holds every token, streamed or not."""
        return self.submit(
            prompt,
            num_samples,
            sampling_params,
            sink=sink,
            include_prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
        ).response

    def submit(
        self,
        prompt: types.ModelInput,
        num_samples: int,
        sampling_params: types.SamplingParams,
        *,
        sink: TokenSink | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: types.TensorData | None = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> Submitted:
        """As :meth:`sample` (with ``sink``: :meth:`sample_streamed`), and the request's handle
        beside its response: :meth:`held_back`, :meth:`cancel` and :meth:`abort` take it."""
        self._check_live()
        ids, images = model_input_parts(prompt, self._runtime.vision(self.base_model), "the prompt")
        targets = check_prompt_extras(
            len(ids),
            include_prompt_logprobs,
            target_prompt_logprobs,
            prompt_alt_tokens_k,
            prompt_logprobs_last_n,
        )
        req = SampleRequest(
            self.policy,
            ids,
            to_sampling_params(sampling_params),
            num_samples=num_samples,
            prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
            target_prompt_tokens=targets,
            prompt_alt_tokens_k=prompt_alt_tokens_k,
            follow=self.follow,
            kv_namespace=self.kv_namespace,
            images=images,
            stream=sink,
        )
        self._note_use()
        handle = self._scheduler.submit_sample(req)
        # a bound method: the queued request's future holds it, so this client (and its ephemeral
        # snapshot) stays alive until the request has run, even for
        # ``tc.save_weights_and_get_sampling_client().sample(...)``
        convert = partial(self._response, target_layout=target_prompt_logprobs, last_n=prompt_logprobs_last_n)
        return Submitted(handle, map_future(handle.future, convert))

    def _response(
        self, res: SampleResult, *, target_layout: types.TensorData | None, last_n: int | None
    ) -> types.SampleResponse:
        return sample_response(res, target_layout=target_layout, prompt_logprobs_last_n=last_n)

    async def sample_async(self, *args: Any, **kwargs: Any) -> types.SampleResponse:
        # the SDK's deprecated form: the result itself (``await client.sample(...)`` is the new one)
        return await self.sample(*args, **kwargs)

    def compute_logprobs(self, prompt: types.ModelInput) -> AwaitableConcurrentFuture[list[float | None]]:
        self._check_live()
        ids, images = model_input_parts(prompt, self._runtime.vision(self.base_model), "the prompt")
        req = SampleRequest(
            self.policy,
            ids,
            to_sampling_params(types.SamplingParams(max_tokens=1)),
            prompt_logprobs=True,
            images=images,
        )
        handle = self._scheduler.submit_sample(req)
        return map_future(handle.future, self._logprobs)

    def _logprobs(self, res: SampleResult) -> list[float | None]:
        # a bound method, for the reason :meth:`submit` gives
        assert res.prompt_logprobs is not None
        return res.prompt_logprobs

    def held_back(self, handle: SampleHandle) -> bool:
        """Is that request waiting for room in the sampler's running batch (it is at capacity)?"""
        return self._scheduler.sample_state(handle) == "held_back"

    def cancel(self, handle: SampleHandle) -> bool:
        """Drop that request if the sampler has not taken it yet."""
        return self._scheduler.cancel_sample(handle)

    def abort(self, handle: SampleHandle) -> bool:
        """Drop that request now, even mid-decode (its rows leave the running batch), where the
        sampling service can; else as :meth:`cancel`."""
        return self._scheduler.abort_sample(handle)

    @property
    def max_rows(self) -> int:
        """Sampled sequences the sampler decodes together at most (per worker)."""
        return self._scheduler.max_sample_rows

    async def compute_logprobs_async(self, prompt: types.ModelInput) -> list[float | None]:
        return await self.compute_logprobs(prompt)

    def get_tokenizer(self) -> Any:
        return self._runtime.tokenizer(self.base_model)

    def get_base_model(self) -> str:
        return self.base_model

    async def get_base_model_async(self) -> str:
        return self.base_model

    def _check_live(self) -> None:
        if self.retired is not None:
            raise EngineError(self.retired)

    def _note_use(self) -> None:
        """Lineage: remember that data may now come from this policy version."""
        if self.policy is not None:
            self._runtime.note_sampled(self.base_model, self.policy, self.model_path or self.policy)


def sampling_client(
    runtime: Runtime, tenant: str, *, model_path: str | None = None, base_model: str | None = None
) -> SamplingClient:
    """A sampler of ``tenant``'s checkpoint at ``model_path`` (weights or sampler_weights, loaded
    once: blocking), else of the bare ``base_model``: what ``create_sampling_client`` gives,
    embedded and over HTTP (``EngineError`` when neither is given)."""
    if model_path is not None:
        return SamplingClient.for_checkpoint(runtime, model_path, tenant=tenant)
    if base_model is None:
        raise EngineError("create_sampling_client needs model_path or base_model")
    return SamplingClient(runtime, base_model, None)
