"""The native PyTorch rollout backend: KV-cache decoding of batches that mix policies and lengths.

It shares the training engine's base model and snapshots (``publish`` is free) and decodes through
a :class:`~opentinker.sampling.decoder.StepDecoder` (see there for prefill, prefix reuse, fan-out,
per-row generators and stops). ``generate`` admits one batch and steps it until every row has
stopped; the sampling loop (:mod:`opentinker.sampling.loop`) drives the same decoder
continuously, admitting requests into the running batch between decode steps
(:meth:`NativeBackend.decoder`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Hashable

import torch

from opentinker.engine import Engine, EngineError
from opentinker.engine.types import PolicyRef
from opentinker.lora import LoRAWeights
from opentinker.models.vision import check_placeholders
from opentinker.sampling.backend import SamplingBackend, check_request
from opentinker.sampling.decoder import (
    MIN_SHARED_PREFIX,
    StepDecoder,
    common_prompt_prefix,
    run_to_completion,
)
from opentinker.sampling.forward import LoRACache, unsupported_cache_reason
from opentinker.sampling.lean_model import LeanModel, lean_model, unsupported_reason
from opentinker.sampling.prefix_cache import PrefixCache
from opentinker.sampling.types import SampleRequest, SampleResult

__all__ = ["MIN_SHARED_PREFIX", "NativeBackend", "common_prompt_prefix"]

log = logging.getLogger(__name__)

DEFAULT_PREFIX_CACHE_BYTES = 512 << 20  # keys and values of finished sequences kept for their next turn
LEAN_FIRST_DECODE_COLUMNS = 256  # static KV cache columns allocated for decode at first (then doubled)


class NativeBackend(SamplingBackend):
    def __init__(
        self,
        engine: Engine,
        *,
        share_prefix: bool = True,
        lean_decode: bool = True,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    ) -> None:
        """``lean_decode``: run prefill and decode steps through
        :class:`~opentinker.sampling.lean_model.LeanModel` (fused weights, static KV cache) instead
        of the HF module tree where it covers the model; other models always take the HF forward,
        and :attr:`lean_reason` says why (logged). ``prefix_cache_bytes``:
        the budget of the :class:`~opentinker.sampling.prefix_cache.PrefixCache` that lets a
        prompt continuing a finished sequence (the next turn of a conversation) skip prefilling
        it (0 = off)."""
        self.engine = engine
        self.share_prefix = share_prefix
        self.lean_decode = lean_decode
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self._lora_cache = LoRACache()
        self.tokenizer = engine.base.tokenizer
        self.eos_ids = _eos_ids(engine)
        # transformers 5.x renamed forward's ``past_key_values`` to ``cache``; accept either.
        params = inspect.signature(engine.base.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._unsupported = unsupported_cache_reason(engine.base.model)
        # why this backend decodes through HF's forward, not the lean one (None: it does not)
        self.lean_reason: str | None = "lean_decode=False"
        if lean_decode:
            self.lean_reason = unsupported_reason(engine.base.model, engine.lora.groups)
            if self.lean_reason is not None:
                log.info("native sampler: HF forward, no lean decode path: %s", self.lean_reason)

    # ---------------------------------------------------------------- policies
    def publish(self, policy_id: str, weights: LoRAWeights) -> None:
        if policy_id in self.engine.snapshot_ids():
            return
        self.engine.add_snapshot(policy_id, weights)

    def retire(self, policy_id: str) -> None:
        self._lora_cache.clear()
        self.prefix_cache.drop(lambda key: isinstance(key, tuple) and key[0] == policy_id)
        self.engine.release_snapshot(policy_id)

    def policy_key(self, policy: PolicyRef) -> Hashable:
        """What the keys and values a policy computes depend on: the base model's (None), or a
        policy's id with its weights' process-unique id and version counters (an adapter that
        trained, or a snapshot id released and reused for other weights, never matches)."""
        if policy is None:
            return None
        w = self.engine.adapter_weights(policy)
        return (policy, w.uid, tuple(t._version for t in w.tensors()))

    # ---------------------------------------------------------------- sampling
    def validate(self, req: SampleRequest) -> None:
        """Raise :class:`EngineError` naming the problem with ``req``."""
        if self._unsupported is not None:
            raise EngineError(self._unsupported)
        check_request(req, vocab_size=self.engine.vocab_size, max_context=self.engine.max_context)
        try:
            check_placeholders("the prompt", torch.tensor(req.prompt), req.images, self.engine.base.vision)
        except ValueError as e:
            raise EngineError(str(e)) from None
        _check_prompt_extras(
            req, self.engine.vocab_size
        )  # the prompt-logprob extras only this backend serves
        self.engine.check_policy(req.policy)

    def generate(self, requests: list[SampleRequest]) -> list[SampleResult | EngineError]:
        """One batch, run to completion: every request admitted at once, then decoded until each
        row has stopped."""
        return run_to_completion(self.decoder(), requests)

    def decoder(self, *, snapshots_only: bool = False) -> StepDecoder:
        """A step-wise decoder over this backend's model, caches and settings (see
        :class:`~opentinker.sampling.decoder.StepDecoder`; ``snapshots_only`` refuses live adapters)."""
        return StepDecoder(
            self.engine,
            validate=self.validate,
            prefix_cache=self.prefix_cache,
            loras=self._lora_cache,
            lean=self._lean(),
            share_prefix=self.share_prefix,
            eos_ids=self.eos_ids,
            cache_kw=self._cache_kw,
            first_decode_cols=LEAN_FIRST_DECODE_COLUMNS,
            snapshots_only=snapshots_only,
        )

    def _lean(self) -> LeanModel | None:
        if not self.lean_decode:
            return None
        return lean_model(self.engine.base.model, self.engine.lora.groups)


def _eos_ids(engine: Engine) -> set[int]:
    ids: set[int] = set()
    tok_eos = engine.base.tokenizer.eos_token_id
    if tok_eos is not None:
        ids.add(int(tok_eos))
    gen_cfg = getattr(engine.base.model, "generation_config", None)
    eos = getattr(gen_cfg, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list):
        ids.update(int(e) for e in eos)
    return ids


def _check_prompt_extras(req: SampleRequest, vocab: int) -> None:
    """``target_prompt_tokens`` and ``prompt_alt_tokens_k``: a row per prompt position after the
    first, ids in the vocabulary (or -1), k in [0, vocab]."""
    if req.target_prompt_tokens is not None:
        rows = req.target_prompt_tokens
        if len(req.prompt) < 2 or len(rows) != len(req.prompt) - 1:
            raise EngineError(
                f"target_prompt_logprobs must have len(prompt) - 1 = {len(req.prompt) - 1} rows "
                f"(row i is scored at prompt position i + 1), got {len(rows)}"
            )
        widths = {len(row) for row in rows}
        if len(widths) > 1:
            raise EngineError("target_prompt_logprobs must be a [len(prompt) - 1, K] matrix (rows differ)")
        bad = [t for row in rows for t in row if not -1 <= t < vocab]
        if bad:
            raise EngineError(
                f"target_prompt_logprobs has token id {bad[0]} outside the vocabulary [0, {vocab}) (-1 = none)"
            )
    k = req.prompt_alt_tokens_k
    if not isinstance(k, int) or not 0 <= k <= vocab:
        raise EngineError(f"prompt_alt_tokens_k must be an integer in [0, {vocab}], got {k!r}")
    if k and len(req.prompt) < 2:
        raise EngineError("prompt_alt_tokens_k needs a prompt of at least 2 tokens")
