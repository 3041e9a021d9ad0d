"""Lean types of the rollout (sampling) API: what a request asks for and what comes back.

``SamplingParams`` mirrors ``tinker.types.SamplingParams`` field for field, so the client layer
copies one into the other. Logprob convention: every sampled token comes with
``log softmax(logits / T)[token]`` — the log-probability under the temperature-scaled policy,
*before* top-k / top-p truncation (T = 1 for greedy, T = 0). At T = 1 that is exactly the
trainer's ``forward`` logprob of the same token under the same weights (invariant 3), which is what
importance-sampling losses need.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from opentinker.engine.types import PolicyRef
from opentinker.models.vision import Image
from opentinker.sampling.grammar import Grammar

StopReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 20
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 = off
    top_p: float = 1.0
    seed: int | None = None  # same seed and request -> same tokens
    # None = stop at EOS; a non-empty list = its entries and EOS; [] = no stop at all, EOS included
    stop: list[str] | list[int] | None = None
    # OpenAI's shaping (the OpenAI-compatible routes'; sampling/grammar.py): each token sampled c
    # times so far loses c * frequency_penalty + presence_penalty; ``logit_bias`` (token, bias)
    # is added to the logits; ``grammar`` restricts the tokens to what it allows
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: Grammar | None = None

    @property
    def shaped(self) -> bool:
        """Are this row's logits shaped before the choice (penalties, bias, a grammar)?"""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias or self.grammar)


@dataclass(frozen=True)
class SampleRequest:
    policy: PolicyRef  # adapter id, snapshot id, or None for the bare base model
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    num_samples: int = 1
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0  # k most likely (token, logprob) at each sampled position
    # [len(prompt) - 1][K] token ids whose logprob to report; row i is scored at prompt position
    # i + 1 (what the tokens before it predict there); -1 asks for nothing (reported as 0.0)
    target_prompt_tokens: tuple[tuple[int, ...], ...] | None = None
    # k independent draws (at the request's temperature) at every prompt position after the first
    prompt_alt_tokens_k: int = 0
    # a ``kind="inflight"`` sampler's request: the training model whose newest saved weights it
    # follows mid-decode (the sampling loop's ``FollowInflight``); None: it stays on ``policy``
    follow: str | None = None
    # a sampling session's KV-cache namespace (a ``kind="inflight"`` sampler's): its finished
    # sequences are cached under it instead of under the weights, so its later requests reuse them
    # across the weights it follows (keys and values computed under earlier weights: the SDK's
    # inflight contract); None: cached under the exact weights
    kv_namespace: str | None = None
    # a VL model's images, in prompt order; each is ``n_tokens`` placeholder ids in ``prompt``
    images: tuple[Image, ...] = ()
    # a streamed request's: where its samples' tokens go while they decode (:class:`TokenSink`);
    # None: they come only in the result
    stream: TokenSink | None = field(default=None, compare=False)

    @property
    def wants_prompt(self) -> bool:
        """Does this request need the logits at every prompt position (a full prefill)?"""
        return bool(
            self.prompt_logprobs
            or self.topk_prompt_logprobs
            or self.target_prompt_tokens is not None
            or self.prompt_alt_tokens_k
        )


@dataclass(frozen=True)
class Tokens:
    """Tokens sample ``sample`` of a streamed request (rollout id ``rid``) decoded since the last
    :class:`Tokens` of it: they extend its first ``start`` tokens (with their logprobs and, when
    the request asks for them, top logprobs). The last tokens of a sample may come only in the
    request's result."""

    rid: int
    sample: int
    start: int
    tokens: list[int]
    logprobs: list[float]
    topk: list[list[tuple[int, float]]] | None = None


class TokenSink:
    """Where a streamed request's :class:`Tokens` go while it decodes (``SampleRequest.stream``):
    ``deliver`` is called on the sampling loop's thread (or the worker pool's dispatcher), so it
    must be quick and never block. A sink crosses to a rollout worker (pickled) as a bare marker,
    without ``deliver``: the worker sends its :class:`Tokens` back as messages and the pool hands
    them to the request's own sink."""

    def __init__(self, deliver: Callable[[Tokens], None] | None = None) -> None:
        self._deliver = deliver

    def __call__(self, piece: Tokens) -> None:
        if self._deliver is not None:
            self._deliver(piece)

    def __reduce__(self) -> tuple[Any, ...]:
        return (TokenSink, ())


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    # one per sampled token when asked (``topk_sample_logprobs``): the k most likely (token,
    # logprob) at that position, under the same distribution as ``logprobs``
    topk_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    # one per prompt token; the first is None (nothing predicts it)
    prompt_logprobs: list[float | None] | None = None
    # one per prompt token: the k most likely (token, logprob) at that position; first is None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    # [len(prompt) - 1][K]: the logprobs of ``target_prompt_tokens`` (0.0 where it had -1)
    target_prompt_logprobs: list[list[float]] | None = None
    # ``prompt_alt_tokens_k`` draws: ([len(prompt) - 1][k] token ids, their logprobs)
    prompt_alt_tokens: tuple[list[list[int]], list[list[float]]] | None = None
    # prompt tokens whose keys and values were reused from the prefix cache rather than prefilled
    # (the SDK's ``SampleResponse.prompt_cache_hit_tokens``): counted once per prompt, since every
    # sample of a request fans out from the same prefill
    prompt_cache_hit_tokens: int = 0
