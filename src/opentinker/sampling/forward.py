"""The model side of the step-wise decoder: prefill a group of prompts, decode one token per row,
drop finished rows, and merge a newly prefilled group into the running batch.

Two implementations of one :class:`Forward` contract:

* :class:`LeanForward`: :class:`~opentinker.sampling.llama_decode.LlamaLean` over a static
  :class:`~opentinker.sampling.kv_cache.LeanCache` (Llama-family models);
* :class:`HFForward`: the model's own HF forward over a ``DynamicCache``, LoRA through the
  engine's routing (every other family).

**Joining a running batch** (continuous batching). Every row's keys and values sit right-aligned
in the cache's columns (left padding is masked out), and a row's RoPE positions are its own
(``position_ids``), never its column: so two batches merge by left-padding the shorter one to the
other's width and stacking their rows (:meth:`Forward.merge`). The next decode step then writes
one new column for every row, old and new alike. Columns that have become padding in every row
(their rows left) are dropped when rows leave (``LeanCache.trim``), so a long-finished long prompt
does not keep widening the batch. The lean cache moves only the rows that leave or join
(:mod:`opentinker.sampling.kv_cache`).

Policies come in as their weights (resolved once, when a request is admitted, and held by its
rows), never looked up again by id: a snapshot retired mid-decode keeps serving the rows that
were admitted under it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from opentinker.engine import Engine
from opentinker.engine.types import PolicyRef
from opentinker.lora import LoRABatch, LoRAWeights
from opentinker.sampling.kv_cache import LeanCache
from opentinker.sampling.llama_decode import LeanLoRA, LlamaLean

# A batch's policies, resolved when their requests were admitted (None: the bare base model).
Weights = Mapping[PolicyRef, LoRAWeights | None]


@dataclass(frozen=True)
class SharedPrefix:
    """The prompt prefix every row of a prefill shares (prefilled once, then copied per row)."""

    tokens: list[int]
    plan: LoRABatch | None  # its one row's routing


def make_plan(engine: Engine, policies: list[PolicyRef], weights: Weights) -> LoRABatch | None:
    """The routing plan of rows ``policies`` (row ``i`` through ``weights[policies[i]]``), like
    ``Engine.plan_routing`` but from weights already resolved."""
    order: dict[PolicyRef, int] = {}
    for p in policies:
        order.setdefault(p, len(order))
    rows = torch.tensor([order[p] for p in policies], dtype=torch.long, device=engine.device)
    return engine.lora.make_batch([weights[p] for p in order], rows)


def replan(
    engine: Engine, plan: LoRABatch | None, policies: list[PolicyRef], weights: Weights
) -> LoRABatch | None:
    """The plan of rows ``policies``: ``plan``'s stacked adapters with new rows when it holds all
    of them (no restacking), else a new plan."""
    if plan is not None:
        index = {id(w): k for k, w in enumerate(plan.entries) if w is not None}
        try:
            rows = [index[id(weights[p])] if p is not None else plan.entries.index(None) for p in policies]
        except (KeyError, ValueError):
            pass
        else:
            return plan.with_rows(torch.tensor(rows, dtype=torch.long, device=plan.row_index.device))
    return make_plan(engine, policies, weights)


class Forward(Protocol):
    """The model side of one running batch: prefill, then one decode step at a time."""

    def plan(self, policies: list[PolicyRef], weights: Weights) -> LoRABatch | None:
        """The routing plan of the requests (row ``i`` through ``policies[i]``)."""
        ...

    def fan_out(
        self, plan: LoRABatch | None, select: torch.Tensor, policies: list[PolicyRef], weights: Weights
    ) -> LoRABatch | None:
        """The plan of the decode rows ``select`` (request indices, in order; ``policies`` theirs)."""
        ...

    def prefill(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        want_prompt: bool,
        plan: LoRABatch | None,
        shared: SharedPrefix | None = None,
    ) -> torch.Tensor:
        """fp32 logits [B, T, V] of the left-padded prompts ``ids`` after the ``shared`` prefix
        (T = every position if ``want_prompt``, else the last one), row ``i`` routed by ``plan``
        (the requests' policies)."""
        ...

    def select(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) these rows of the KV cache, in this order."""
        ...

    def merge(self, other: Any, room: int) -> None:
        """Append ``other``'s rows (a batch of the same kind, prefilled and fanned out) after this
        batch's, with room for ``room`` more decode columns."""
        ...

    def row_kv(self, row: int) -> torch.Tensor:
        """A copy of the keys and values batch row ``row`` computed (its prompt and fed tokens,
        padding removed): [layers, 2, kv_heads, n, head_dim], for the prefix cache."""
        ...

    def step(self, ids: torch.Tensor, pos: torch.Tensor, plan: LoRABatch | None) -> torch.Tensor:
        """fp32 logits [B, V] of one new token per row (``ids``, ``pos``: [B, 1])."""
        ...


def _left_pad(t: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    """``t`` with zeros prepended along ``dim`` up to ``width``."""
    n = t.shape[dim]
    if n == width:
        return t
    shape = list(t.shape)
    shape[dim] = width - n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


# layer kinds whose cache is keys and values (what HFForward's cache handling slices and merges)
_KV_LAYERS = frozenset({"full_attention", "attention", "sliding_attention", "chunked_attention"})


def unsupported_cache_reason(model: Any) -> str | None:
    """Why the native sampler cannot hold ``model``'s decoding state (None: it can).

    Its cache is per-row keys and values of equal width in every layer: rows are selected, merged
    and stored for the next turn by slicing them. A layer that keeps a recurrent state (Gated
    DeltaNet, Mamba2) or MLA's keys and values of different widths does not fit that yet; such a
    model trains, and sampling it is refused with this reason instead of failing mid-decode.
    """
    config: Any = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    family = str(getattr(config, "model_type", "this model"))
    for attr in ("layer_types", "layers_block_type"):
        kinds = {str(k) for k in (getattr(config, attr, None) or [])} - _KV_LAYERS - {"mlp", "moe"}
        if kinds:
            return (
                f"the native sampler cannot sample {family} yet: its {', '.join(sorted(kinds))} layers keep "
                "a recurrent state, which its key-value cache does not hold"
            )
    v, nope, rope = (getattr(config, a, None) for a in ("v_head_dim", "qk_nope_head_dim", "qk_rope_head_dim"))
    if v is not None and nope is not None and rope is not None and v != nope + rope:
        return (
            f"the native sampler cannot sample {family} yet: its MLA attention caches keys {nope + rope} and "
            f"values {v} wide, and its key-value cache holds equal widths only"
        )
    return None


class HFForward:
    """The model's own HF forward with a ``DynamicCache``, LoRA through the engine's routing."""

    def __init__(
        self, engine: Engine, cache_kw: str, prefixes: list[torch.Tensor | None] | None = None
    ) -> None:
        """``prefixes``: each row's cached keys and values to start from (see :class:`LeanForward`)."""
        self.engine = engine
        self.model = engine.base.model
        self.cache_kw = cache_kw
        self.cache = DynamicCache()
        self.mask = torch.zeros(0)
        self.prefixes = prefixes

    def plan(self, policies: list[PolicyRef], weights: Weights) -> LoRABatch | None:
        return make_plan(self.engine, policies, weights)

    def fan_out(
        self, plan: LoRABatch | None, select: torch.Tensor, policies: list[PolicyRef], weights: Weights
    ) -> LoRABatch | None:
        return plan.select(select) if plan is not None and len(policies) > plan.row_index.shape[0] else plan

    def prefill(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        want_prompt: bool,
        plan: LoRABatch | None,
        shared: SharedPrefix | None = None,
    ) -> torch.Tensor:
        eng, model, dev, cache = self.engine, self.model, self.engine.device, self.cache
        rows = ids.shape[0]
        if shared is not None:  # the common prefix once, its KV cache then copied to every row
            n = len(shared.tokens)
            with eng.routing(shared.plan):
                model(
                    input_ids=torch.tensor([shared.tokens], device=dev),
                    position_ids=torch.arange(n, device=dev)[None],
                    use_cache=True,
                    logits_to_keep=1,
                    **{self.cache_kw: cache},
                )
            cache.batch_select_indices(torch.zeros(rows, dtype=torch.long, device=dev))
            mask = torch.cat([mask.new_ones(rows, n), mask], dim=1)
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

    def merge(self, other: Any, room: int) -> None:
        assert isinstance(other, HFForward)
        width = max(self.mask.shape[1], other.mask.shape[1])
        mine: list[Any] = list(self.cache.layers)  # attention layers: .keys/.values [B, kv, T, D]
        theirs: list[Any] = list(other.cache.layers)
        merged = DynamicCache()
        for layer, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            keys = torch.cat([_left_pad(a.keys, 2, width), _left_pad(b.keys, 2, width)])
            values = torch.cat([_left_pad(a.values, 2, width), _left_pad(b.values, 2, width)])
            merged.update(keys, values, layer)
        self.cache = merged
        self.mask = torch.cat([_left_pad(self.mask, 1, width), _left_pad(other.mask, 1, width)])

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


class LeanForward:
    """:class:`LlamaLean` over a static :class:`LeanCache` (``prompt_cols`` prompt columns, up to
    ``decode_cols`` decode columns, ``first_cols`` of them allocated at first, then doubled as
    needed). Runs in inference mode (less bookkeeping per op than ``no_grad``); the logits it
    returns are inference tensors."""

    def __init__(
        self,
        engine: Engine,
        lean: LlamaLean,
        prompt_cols: int,
        decode_cols: int,
        loras: LoRACache,
        prefixes: list[torch.Tensor | None] | None = None,
        first_cols: int = 256,
    ) -> None:
        """``prefixes``: each row's cached keys and values to start from (then ``ids`` of
        :meth:`prefill` are what follows them)."""
        self.engine = engine
        self.prefixes = prefixes
        self.lean = lean
        self.prompt_cols = prompt_cols
        self.decode_cols = max(decode_cols, 0)
        self.first_cols = first_cols
        self.loras = loras
        self.cache: LeanCache | None = None
        self._plan: LoRABatch | None = None
        self.lora: LeanLoRA | None = None

    def plan(self, policies: list[PolicyRef], weights: Weights) -> LoRABatch | None:
        return self.loras.plan(policies, weights, lambda: make_plan(self.engine, policies, weights))

    def fan_out(
        self, plan: LoRABatch | None, select: torch.Tensor, policies: list[PolicyRef], weights: Weights
    ) -> LoRABatch | None:
        if plan is None or len(policies) == plan.row_index.shape[0]:
            return plan
        return self.loras.plan(policies, weights, lambda: plan.select(select))

    def _lora(self, plan: LoRABatch | None) -> LeanLoRA | None:
        if plan is not self._plan:
            self._plan = plan
            groups, dtype = self.engine.lora.groups, self.lean.dtype
            self.lora = None if plan is None else self.loras.lora(plan, lambda: LeanLoRA(plan, groups, dtype))
        return self.lora

    @torch.inference_mode()
    def prefill(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        want_prompt: bool,
        plan: LoRABatch | None,
        shared: SharedPrefix | None = None,
    ) -> torch.Tensor:
        lean, dev, rows = self.lean, self.engine.device, ids.shape[0]
        first = self.prompt_cols + min(self.decode_cols, self.first_cols)
        cache = lean.new_cache(1 if shared else rows, first, self.prompt_cols + self.decode_cols)
        self.cache = cache
        if shared is not None:  # the common prefix once, its KV cache then copied to every row
            prefix = torch.tensor([shared.tokens], device=dev)
            n = len(shared.tokens)
            lean.forward(cache, prefix, torch.arange(n, device=dev)[None], None, self._lora(shared.plan), 1)
            cache.select(torch.zeros(rows, dtype=torch.long, device=dev))
        elif self.prefixes is not None:
            cache.load_prefixes(self.prefixes)
        logits = lean.forward(cache, ids, pos, mask.bool(), self._lora(plan), 0 if want_prompt else 1)
        return logits.float()

    @torch.inference_mode()
    def select(self, rows: torch.Tensor) -> None:
        assert self.cache is not None
        self.cache.select(rows)
        self.cache.trim()

    @torch.inference_mode()
    def merge(self, other: Any, room: int) -> None:
        assert isinstance(other, LeanForward) and self.cache is not None and other.cache is not None
        self.cache = self.cache.join(other.cache, room)

    @torch.inference_mode()
    def row_kv(self, row: int) -> torch.Tensor:
        """A copy of the keys and values batch row ``row`` computed (prompt and fed tokens)."""
        assert self.cache is not None
        return self.cache.row_kv(row)

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, pos: torch.Tensor, plan: LoRABatch | None) -> torch.Tensor:
        assert self.cache is not None
        return self.lean.forward(self.cache, ids, pos, None, self._lora(plan), 1)[:, -1].float()


class LoRACache:
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
        self, policies: list[PolicyRef], weights: Weights, build: Callable[[], LoRABatch | None]
    ) -> LoRABatch | None:
        distinct = tuple(dict.fromkeys(policies))
        resolved = [weights[p] for p in distinct if p is not None]
        current = [(w, tuple(t._version for t in w.tensors())) for w in resolved if w is not None]
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
