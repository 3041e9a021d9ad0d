"""The backend contract for rollout engines: one batch mixes snapshots of many adapters.

Everything above it (scheduler, clients, RL loops) talks to a :class:`SamplingBackend`:

- ``publish(policy_id, weights)``: make a policy version sampleable (an immutable LoRA snapshot);
- ``retire(policy_id)``: forget it (later requests naming it fail with a clear error);
- ``generate(requests)``: one batch whose requests may each name a different policy (or None, the
  bare base model), returning per request sampled tokens + logprobs + stop reasons, and prompt /
  top-k prompt logprobs when asked; a refused request yields an ``EngineError`` in its slot and
  never disturbs the others;
- ``compute_logprobs(policy, tokens)``: built here, once, on ``generate``'s prompt logprobs.

The native PyTorch backend (:mod:`opentinker.sampling.native`) shares the training engine's base
model and snapshots, so ``publish`` is free. The vLLM backend (:mod:`opentinker.sampling.vllm_backend`)
implements the same three methods with vLLM's engine and runtime LoRA loading (``publish`` = write
the PEFT export, register a ``LoRARequest``), with no change above this interface.

A backend whose numerics differ from the trainer's reports the **sampler–trainer mismatch**
(:class:`Mismatch`) of its batches: RL importance ratios divide the trainer's probability of a
sampled token by the sampler's.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from opentinker.engine.types import EngineError
from opentinker.lora import LoRAWeights
from opentinker.sampling.types import SampleRequest, SampleResult, SamplingParams


@dataclass(frozen=True)
class Mismatch:
    """Sampler–trainer logprob mismatch over ``tokens`` sampled tokens: mean and max of
    ``|lp_sampler - lp_trainer|``, and the estimate ``mean(exp(d) - 1 - d)``, ``d = lp_trainer -
    lp_sampler``, of KL(sampler ‖ trainer) (unbiased for samples drawn by the sampler, never < 0)."""

    tokens: int = 0
    mean_abs: float = 0.0
    max_abs: float = 0.0
    kl: float = 0.0

    def merged(self, other: Mismatch) -> Mismatch:
        """Both together (token-weighted means)."""
        n = self.tokens + other.tokens
        if n == 0:
            return self
        return Mismatch(
            n,
            (self.mean_abs * self.tokens + other.mean_abs * other.tokens) / n,
            max(self.max_abs, other.max_abs),
            (self.kl * self.tokens + other.kl * other.tokens) / n,
        )

    def metrics(self, prefix: str = "sampler_mismatch") -> dict[str, float]:
        return {
            f"{prefix}/tokens": float(self.tokens),
            f"{prefix}/mean_abs_logprob_diff": self.mean_abs,
            f"{prefix}/max_abs_logprob_diff": self.max_abs,
            f"{prefix}/kl": self.kl,
        }


def check_request(req: SampleRequest, *, vocab_size: int, max_context: int) -> None:
    """Raise :class:`EngineError` naming what is wrong with ``req`` itself (its policy aside)."""
    p = req.params
    if not req.prompt:
        raise EngineError("the prompt is empty")
    if len(req.prompt) >= max_context:
        raise EngineError(f"the prompt has {len(req.prompt)} tokens; the context length is {max_context}")
    bad = [t for t in req.prompt if not 0 <= t < vocab_size]
    if bad:
        raise EngineError(f"the prompt has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    if not isinstance(p.max_tokens, int) or p.max_tokens <= 0:
        raise EngineError(f"max_tokens must be a positive integer, got {p.max_tokens!r}")
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise EngineError(f"temperature must be >= 0 and finite, got {p.temperature!r}")
    if not (0 < p.top_p <= 1):
        raise EngineError(f"top_p must be in (0, 1], got {p.top_p!r}")
    if p.top_k == 0 or p.top_k < -1:
        raise EngineError(f"top_k must be -1 (off) or positive, got {p.top_k!r}")
    if req.num_samples < 1:
        raise EngineError(f"num_samples must be at least 1, got {req.num_samples!r}")
    if req.topk_prompt_logprobs < 0:
        raise EngineError("topk_prompt_logprobs must be >= 0")
    if not isinstance(req.topk_sample_logprobs, int) or req.topk_sample_logprobs < 0:
        raise EngineError(f"topk_sample_logprobs must be an integer >= 0, got {req.topk_sample_logprobs!r}")
    if p.stop is not None:
        kinds = {type(s) for s in p.stop}
        if len(kinds) > 1 or not kinds <= {str, int}:
            raise EngineError("stop must be a list of strings or a list of token ids, not a mix")
        if kinds == {str} and any(s == "" for s in p.stop):
            raise EngineError("stop strings must not be empty")


class SamplingBackend(ABC):
    # the sampler–trainer mismatch of the last batch that finished rows, and of all so far
    # (None: the backend samples with the trainer's own forward, so there is none to measure)
    mismatch_last: Mismatch | None = None
    mismatch_total: Mismatch | None = None

    @abstractmethod
    def publish(self, policy_id: str, weights: LoRAWeights) -> None:
        """Make ``weights`` sampleable as ``policy_id`` (idempotent for the same id)."""

    @abstractmethod
    def retire(self, policy_id: str) -> None:
        """Stop serving ``policy_id``; raises ``UnknownPolicyError`` if it is not served."""

    @abstractmethod
    def generate(self, requests: list[SampleRequest]) -> list[SampleResult | EngineError]:
        """Sample every request in one mixed-policy batch; a bad request fails alone."""

    def compute_logprobs(self, policy: str | None, tokens: list[int]) -> list[float | None]:
        """Logprob of each token given the ones before it under ``policy`` (the first is None):
        the prompt logprobs of a one-token greedy request."""
        req = SampleRequest(
            policy, tokens, SamplingParams(max_tokens=1, temperature=0.0), prompt_logprobs=True
        )
        [res] = self.generate([req])
        if isinstance(res, Exception):
            raise res
        assert res.prompt_logprobs is not None
        return res.prompt_logprobs
