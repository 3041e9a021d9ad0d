"""The model side of the step-wise decoder: prefill a group of prompts, decode one token per row,
drop finished rows, and merge a newly prefilled group into the running batch.

Two implementations of one :class:`Forward` contract:

* :class:`LeanForward`: :class:`~opentinker.sampling.lean_model.LeanModel` over a static
  :class:`~opentinker.sampling.kv_cache.LeanCache` (the families it covers: Llama, Mistral,
  Qwen2, Qwen3, Gemma 3);
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
from opentinker.sampling.hf_cache import (
    KV_KINDS,
    NO_CACHE_KINDS,
    RECURRENT_KINDS,
    RowState,
    is_recurrent,
    is_windowed,
    load_states,
    merge_caches,
    new_cache,
    row_state,
    select_rows,
)
from opentinker.sampling.kv_cache import LeanCache
from opentinker.sampling.lean_lora import LeanLoRA
from opentinker.sampling.lean_model import LeanModel
from opentinker.sampling.prefix_cache import Prefix
from opentinker.sampling.vision import VisionRows, step_positions

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

    def row_kv(self, row: int) -> Prefix:
        """A copy of the state batch row ``row`` computed (its prompt and fed tokens, padding
        removed), for the prefix cache: the lean path's keys and values [layers, 2, kv_heads, n,
        head_dim], the HF path's :class:`~opentinker.sampling.hf_cache.RowState`."""
        ...

    def step(self, ids: torch.Tensor, pos: torch.Tensor, plan: LoRABatch | None) -> torch.Tensor:
        """fp32 logits [B, V] of one new token per row (``ids``, ``pos``: [B, 1])."""
        ...


def unsupported_cache_reason(model: Any) -> str | None:
    """Why the native sampler cannot hold ``model``'s decoding state (None: it can).

    Its HF path's cache holds one kind of state per layer (:mod:`opentinker.sampling.hf_cache`):
    keys and values of any widths (MLA's latent included), or a recurrent state (Gated DeltaNet,
    Mamba2). A layer of another kind (e.g. HF's "hybrid" layers, attention and a recurrent state in
    one) is refused with this reason instead of failing mid-decode; such a model still trains.
    """
    config: Any = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    family = str(getattr(config, "model_type", "this model"))
    known = KV_KINDS | RECURRENT_KINDS | NO_CACHE_KINDS
    for attr in ("layer_types", "layers_block_type"):
        kinds = {str(k) for k in (getattr(config, attr, None) or [])} - known
        if kinds:
            return (
                f"the native sampler cannot sample {family} yet: its {', '.join(sorted(kinds))} layers keep "
                "a state its cache does not hold"
            )
    return None


class HFForward:
    """The model's own HF forward with a ``DynamicCache``, LoRA through the engine's routing.

    **Left padding and recurrent layers.** HF zeroes a padded position's input to a Gated DeltaNet
    or Mamba2 layer (``apply_mask_to_padding_states``), which keeps a *fresh* state exactly zero
    through left padding only where no bias makes the zeroed input non-zero again (Qwen3.5's
    projections and conv have none; Mamba2's conv has one, masked again after the conv; an
    ``in_proj`` bias would leak). A prefill that *continues* a state (a cached or shared prefix)
    leaks either way: a padded position still decays the state (its gate is ``dt_bias``'s) and
    shifts the conv window. So on a model with a recurrent layer no prefill pads at all: rows are
    prefilled in groups of equal length, each group alone, and the groups joined like a running
    batch's newcomers (:meth:`merge`). A row's state then never sees a padded position, whatever
    HF does with them.

    **Sliding windows.** HF's window mask counts a key's distance in cache columns. A prefill that
    starts from a cached or shared prefix left-pads the new tokens *after* it, so a shorter row
    would have padding columns between its prefix and its new tokens, and its window would
    reach fewer positions than the model's. On a model with a window such a prefill also runs in
    groups of one length (no padding after the prefix; padding before it is harmless).
    """

    def __init__(self, engine: Engine, cache_kw: str, prefixes: list[RowState | None] | None = None) -> None:
        """``prefixes``: each row's cached state to start from (see :class:`LeanForward`)."""
        self.engine = engine
        self.model = engine.base.model
        self.cache_kw = cache_kw
        self.recurrent = is_recurrent(self.model)
        self.windowed = is_windowed(self.model)
        self.cache = new_cache(self.model)
        self.mask = torch.zeros(0)
        self.prefixes = prefixes
        # a VL model's rows: set before the prefill (sampling/vision.py); then each row's M-RoPE delta
        self.vision: VisionRows | None = None
        self.deltas: torch.Tensor | None = None

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
        start: tuple[DynamicCache, int] | None = None
        if shared is not None:  # the common prefix once, its state then copied to every row
            n, dev = len(shared.tokens), self.engine.device
            cache = new_cache(self.model)
            with self.engine.routing(shared.plan):
                self.model(
                    input_ids=torch.tensor([shared.tokens], device=dev),
                    position_ids=torch.arange(n, device=dev)[None],
                    use_cache=True,
                    logits_to_keep=1,
                    **{self.cache_kw: cache},
                )
            start = (cache, n)
        lens = mask.sum(1)
        gaps = self.windowed and (
            start is not None or (self.prefixes is not None and any(p is not None for p in self.prefixes))
        )
        if not (self.recurrent or gaps) or bool((lens == lens[0]).all()):
            return self._prefill(ids, mask, pos, want_prompt, plan, start, self.prefixes, self.vision)
        return self._prefill_by_length(ids, mask, pos, want_prompt, plan, start, lens)

    def _prefill(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        want_prompt: bool,
        plan: LoRABatch | None,
        start: tuple[DynamicCache, int] | None,
        prefixes: list[RowState | None] | None,
        vision: VisionRows | None = None,
    ) -> torch.Tensor:
        """Prefill every row into this forward's empty cache from ``start`` (a one-row cache of
        that many tokens, copied to every row) or ``prefixes``; ``vision``: the rows' images and
        M-RoPE positions (a VL model)."""
        rows = ids.shape[0]
        if start is not None:
            self.cache = select_rows(start[0], torch.zeros(rows, dtype=torch.long, device=ids.device))
            mask = torch.cat([mask.new_ones(rows, start[1]), mask], dim=1)
        elif prefixes is not None and any(p is not None for p in prefixes):
            mask = torch.cat([load_states(self.cache, prefixes).to(mask), mask], dim=1)
        kw = {"position_ids": pos} if vision is None else vision.kwargs(ids, pos)
        self.deltas = None if vision is None else vision.deltas.to(ids.device)
        with self.engine.routing(plan):
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=0 if want_prompt else 1,
                **kw,
                **{self.cache_kw: self.cache},
            )
        self.mask = mask
        return out.logits.float()

    def _prefill_by_length(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        want_prompt: bool,
        plan: LoRABatch | None,
        start: tuple[DynamicCache, int] | None,
        lens: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`_prefill` of each group of rows of one length alone (no padding), the groups then
        joined and put back in row order; logits right-aligned as a padded prefill's."""
        width, order, parts = ids.shape[1], [], []
        logits: torch.Tensor | None = None
        for n in sorted(set(lens.tolist())):
            idx = (lens == n).nonzero().squeeze(1)
            part = HFForward(self.engine, self.cache_kw)
            prefixes = None if self.prefixes is None else [self.prefixes[i] for i in idx.tolist()]
            sub = None if plan is None else plan.select(idx)
            cols = slice(width - n, width)
            vis = None if self.vision is None else self.vision.subset(idx)
            out = part._prefill(
                ids[idx, cols], mask[idx, cols], pos[idx, cols], want_prompt, sub, start, prefixes, vis
            )
            if logits is None:
                logits = out.new_zeros(ids.shape[0], width if want_prompt else 1, out.shape[-1])
            logits[idx, logits.shape[1] - out.shape[1] :] = out
            order += idx.tolist()
            parts.append(part)
        self.cache, self.mask, self.deltas = parts[0].cache, parts[0].mask, parts[0].deltas
        for part in parts[1:]:
            self.merge(part, 0)
        self.select(torch.tensor(order, device=ids.device).argsort())
        assert logits is not None
        return logits

    def select(self, rows: torch.Tensor) -> None:
        self.cache = select_rows(self.cache, rows)
        self.mask = self.mask[rows]
        self.deltas = None if self.deltas is None else self.deltas[rows]

    def merge(self, other: Any, room: int) -> None:
        assert isinstance(other, HFForward)
        width = max(self.mask.shape[1], other.mask.shape[1])
        self.cache = merge_caches(self.cache, other.cache, width)
        if self.deltas is not None or other.deltas is not None:
            mine, theirs = (
                f.deltas if f.deltas is not None else f.mask.new_zeros(f.mask.shape[0]) for f in (self, other)
            )
            self.deltas = torch.cat([mine, theirs])
        self.mask = torch.cat([_left_pad(self.mask, width), _left_pad(other.mask, width)])

    def row_kv(self, row: int) -> RowState:
        return row_state(self.cache, row, self.mask[row].nonzero().squeeze(1))

    def step(self, ids: torch.Tensor, pos: torch.Tensor, plan: LoRABatch | None) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(ids.shape[0], 1)], dim=1)
        with self.engine.routing(plan):
            out = self.model(
                input_ids=ids,
                attention_mask=self.mask,
                position_ids=pos if self.deltas is None else step_positions(pos, self.deltas),
                use_cache=True,
                **{self.cache_kw: self.cache},
            )
        return out.logits[:, -1].float()


def _left_pad(mask: torch.Tensor, width: int) -> torch.Tensor:
    """``mask`` [B, T] with zero columns prepended up to ``width``."""
    if mask.shape[1] == width:
        return mask
    return torch.cat([mask.new_zeros(mask.shape[0], width - mask.shape[1]), mask], dim=1)


class LeanForward:
    """:class:`LeanModel` over a static :class:`LeanCache` (``prompt_cols`` prompt columns, up to
    ``decode_cols`` decode columns, ``first_cols`` of them allocated at first, then doubled as
    needed). Runs in inference mode (less bookkeeping per op than ``no_grad``); the logits it
    returns are inference tensors."""

    def __init__(
        self,
        engine: Engine,
        lean: LeanModel,
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
