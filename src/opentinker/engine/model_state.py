"""What an engine holds per model, split into what always stays in memory and what pages.

A model's **record** (:class:`AdapterRecord`: its id, LoRA config, step count, lineage) is small
and always resident. Its **state** (:class:`AdapterState`: weights, AdamW moments, accumulated
gradients) is what a :class:`~opentinker.engine.paging.PagedTable` may page out; the record
reaches it through the table, so code that reads ``record.weights`` pages it in when it is out.
A snapshot's frozen :class:`~opentinker.lora.LoRAWeights` page the same way (:class:`SnapshotCodec`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from opentinker.engine.optim import AdapterOptimizer
from opentinker.engine.paging import Buffers, PagedTable, PagingFull
from opentinker.engine.types import EngineError
from opentinker.lora import LoRAConfig, LoRAWeights, MultiLoRA
from opentinker.lora.adapter import TargetGroup


@dataclass
class AdapterState:
    weights: LoRAWeights  # flattened: every tensor a view of ``weights.flat``
    optimizer: AdapterOptimizer
    grads: torch.Tensor | None = None  # accumulated since the last step, flat (optimizer's order)


@dataclass
class AdapterRecord:
    adapter_id: str
    config: LoRAConfig
    table: PagedTable = field(repr=False)
    step: int = 0  # optimizer steps taken
    versions: int = 0  # snapshots taken
    parent: str | None = None  # checkpoint this adapter was loaded from
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def state(self) -> AdapterState:
        return self.table.get(self.adapter_id)

    def replace(self, weights: LoRAWeights, optimizer: AdapterOptimizer) -> None:
        """New weights and optimizer (no gradients), and the weights' config (of the same layout:
        its alpha may differ); the old state is not paged in to be dropped."""
        self.config = weights.config
        self.table.add(self.adapter_id, "adapter", AdapterState(weights, optimizer))

    @property
    def weights(self) -> LoRAWeights:
        return self.state.weights

    @property
    def optimizer(self) -> AdapterOptimizer:
        return self.state.optimizer

    @property
    def grads(self) -> torch.Tensor | None:
        return self.state.grads

    @grads.setter
    def grads(self, value: torch.Tensor | None) -> None:
        self.state.grads = value


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _flat(w: LoRAWeights) -> torch.Tensor:
    assert w.flat is not None, "a trainable adapter's weights are flattened"
    return w.flat


class AdapterCodec:
    """An :class:`AdapterState` as flat buffers: weights, moments and step (once it has stepped)
    and gradients (when it has some), each one contiguous buffer, bytes as they are."""

    def pack(self, obj: AdapterState) -> tuple[Buffers, dict[str, Any]]:
        out: Buffers = {"weights": _flat(obj.weights).detach()}
        out.update({k: v for k, v in obj.optimizer.state.items()})
        if obj.grads is not None:
            out["grads"] = obj.grads
        return out, {"config": obj.weights.config, "layout": obj.weights.layout()}

    def unpack(self, buffers: Buffers, meta: dict[str, Any]) -> AdapterState:
        weights = LoRAWeights.from_flat(
            meta["config"], buffers["weights"], meta["layout"], requires_grad=True
        )
        opt = AdapterOptimizer(weights)
        if "exp_avg" in buffers:
            opt.state = {k: buffers[k] for k in ("step", "exp_avg", "exp_avg_sq")}
        return AdapterState(weights, opt, buffers.get("grads"))

    def nbytes(self, obj: AdapterState) -> int:
        moments = sum(_nbytes(v) for v in obj.optimizer.state.values())
        return _nbytes(obj.weights.flat) + moments + _nbytes(obj.grads)


class SnapshotCodec:
    """A snapshot's frozen weights: one buffer when flattened (a live adapter's copy), else one per
    tensor; their uid comes back with them (the weights are the same, so caches keyed by it hold)."""

    def pack(self, obj: LoRAWeights) -> tuple[Buffers, dict[str, Any]]:
        meta: dict[str, Any] = {"config": obj.config, "uid": obj.uid}
        if obj.flat is not None:
            return {"flat": obj.flat.detach()}, {**meta, "layout": obj.layout()}
        tensors = obj.state_dict()
        return {k: v.detach() for k, v in tensors.items()}, {**meta, "order": list(tensors)}

    def unpack(self, buffers: Buffers, meta: dict[str, Any]) -> LoRAWeights:
        if "layout" in meta:
            return LoRAWeights.from_flat(
                meta["config"], buffers["flat"], meta["layout"], requires_grad=False, uid=meta["uid"]
            )
        out = LoRAWeights(meta["config"], uid=meta["uid"])
        for key in meta["order"]:  # the tensors in their first order (the file's is sorted)
            group, _, kind = key.rpartition(".")
            (out.a if kind == "lora_A" else out.b)[group] = buffers[key]
        return out

    def nbytes(self, obj: LoRAWeights) -> int:
        return obj.nbytes()


CODECS = {"adapter": AdapterCodec(), "snapshot": SnapshotCodec()}


def _paged(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run an engine method inside a scope of its paged table (``self.pages``): the models it uses
    stay resident while it runs, and the budget is fitted when it (or the tick around it) ends."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.pages.scope():
            return method(self, *args, **kwargs)

    return run


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def state_bytes(config: LoRAConfig, groups: dict[str, TargetGroup]) -> int:
    """The most memory one adapter of ``config`` holds: weights, gradients, two moments, step."""
    r = config.rank
    n = sum(
        math.prod(g.a_shape(r)) + math.prod(g.b_shape(r)) for g in groups.values() if config.trains(g.kind)
    )
    return 4 * n * 4 + 4  # fp32 each, and the optimizer's step count


def check_room(pages: PagedTable, need: int, rank: int, *, fit: bool = True) -> None:
    """Refuse an adapter whose state alone (``need`` bytes) exceeds the memory budget, or one that
    needs room while paged state cannot be written (:class:`PagingFull`); ``fit``: try the
    page-outs again first (the owner's thread only)."""
    budget = pages.budget
    if budget.limit is not None and need > budget.limit:
        raise EngineError(
            f"a model of rank {rank} holds {_mib(need)} of state (weights, gradients and AdamW "
            f"moments), more than the whole memory budget of {_mib(budget.limit)}; use a lower "
            "rank or a larger budget (--memory-budget)"
        )
    if fit and pages.full is not None and budget.over(need):
        pages.fit(kinds=None, room=need)  # a page-out may succeed again
    if pages.full is not None and budget.over(need):
        raise PagingFull(
            f"no new model can be made now: the disk under the page files is full ({pages.full}), "
            "so no model's state can be paged out; free disk space or delete models, and retry"
        )


def check_config(config: LoRAConfig, lora: MultiLoRA, max_rank: int) -> None:
    """Refuse a LoRA config this engine cannot train, naming why."""
    if not isinstance(config.rank, int) or not 1 <= config.rank <= max_rank:
        raise EngineError(f"LoRA rank must be an integer in [1, {max_rank}], got {config.rank!r}")
    if not (config.alpha > 0 and config.alpha < float("inf")):
        raise EngineError(f"LoRA alpha must be positive and finite, got {config.alpha!r}")
    if not (config.train_attn or config.train_mlp or config.train_unembed):
        raise EngineError("an adapter must train at least one of attention, MLP or unembedding")
    if config.train_mlp and lora.unknown_experts:
        raise EngineError(
            f"this model's experts have a layout the LoRA layers do not know: "
            f"{'; '.join(lora.unknown_experts[:2])}. Create the adapter with train_mlp=False "
            "(attention and unembedding are still trained)"
        )
    kinds = {g.kind for g in lora.groups.values()}
    if not any(config.trains(k) for k in kinds):
        raise EngineError(f"this model has no layers of the kinds the config trains (has {sorted(kinds)})")
