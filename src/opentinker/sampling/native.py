"""The native PyTorch rollout backend: KV-cache decoding of batches that mix policies and lengths.

One ``generate`` call is one batch:

1. **Prefill** every request's prompt once (left-padded; ``position_ids`` count real tokens only),
   each row routed through its own policy by the engine's multi-LoRA layers. Prompt logprobs and
   top-k prompt logprobs come from these logits. When every request names the same policy and the
   prompts begin with the same tokens (a system prompt and a question template: an RL step's
   prompts, an evaluation set), that common prefix is prefilled once and its KV cache shared by
   every row; each prompt's own suffix is then prefilled on it (``share_prefix``). A prompt that
   continues a sequence an earlier call finished under the same policy state (the next turn of a
   conversation) starts instead from that sequence's keys and values, kept in a
   :class:`~opentinker.sampling.prefix_cache.PrefixCache`, and prefills only its new tokens.
2. **Fan out** ``num_samples`` rows per request by selecting KV-cache rows (no second prefill).
3. **Decode** one token per live row per step, every row with its own policy, sampling parameters
   and seeded generator; rows leave the batch (and the KV cache) as soon as they stop.

Requests that arrive while a batch decodes wait for the next ``generate`` call (the scheduler
gathers every waiting request into that next batch); joining a running batch mid-decode is not
done here.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from opentinker.engine import Engine, EngineError
from opentinker.engine.types import PolicyRef
from opentinker.lora import LoRABatch, LoRAWeights
from opentinker.sampling.backend import RolloutBackend
from opentinker.sampling.choice import Row, choose_tokens, prompt_logprobs
from opentinker.sampling.llama_decode import LeanCache, LeanLoRA, LlamaLean, lean_llama
from opentinker.sampling.prefix_cache import PrefixCache, PrefixHit
from opentinker.sampling.types import SampledSequence, SampleRequest, SampleResult, SamplingParams, StopReason

MIN_SHARED_PREFIX = 8  # tokens; a shorter common prefix is not worth a second forward
DEFAULT_PREFIX_CACHE_BYTES = 512 << 20  # keys and values of finished sequences kept for their next turn
LEAN_FIRST_DECODE_COLUMNS = 256  # static KV cache columns allocated for decode at first (then doubled)


class NativeBackend(RolloutBackend):
    def __init__(
        self,
        engine: Engine,
        *,
        share_prefix: bool = True,
        lean_decode: bool = True,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    ) -> None:
        """``lean_decode``: run prefill and decode steps of Llama-family models through
        :class:`~opentinker.sampling.llama_decode.LlamaLean` (fused weights, static KV cache) instead
        of the HF module tree; other models always take the HF forward. ``prefix_cache_bytes``:
        the budget of the :class:`~opentinker.sampling.prefix_cache.PrefixCache` that lets a
        prompt continuing a finished sequence (the next turn of a conversation) skip prefilling
        it (0 = off)."""
        self.engine = engine
        self.share_prefix = share_prefix
        self.lean_decode = lean_decode
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self._lora_cache = _LoRACache()
        self.tokenizer = engine.base.tokenizer
        self.eos_ids = _eos_ids(engine)
        # transformers 5.x renamed forward's ``past_key_values`` to ``cache``; accept either.
        params = inspect.signature(engine.base.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

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
        p = req.params
        vocab, ctx = self.engine.vocab_size, self.engine.max_context
        if not req.prompt:
            raise EngineError("the prompt is empty")
        if len(req.prompt) >= ctx:
            raise EngineError(f"the prompt has {len(req.prompt)} tokens; the context length is {ctx}")
        bad = [t for t in req.prompt if not 0 <= t < vocab]
        if bad:
            raise EngineError(f"the prompt has token id {bad[0]} outside the vocabulary [0, {vocab})")
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
        if p.stop is not None:
            kinds = {type(s) for s in p.stop}
            if len(kinds) > 1 or not kinds <= {str, int}:
                raise EngineError("stop must be a list of strings or a list of token ids, not a mix")
            if kinds == {str} and any(s == "" for s in p.stop):
                raise EngineError("stop strings must not be empty")
        self.engine.check_policy(req.policy)

    def generate(self, requests: list[SampleRequest]) -> list[SampleResult | EngineError]:
        results: list[SampleResult | EngineError | None] = [None] * len(requests)
        valid = []
        for i, req in enumerate(requests):
            try:
                self.validate(req)
                valid.append(i)
            except EngineError as e:
                results[i] = e
        if valid:
            for i, res in zip(valid, self._run([requests[i] for i in valid]), strict=True):
                results[i] = res
        return [r if r is not None else EngineError("request was not run") for r in results]

    @torch.no_grad()
    def _run(self, reqs: list[SampleRequest]) -> list[SampleResult]:
        eng, dev = self.engine, self.engine.device
        want_prompt = any(r.prompt_logprobs or r.topk_prompt_logprobs for r in reqs)
        lean = self._lean()
        cached = self.prefix_cache.max_bytes > 0 and not want_prompt
        keys = [self.policy_key(r.policy) for r in reqs] if cached else []
        hits, shared = self._prompt_starts(reqs, keys, want_prompt)
        skip = [shared] * len(reqs) if shared else [h.length if h is not None else 0 for h in hits]
        lens = [len(r.prompt) - k for r, k in zip(reqs, skip, strict=True)]
        width = max(lens)
        ids = torch.zeros(len(reqs), width, dtype=torch.long, device=dev)
        mask = torch.zeros(len(reqs), width, dtype=torch.long, device=dev)
        for i, r in enumerate(reqs):
            ids[i, width - lens[i] :] = torch.tensor(r.prompt[skip[i] :], device=dev)
            mask[i, width - lens[i] :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0) + torch.tensor(skip, device=dev)[:, None]
        prefixes = [h.kv if h is not None else None for h in hits] if any(hits) else None
        if lean is not None:
            # columns the decode may feed: every row's new tokens but its last
            most = max(min(r.params.max_tokens, eng.max_context - len(r.prompt)) for r in reqs)
            model: _Forward = _LeanForward(eng, lean, max(skip) + width, most - 1, self._lora_cache, prefixes)
        else:
            model = _HFForward(eng, self._cache_kw, prefixes)
        prefill_plan = model.plan([r.policy for r in reqs])
        logits = model.prefill(reqs, shared, ids, mask, pos, want_prompt, prefill_plan)
        results = [SampleResult(sequences=[]) for _ in reqs]
        for i, r in enumerate(reqs):
            if r.prompt_logprobs or r.topk_prompt_logprobs:
                prompt_logprobs(results[i], logits[i, width - lens[i] :], r)

        rows: list[Row] = []
        for i, r in enumerate(reqs):
            for k in range(r.num_samples):
                rows.append(self._new_row(i, r, k, len(r.prompt)))
        select = torch.tensor([row.req for row in rows], device=dev)
        model.select(select)
        # the prefill's stacked adapters serve the decode (rows follow their requests in order)
        plan = model.fan_out(prefill_plan, select, [row.policy for row in rows])
        last = logits[select, -1]  # [S, V]
        active = list(range(len(rows)))
        step_pos = torch.tensor([row.prompt_len - 1 for row in rows], device=dev)[:, None]
        ctx = eng.max_context
        while True:
            picked = choose_tokens(last, [rows[s] for s in active])
            for s, (tok, lp) in zip(active, picked, strict=True):
                row = rows[s]
                row.tokens.append(tok)
                row.logprobs.append(lp)
                row.reason = self._stop_reason(row, ctx)
            keep = [j for j, s in enumerate(active) if rows[s].reason is None]
            if cached and len(keep) < len(active):  # keep what the finished rows computed
                for j, s in enumerate(active):
                    row = rows[s]
                    if row.reason is not None:
                        tokens = reqs[row.req].prompt + row.tokens[:-1]
                        self.prefix_cache.put(keys[row.req], tokens, model.row_kv(j))
            if not keep:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep, device=dev)
                model.select(idx)
                plan = plan.select(idx) if plan is not None else None
                active = [active[j] for j in keep]
                step_pos = step_pos[idx]
            # the new tokens' positions: one past the last, every step
            step_pos += 1
            step_ids = torch.tensor([rows[s].tokens[-1] for s in active], device=dev)[:, None]
            last = model.step(step_ids, step_pos, plan)
        for row in rows:
            assert row.reason is not None
            results[row.req].sequences.append(SampledSequence(row.tokens, row.logprobs, row.reason))
        return results

    def _prompt_starts(
        self, reqs: list[SampleRequest], keys: list[Hashable], want_prompt: bool
    ) -> tuple[list[PrefixHit | None], int]:
        """Where each prompt's prefill starts: the prefix cache's hit per request (``keys``: their
        policy keys; empty = the cache is not used), or else the length of the prefix common to
        all prompts, prefilled once and shared (0 = none)."""
        hits: list[PrefixHit | None] = [None] * len(reqs)
        if keys:
            hits = [self.prefix_cache.match(k, r.prompt) for k, r in zip(keys, reqs, strict=True)]
        if any(hits) or want_prompt or not self.share_prefix:
            return hits, 0
        return hits, common_prompt_prefix(reqs)

    def _lean(self) -> LlamaLean | None:
        if not self.lean_decode:
            return None
        return lean_llama(self.engine.base.model, self.engine.lora.groups)

    def _new_row(self, i: int, r: SampleRequest, k: int, prompt_len: int) -> Row:
        seed = r.params.seed
        gen = torch.Generator(device="cpu")
        if seed is None:
            gen.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        else:
            gen.manual_seed((int(seed) * 1_000_003 + k) % (1 << 63))
        stop = r.params.stop
        # the SDK's contract: None stops at EOS; a non-empty list stops at its entries *and* at
        # EOS; only [] disables every stop, EOS included
        if stop is None:
            ids, strs = frozenset(self.eos_ids), ()
        elif not stop:
            ids, strs = frozenset(), ()
        elif all(isinstance(s, int) for s in stop):
            ids, strs = frozenset(self.eos_ids | {int(s) for s in stop}), ()
        else:
            ids, strs = frozenset(self.eos_ids), tuple(str(s) for s in stop)
        return Row(i, r.policy, r.params, prompt_len, gen, ids, strs)

    def _stop_reason(self, row: Row, ctx: int) -> StopReason | None:
        if row.tokens[-1] in row.stop_ids:
            return "stop"
        if row.stop_strs:
            # decode the whole completion: a stop string may span several tokens
            text = self.tokenizer.decode(row.tokens, skip_special_tokens=False)
            if any(s in text for s in row.stop_strs):
                return "stop"
        if len(row.tokens) >= row.params.max_tokens or row.prompt_len + len(row.tokens) >= ctx:
            return "length"
        return None

    def compute_logprobs(self, policy: str | None, tokens: list[int]) -> list[float | None]:
        """Logprob of each token given the ones before it under ``policy`` (the first is None)."""
        req = SampleRequest(
            policy, tokens, SamplingParams(max_tokens=1, temperature=0.0), prompt_logprobs=True
        )
        [res] = self.generate([req])
        if isinstance(res, Exception):
            raise res
        assert res.prompt_logprobs is not None
        return res.prompt_logprobs


class _Forward(Protocol):
    """The model side of one ``generate`` batch: prefill, then one decode step at a time."""

    def plan(self, policies: list[PolicyRef]) -> LoRABatch | None:
        """The routing plan of the requests (row ``i`` through ``policies[i]``)."""
        ...

    def fan_out(
        self, plan: LoRABatch | None, select: torch.Tensor, policies: list[PolicyRef]
    ) -> LoRABatch | None:
        """The plan of the decode rows ``select`` (request indices, in order; ``policies`` theirs)."""
        ...

    def prefill(
        self,
        reqs: list[SampleRequest],
        shared: int,
        ids: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        want_prompt: bool,
        plan: LoRABatch | None,
    ) -> torch.Tensor:
        """fp32 logits [B, T, V] of the left-padded prompts ``ids`` after the ``shared`` prefix
        (T = every position if ``want_prompt``, else the last one), row ``i`` routed by ``plan``
        (the requests' policies)."""
        ...

    def select(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) these rows of the KV cache, in this order."""
        ...

    def row_kv(self, row: int) -> torch.Tensor:
        """A copy of the keys and values batch row ``row`` computed (its prompt and fed tokens,
        padding removed): [layers, 2, kv_heads, n, head_dim], for the prefix cache."""
        ...

    def step(self, ids: torch.Tensor, pos: torch.Tensor, plan: LoRABatch | None) -> torch.Tensor:
        """fp32 logits [B, V] of one new token per row (``ids``, ``pos``: [B, 1])."""
        ...


class _HFForward:
    """The model's own HF forward with a ``DynamicCache``, LoRA through the engine's routing."""

    def __init__(
        self, engine: Engine, cache_kw: str, prefixes: list[torch.Tensor | None] | None = None
    ) -> None:
        """``prefixes``: each row's cached keys and values to start from (see :class:`_LeanForward`)."""
        self.engine = engine
        self.model = engine.base.model
        self.cache_kw = cache_kw
        self.cache = DynamicCache()
        self.mask = torch.zeros(0)
        self.prefixes = prefixes

    def plan(self, policies: list[PolicyRef]) -> LoRABatch | None:
        return self.engine.plan_routing(policies)

    def fan_out(
        self, plan: LoRABatch | None, select: torch.Tensor, policies: list[PolicyRef]
    ) -> LoRABatch | None:
        return plan.select(select) if plan is not None and len(policies) > plan.row_index.shape[0] else plan

    def prefill(
        self,
        reqs: list[SampleRequest],
        shared: int,
        ids: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        want_prompt: bool,
        plan: LoRABatch | None,
    ) -> torch.Tensor:
        eng, model, dev, cache = self.engine, self.model, self.engine.device, self.cache
        if shared:  # the common prefix once, its KV cache then copied to every row
            with eng.routing([reqs[0].policy]):
                model(
                    input_ids=torch.tensor([reqs[0].prompt[:shared]], device=dev),
                    position_ids=torch.arange(shared, device=dev)[None],
                    use_cache=True,
                    logits_to_keep=1,
                    **{self.cache_kw: cache},
                )
            cache.batch_select_indices(torch.zeros(len(reqs), dtype=torch.long, device=dev))
            mask = torch.cat([mask.new_ones(len(reqs), shared), mask], dim=1)
        elif self.prefixes is not None:  # each row's cached prefix, right-aligned, padding masked
            mask = torch.cat([self._load_prefixes(self.prefixes), mask], dim=1)
        with eng.routing(plan):
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                use_cache=True,
                logits_to_keep=0 if want_prompt else 1,
                **{self.cache_kw: cache},
            )
        self.mask = mask
        return out.logits.float()

    def _load_prefixes(self, prefixes: list[torch.Tensor | None]) -> torch.Tensor:
        """Fill the empty cache with the rows' prefixes; return their attention mask [B, P]."""
        ref = next(kv for kv in prefixes if kv is not None)
        n_layers, _, n_kv, _, head_dim = ref.shape
        end = max(kv.shape[3] for kv in prefixes if kv is not None)
        kv_all = ref.new_zeros(n_layers, 2, len(prefixes), n_kv, end, head_dim)
        mask = torch.zeros(len(prefixes), end, dtype=torch.long, device=ref.device)
        for i, kv in enumerate(prefixes):
            if kv is not None:
                kv_all[:, :, i, :, end - kv.shape[3] :] = kv
                mask[i, end - kv.shape[3] :] = 1
        for layer in range(n_layers):
            self.cache.update(kv_all[layer, 0], kv_all[layer, 1], layer)
        return mask

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]

    def row_kv(self, row: int) -> torch.Tensor:
        cols = self.mask[row].nonzero().squeeze(1)
        cached: list[Any] = list(self.cache.layers)  # attention layers: .keys/.values [B, kv, T, D]
        layers = [torch.stack((layer.keys[row], layer.values[row])) for layer in cached]
        return torch.stack(layers).index_select(3, cols)

    def step(self, ids: torch.Tensor, pos: torch.Tensor, plan: LoRABatch | None) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(ids.shape[0], 1)], dim=1)
        with self.engine.routing(plan):
            out = self.model(
                input_ids=ids,
                attention_mask=self.mask,
                position_ids=pos,
                use_cache=True,
                **{self.cache_kw: self.cache},
            )
        return out.logits[:, -1].float()


class _LeanForward:
    """:class:`LlamaLean` over a static :class:`LeanCache` (``prompt_cols`` prompt columns, up to
    ``decode_cols`` decode columns, allocated as they are needed). Runs in inference mode (less
    bookkeeping per op than ``no_grad``); the logits it returns are inference tensors."""

    def __init__(
        self,
        engine: Engine,
        lean: LlamaLean,
        prompt_cols: int,
        decode_cols: int,
        loras: _LoRACache,
        prefixes: list[torch.Tensor | None] | None = None,
    ) -> None:
        """``prefixes``: each row's cached keys and values to start from (then ``ids`` of
        :meth:`prefill` are what follows them)."""
        self.engine = engine
        self.prefixes = prefixes
        self.lean = lean
        self.prompt_cols = prompt_cols
        self.decode_cols = max(decode_cols, 0)
        self.loras = loras
        self.cache: LeanCache | None = None
        self._plan: LoRABatch | None = None
        self.lora: LeanLoRA | None = None

    def plan(self, policies: list[PolicyRef]) -> LoRABatch | None:
        return self.loras.plan(self.engine, policies, lambda: self.engine.plan_routing(policies))

    def fan_out(
        self, plan: LoRABatch | None, select: torch.Tensor, policies: list[PolicyRef]
    ) -> LoRABatch | None:
        if plan is None or len(policies) == plan.row_index.shape[0]:
            return plan
        return self.loras.plan(self.engine, policies, lambda: plan.select(select))

    def _lora(self, plan: LoRABatch | None) -> LeanLoRA | None:
        if plan is not self._plan:
            self._plan = plan
            groups, dtype = self.engine.lora.groups, self.lean.dtype
            self.lora = None if plan is None else self.loras.lora(plan, lambda: LeanLoRA(plan, groups, dtype))
        return self.lora

    @torch.inference_mode()
    def prefill(
        self,
        reqs: list[SampleRequest],
        shared: int,
        ids: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        want_prompt: bool,
        plan: LoRABatch | None,
    ) -> torch.Tensor:
        eng, lean, dev = self.engine, self.lean, self.engine.device
        first = self.prompt_cols + min(self.decode_cols, LEAN_FIRST_DECODE_COLUMNS)
        cache = lean.new_cache(1 if shared else len(reqs), first, self.prompt_cols + self.decode_cols)
        self.cache = cache
        if shared:  # the common prefix once, its KV cache then copied to every row
            prefix = torch.tensor([reqs[0].prompt[:shared]], device=dev)
            first_plan = eng.plan_routing([reqs[0].policy])
            lora = self._lora(first_plan)
            lean.forward(cache, prefix, torch.arange(shared, device=dev)[None], None, lora, 1)
            cache.select(torch.zeros(len(reqs), dtype=torch.long, device=dev))
        elif self.prefixes is not None:
            cache.load_prefixes(self.prefixes)
        logits = lean.forward(cache, ids, pos, mask.bool(), self._lora(plan), 0 if want_prompt else 1)
        return logits.float()

    @torch.inference_mode()
    def select(self, rows: torch.Tensor) -> None:
        assert self.cache is not None
        self.cache.select(rows)

    @torch.inference_mode()
    def row_kv(self, row: int) -> torch.Tensor:
        """A copy of the keys and values batch row ``row`` computed (prompt and fed tokens)."""
        assert self.cache is not None
        return self.cache.row_kv(row)

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, pos: torch.Tensor, plan: LoRABatch | None) -> torch.Tensor:
        assert self.cache is not None
        return self.lean.forward(self.cache, ids, pos, None, self._lora(plan), 1)[:, -1].float()


class _LoRACache:
    """The routing plans (stacked adapters) and fused LoRA weights of the last batch's policies,
    reused by later batches while every policy keeps the same weights, unchanged in place (same
    tensors, same version counters): a sampler serving the same adapters again (an evaluation
    loop, the samples of one RL step) stacks and fuses nothing. It holds those tensors (two to
    three times the adapters' own size) until the policies or their weights change, or a snapshot
    is retired. Only the lean path uses it; the HF path stacks the adapters for every batch."""

    MAX_LAYOUTS = 4  # row layouts kept per set of weights

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._policies: tuple[PolicyRef, ...] = ()
        self._weights: list[tuple[LoRAWeights, tuple[int, ...]]] = []
        self._plans: dict[tuple[PolicyRef, ...], LoRABatch | None] = {}
        self._loras: dict[int, tuple[LoRABatch, LeanLoRA]] = {}

    def plan(
        self, engine: Engine, policies: list[PolicyRef], build: Callable[[], LoRABatch | None]
    ) -> LoRABatch | None:
        distinct = tuple(dict.fromkeys(policies))
        weights = [engine.adapter_weights(p) for p in distinct if p is not None]
        current = [(w, tuple(t._version for t in w.tensors())) for w in weights]
        same = distinct == self._policies and all(
            w is w0 and v == v0 for (w, v), (w0, v0) in zip(current, self._weights, strict=True)
        )
        if not same:
            self.clear()
            self._policies, self._weights = distinct, current
        key = tuple(policies)
        if key not in self._plans:
            if len(self._plans) >= self.MAX_LAYOUTS:
                self._plans, self._loras = {}, {}
            self._plans[key] = build()
        return self._plans[key]

    def lora(self, plan: LoRABatch, build: Callable[[], LeanLoRA]) -> LeanLoRA:
        hit = self._loras.get(id(plan))
        if hit is not None and hit[0] is plan:
            return hit[1]
        lora = build()
        if any(p is plan for p in self._plans.values()):  # not the plans of rows that finished
            self._loras[id(plan)] = (plan, lora)
        return lora


def common_prompt_prefix(reqs: list[SampleRequest]) -> int:
    """Length of the prompt prefix that every request shares under one policy (each keeps at least
    one token of its own to prefill), or 0 when it is not worth sharing."""
    if len(reqs) < 2 or len({r.policy for r in reqs}) > 1:
        return 0
    first = reqs[0].prompt
    n = min(len(r.prompt) for r in reqs) - 1
    for r in reqs[1:]:
        p = r.prompt
        k = 0
        while k < n and p[k] == first[k]:
            k += 1
        n = k
    return n if n >= MIN_SHARED_PREFIX else 0


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
