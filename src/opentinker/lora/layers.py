"""Multi-LoRA layers: each row of a batch may use a different adapter, of any rank.

Semantics of a wrapped projection, for every row ``i`` of the batch::

    y[i] = base(x[i]) + scale[e] * (x[i] @ A[e][layer].T) @ B[e][layer].T      with e = row_index[i]

where ``entries`` (index ``e``) are the distinct adapters or snapshots of this batch (``None`` = bare
base model: no delta). Rows are never reordered; how the delta is computed depends on the *runs* of
the batch (maximal stretches of consecutive rows on one entry — a request's rows, a prompt's
samples):

* one run (every row on one entry): two plain matmuls;
* runs of equal length ``n``: the rows viewed as ``[runs, n·T, in]`` and two batched matmuls with one
  A and B per run (no per-row copy of the weights, and backward scatters nothing per row);
* a few runs of unequal lengths (≤ ``MAX_SPLIT_RUNS``): two plain matmuls per run on a split;
* otherwise one gather of each row's A and B plus two batched matmuls, so the cost of a forward
  does not depend on how many distinct adapters it mixes.

Adapters that do not share a rank are zero-padded to the batch's largest rank when stacked; padding
only ever appears in the per-batch stack (gradients of the padding are dropped), never in storage.

Adapter ids are not known here: the engine maps ids to entries for each batch, so ids stay stable
while entry positions are reused batch to batch.
"""

from __future__ import annotations

import copy
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opentinker.lora.adapter import LoRAWeights, TargetGroup
from opentinker.lora.experts import (
    EXPERT_PARAMS,
    expert_dims,
    experts_forward,
    has_3d_parameters,
    is_known_experts,
)

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_of(path: str) -> int | None:
    """The model layer a module path names (``model.layers.3.mlp.up_proj`` -> 3), or None."""
    m = _LAYER_INDEX.search(f".{path}.")
    return None if m is None else int(m.group(1))


# routers and gates that pick or weigh experts: never adapted (see opentinker.lora.experts)
ROUTERS = frozenset({"gate", "router", "shared_expert_gate"})
# stacks of experts pairs kept between forwards (a trainer's and a sampler's batches alternate),
# over all experts groups: each is K adapters' expert LoRA weights of one group, so this bounds
# the memory they hold
STACKS_KEPT = 8
MAX_SPLIT_RUNS = 8  # beyond this many unequal runs, per-row gathers beat a Python loop of matmuls


class LoRABatch:
    """Routing for one forward: the batch's entries stacked per group, and each row's entry index."""

    def __init__(
        self,
        entries: list[LoRAWeights | None],
        row_index: torch.Tensor,
        groups: dict[str, TargetGroup],
        stacks: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] | None = None,
        tied: str | None = None,
    ) -> None:
        self.entries = entries
        # the unembedding's group when its matrix is the input embedding too (tied): its LoRA
        # then acts in both roles (:meth:`embedding_delta`)
        self.tied = tied
        # experts groups, (expert, entry)-major: A [L, E, K, r_max, in], B^T [L, E, K, r_max, out]
        self.a: dict[str, torch.Tensor] = {}  # group -> [K, L, r_max, in]
        self.b: dict[str, torch.Tensor] = {}  # group -> [K, L, out, r_max]
        self.scale: dict[str, torch.Tensor] = {}  # group -> [K]
        # group -> each layer's [K, r_max, in] and [K, out, r_max]: views of the stacks, taken in
        # one unbind so that backward assembles each stack's gradient once, not once per layer
        self.layers: dict[str, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
        for name, group in groups.items():
            present = [e for e in entries if e is not None and name in e.a]
            if not present:
                continue
            r_max = max(e.rank for e in present)
            if group.experts:  # zero ranks up to a multiple of 8: grouped_mm's 16-byte strides
                r_max += -r_max % 8
            ref = present[0].a[name]
            a_list, b_list, scales = [], [], []
            for e in entries:
                if e is None or name not in e.a:
                    a_list.append(ref.new_zeros(group.a_shape(r_max)))
                    b_list.append(ref.new_zeros(group.b_shape(r_max)))
                    scales.append(0.0)
                    continue
                pad = r_max - e.rank
                a_list.append(F.pad(e.a[name], (0, 0, 0, pad)) if pad else e.a[name])
                b_list.append(F.pad(e.b[name], (0, pad)) if pad else e.b[name])
                scales.append(e.scale)
            if group.experts:  # [L, E, K, ...]: each layer's (expert, entry) pairs already in order
                self.a[name], self.b[name] = _stack_experts(entries, name, a_list, b_list, stacks)
                self.layers[name] = (self.a[name].unbind(0), self.b[name].unbind(0))
            else:
                self.a[name], self.b[name] = torch.stack(a_list), torch.stack(b_list)
                self.layers[name] = (self.a[name].unbind(1), self.b[name].unbind(1))
            self.scale[name] = torch.tensor(scales, dtype=ref.dtype, device=ref.device)
        self._set_rows(row_index)

    def _set_rows(self, row_index: torch.Tensor) -> None:
        self._cache: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}
        self.row_index = row_index  # [B] int64, values in [0, K)
        runs: list[list[int]] = []  # [entry, length] of each maximal run of consecutive rows
        for e in row_index.tolist():
            if runs and runs[-1][0] == e:
                runs[-1][1] += 1
            else:
                runs.append([e, 1])
        # every row on one entry: plain matmuls, no per-row gather
        self.single: int | None = (runs[0][0] if runs else 0) if len(runs) <= 1 else None
        lengths = [n for _, n in runs]
        equal = self.single is None and len(set(lengths)) == 1
        self.run_len: int | None = lengths[0] if equal else None
        self.split: list[int] | None = None
        if self.single is None and not equal and len(runs) <= MAX_SPLIT_RUNS:
            self.split = lengths
        # whose A/B each batched slot uses: one slot per run, or (many unequal runs) per row
        per_run = self.run_len is not None or self.split is not None
        slots = [e for e, _ in runs] if per_run else row_index.tolist()
        # slot k on entry k: the stacked weights serve as they are (no gather, no scatter back)
        self.slots: torch.Tensor | None = (
            None if slots == list(range(len(self.entries))) else row_index.new_tensor(slots)
        )

    def select(self, rows: torch.Tensor) -> LoRABatch:
        """The same stacked adapters for a subset of rows (decoding drops finished rows)."""
        return self.with_rows(self.row_index[rows])

    def with_rows(self, row_index: torch.Tensor) -> LoRABatch:
        """The same stacked adapters for other rows (``row_index``: [B] entry of each row)."""
        sub = copy.copy(self)
        sub._set_rows(row_index)
        return sub

    def delta(self, group: str, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """The LoRA term for ``x`` ([B, T, in] or [B·T, in]) at ``layer`` of ``group``, or None if no entry has it."""
        if group not in self.a:
            return None
        a_t, b_t = self._weights(group, layer, x.dtype)
        if self.single is not None:  # one entry for every row: plain matmuls (shrink as in _shrink)
            return (a_t.T @ x.transpose(-1, -2)).transpose(-1, -2) @ b_t
        shape, rows = x.shape, self.row_index.numel()
        # [B, T, in]; also when a layer calls its projection on the rows flattened to [B·T, in]
        # (the shared experts of a MoE block), which keeps the tokens row-major
        x3 = x.reshape(rows, -1, shape[-1])
        if self.split is not None:  # a few unequal runs: plain matmuls per run
            parts = torch.split(x3, self.split)
            out = torch.cat([(p @ a_t[k]) @ b_t[k] for k, p in enumerate(parts)])
        elif self.run_len is not None:  # equal runs: one batched matmul pair, slots = runs
            n = self.run_len
            xr = x3.reshape(rows // n, n * x3.shape[1], shape[-1])  # [R, n·T, in]
            out = torch.bmm(_shrink(xr, a_t), b_t).reshape(rows, x3.shape[1], -1)
        else:
            out = torch.bmm(_shrink(x3, a_t), b_t)
        return out.reshape(*shape[:-1], -1)

    def embedding_delta(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """The tied unembedding's LoRA as the input embedding sees it: row ``ids`` of the shared
        matrix's delta ``scale·B A`` ([V, r] by [r, H]), for each row's entry; ``ids`` [B, T] or
        [B]. None when the matrix is not shared or no entry trains it. The lookup gathers rows
        of B, never the [V, H] delta."""
        if self.tied is None or self.tied not in self.a:
            return None
        a_layers, b_layers = self.layers[self.tied]
        a, b, scale = a_layers[0], b_layers[0], self.scale[self.tied]  # [K, r, H], [K, V, r], [K]
        if self.single is not None:
            e = self.single
            return ((b[e][ids] * scale[e]) @ a[e]).to(dtype)
        rows = self.row_index
        ids2 = ids.reshape(rows.numel(), -1)  # [B, T]
        picked = b[rows[:, None], ids2] * scale[rows][:, None, None]  # [B, T, r]
        return torch.bmm(picked, a[rows]).reshape(*ids.shape, -1).to(dtype)

    def expert_weights(
        self, group: str, layer: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """An experts group's pairs at ``layer`` for grouped matmuls over (expert, entry) segments,
        expert-major: A [E·K, r, in], B^T [E·K, r, out], and each entry's scale [K]. Cached
        without autograd, like :meth:`_weights`."""
        key = (group, -1 - layer)
        hit = self._cache.get(key)
        if hit is not None:
            return hit[0], hit[1], hit[2]
        a_layers, b_layers = self.layers[group]
        a, b = a_layers[layer], b_layers[layer]  # [E, K, r, in], [E, K, r, out]: views, no copy
        a_e = a.reshape(-1, *a.shape[2:]).to(dtype)
        b_t = b.reshape(-1, *b.shape[2:]).to(dtype)
        out = (a_e, b_t, self.scale[group].to(dtype))
        if not torch.is_grad_enabled():
            self._cache[key] = out
        return out

    def _weights(self, group: str, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A^T, scale·B^T) for this layer: [in, r], [r, out] if one entry serves every row, else one
        per batched slot (a run, or a row) [S, in, r], [S, r, out]. Without autograd (sampling) they
        are cached for the life of this routing plan, so decode steps after the first gather nothing."""
        key = (group, layer)
        hit = self._cache.get(key)
        if hit is not None:
            return hit[0], hit[1]
        a_layers, b_layers = self.layers[group]
        a, b, scale = a_layers[layer], b_layers[layer], self.scale[group]
        if self.single is not None:
            e = self.single
            out = (a[e].T.to(dtype), (b[e].T * scale[e]).to(dtype))
        else:
            if self.slots is not None:
                a, b, scale = a[self.slots], b[self.slots], scale[self.slots]
            a_s = a.transpose(1, 2)  # [S, in, r], a view
            # [S, r, out] contiguous: the expand's backward (dy B, r columns) runs 2x faster by it
            b_s = (b * scale[:, None, None]).transpose(1, 2).contiguous()
            out = (a_s.to(dtype), b_s.to(dtype))
        if not torch.is_grad_enabled():
            self._cache[key] = out
        return out


def _shrink(x: torch.Tensor, a_t: torch.Tensor) -> torch.Tensor:
    """``bmm(x, a_t)`` ([S, n, in] by [S, in, r], ``a_t`` a transposed view of a contiguous A),
    computed as ``(A x^T)^T``: on CPU this and its backward (A's gradient ``dh^T x``) run 2-3x
    faster than the r-column products of ``bmm(x, a_t)`` and its ``x^T dh``. The result is made
    contiguous (r columns, a small copy): the expand by B runs 2x slower from the transposed view."""
    return torch.bmm(a_t.transpose(1, 2), x.transpose(1, 2)).transpose(1, 2).contiguous()


def _stack_experts(
    entries: list[LoRAWeights | None],
    name: str,
    a_list: list[torch.Tensor],
    b_list: list[torch.Tensor],
    stacks: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An experts group's K pairs stacked (expert, entry)-major, A [L, E, K, r, in] as stored and B
    transposed, B^T [L, E, K, r, out] (the layouts :data:`~opentinker.lora.experts.ExpertPairs`
    names): each layer's [E·K, r, in] is then one contiguous tensor, for grouped matmuls and for
    fast row gathers (``index_select``) alike, and the stack is one copy of whole per-expert blocks,
    not a strided concatenation (A's a plain copy, its gradient's way back too). Without autograd the stack is kept in
    ``stacks`` (the last STACKS_KEPT) for a later batch on the same weights (each entry's uid and
    its tensors' version counters, which an optimizer step or a load bumps), so repeated forwards
    on one set of adapters stack nothing."""
    tensors = [*a_list, *b_list]
    cacheable = stacks is not None and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
    versions = [
        None if e is None or name not in e.a else (e.uid, e.a[name]._version, e.b[name]._version)
        for e in entries
    ]
    key = (name, *versions, *(t.shape for t in tensors))
    if cacheable and stacks is not None and (hit := stacks.pop(key, None)) is not None:
        stacks[key] = hit  # the most recently used last
        return hit
    a = torch.stack(a_list, 2)  # [L, E, K, r, in]
    b = torch.stack([t.transpose(-1, -2) for t in b_list], 2)  # one copy, transposing on the way
    if cacheable and stacks is not None:
        stacks[key] = (a, b)
        for old in list(stacks)[: max(0, len(stacks) - STACKS_KEPT)]:
            stacks.pop(old, None)
    return a, b


class MultiLoRALinear(nn.Module):
    """A frozen base projection (``nn.Linear`` or GPT-2 ``Conv1D``) plus the current batch's LoRA."""

    def __init__(self, base: nn.Module, owner: MultiLoRA, group: str, layer: int) -> None:
        super().__init__()
        self.base = base
        self.group = group
        self.layer = layer
        # A plain attribute, not a submodule: the owner is not part of the model's module tree.
        object.__setattr__(self, "_owner", owner)

    @property
    def weight(self) -> torch.Tensor:  # some HF code (tied embeddings, dtype checks) reads .weight
        return self.base.weight  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() > 2 and not x.is_contiguous():  # e.g. HF's hidden_states[:, -k:] into lm_head:
            x = x.contiguous()  # torch's CPU matmul would copy the weight once per row instead
        y = self.base(x)
        batch: LoRABatch | None = self._owner.batch  # type: ignore[attr-defined]
        if batch is None:
            return y
        d = batch.delta(self.group, self.layer, x)
        return y if d is None else y + d


class MultiLoRAExperts(nn.Module):
    """A frozen routed-experts module plus the current batch's LoRA on each of its experts
    (semantics: :mod:`opentinker.lora.experts`).

    ``groups`` maps each of its fused parameters to the target group holding its LoRA pairs and
    this module's layer within that group.
    """

    def __init__(self, base: nn.Module, owner: MultiLoRA, groups: dict[str, tuple[str, int]]) -> None:
        super().__init__()
        self.base = base
        self.groups = groups
        object.__setattr__(self, "_owner", owner)  # not a submodule: outside the model's tree

    @property
    def num_experts(self) -> int:  # read by some MoE blocks
        return int(self.base.num_experts)  # type: ignore[arg-type]

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> Any:
        batch: LoRABatch | None = self._owner.batch  # type: ignore[attr-defined]
        if batch is None or not any(g in batch.a for g, _ in self.groups.values()):
            return self.base(hidden_states, top_k_index, top_k_weights)

        def pair(param: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
            group, layer = self.groups.get(param, ("", 0))
            return batch.expert_weights(group, layer, dtype) if group in batch.a else None

        n_tok, rows = hidden_states.shape[0], batch.row_index.numel()
        if n_tok % rows:
            raise RuntimeError(f"MoE layer got {n_tok} tokens for a batch of {rows} rows")
        entry = batch.row_index.repeat_interleave(n_tok // rows)  # [T] each token's entry (rows row-major)
        return experts_forward(
            self.base, hidden_states, top_k_index, top_k_weights, entry, len(batch.entries), pair
        )


def _fused_away(path: str, owner: str) -> bool:
    """A projection whose weight a fused kernel reads directly, bypassing its module (so a LoRA
    there would be dropped silently on that path): a Mamba mixer's ``out_proj`` (the CUDA kernels'
    ``mamba_inner_fn`` takes ``out_proj.weight``); PEFT refuses it on Mamba models for that reason."""
    return "mamba" in owner.lower() and path.rpartition(".")[2] == "out_proj"


def _kind_of(path: str, is_unembed: bool, owner: str = "") -> str | None:
    """``attn`` (sequence mixing: attention, linear attention, Mamba), ``mlp`` or ``unembed``, from
    the module's path, or else from the class of the block holding it (Nemotron-H names every
    block's layer ``mixer``: a ``NemotronHMamba2Mixer``, ``NemotronHAttention`` or ``NemotronHMLP``)."""
    if is_unembed:
        return "unembed"
    parts = path.lower().split(".")
    if any("attn" in p or "attention" in p for p in parts):
        return "attn"
    if any(p in ("mlp", "feed_forward", "ffn") or "mlp" in p for p in parts):
        return "mlp"
    owner = owner.lower()
    if any(w in owner for w in ("attention", "mamba", "deltanet")):
        return "attn"
    if any(w in owner for w in ("mlp", "moe", "experts")):
        return "mlp"
    return None


# a VL model's vision tower and projector: frozen, never a LoRA target (LoRA is the language model's)
VISION_MODULES = ("visual", "vision_tower", "vision_model", "multi_modal_projector")


def _in_vision(path: str) -> bool:
    return any(part in VISION_MODULES for part in path.split("."))


def _dims(module: nn.Module) -> tuple[int, int, bool] | None:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    if type(module).__name__ == "Conv1D":  # transformers.pytorch_utils.Conv1D (GPT-2)
        w: torch.Tensor = module.weight  # type: ignore[assignment]
        return int(w.shape[0]), int(w.shape[1]), True
    return None


class MultiLoRA:
    """Wraps a model's attention, MLP and unembedding projections with :class:`MultiLoRALinear`.

    The model is changed in place; ``batch`` is the routing every wrapped layer reads during a
    forward (set it with :meth:`use`). ``groups`` describes every wrapped projection kind.

    ``batch`` is per thread: the training scheduler's forward and the sampling loop's (on its own
    thread, over the same shared base model) each see only the routing they set.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._local = threading.local()
        # expert modules of a layout this layer does not know (module path, class, 3-D shapes):
        # an adapter that trains the MLP is refused on such a model, never silently partial
        self.unknown_experts: list[str] = []
        # the last STACKS_KEPT stacks of experts pairs made without autograd (see _stack_experts),
        # least recently used first; never stale (keyed by the weights' versions)
        self._expert_stacks: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        shared = out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight
        found: dict[str, list[_Site]] = {}
        for path, module in list(model.named_modules()):
            parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
            kind = _kind_of(path, module is out_emb, type(parent).__name__)
            if kind is not None and not _fused_away(path, type(parent).__name__) and not _in_vision(path):
                for site in self._sites(path, module, kind):
                    found.setdefault(site.name, []).append(site)
        self.groups: dict[str, TargetGroup] = {}
        experts: dict[str, dict[str, tuple[str, int]]] = {}  # module path -> param -> (group, layer)
        for name, sites in sorted(found.items()):
            sites.sort(key=lambda t: t.layer)
            parts: dict[tuple[int, int, bool, int], list[_Site]] = {}
            for site in sites:
                parts.setdefault((site.d_in, site.d_out, site.fifo, site.experts), []).append(site)
            for part in parts.values():
                group = name if len(parts) == 1 else f"{name}@{part[0].layer}"
                first = part[0]
                self.groups[group] = TargetGroup(
                    group, first.kind, first.d_in, first.d_out, tuple(t.path for t in part), first.fifo,
                    first.experts, first.param,
                )  # fmt: skip
                for pos, site in enumerate(part):
                    if site.experts:
                        experts.setdefault(site.path.rpartition(".")[0], {})[site.param] = (group, pos)
                    else:
                        _replace_module(model, site.path, MultiLoRALinear(site.module, self, group, pos))
        for path, params in experts.items():
            _replace_module(model, path, MultiLoRAExperts(model.get_submodule(path), self, params))
        # tied embeddings: one matrix, one meaning. The unembedding's LoRA is a delta of the shared
        # matrix, so the input embedding gets it too, as a merge into that matrix (hosted
        # Tinker's converters, ``export_merged``) gives (docs/DESIGN.md, "Tied embeddings")
        unembed = [n for n, g in self.groups.items() if g.kind == "unembed"]
        self.tied: str | None = unembed[0] if shared and len(unembed) == 1 else None
        # the input embedding's module path (for exports), when it shares the unembedding's LoRA
        self.tied_embedding: str | None = None
        if self.tied is not None and in_emb is not None:
            self.tied_embedding = next(p for p, m in model.named_modules() if m is in_emb)
            in_emb.register_forward_hook(self._embedding_hook)

    def _embedding_hook(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        batch = self.batch
        if batch is None or not args:
            return out
        d = batch.embedding_delta(args[0], out.dtype)
        if d is None:
            return out
        scale = getattr(module, "embed_scale", None)  # Gemma's scaled embedding scales the lookup
        return out + (d if scale is None else d * scale.to(d.dtype))

    def _sites(self, path: str, module: nn.Module, kind: str) -> list[_Site]:
        """The LoRA targets ``module`` offers: itself (a projection), or its fused expert parameters
        (one site each, its ``path`` being ``<module>.<param>``)."""
        m = _LAYER_INDEX.search(f".{path}.")
        name, layer = (path, 0) if kind == "unembed" or m is None else (path[m.end() - 1 :], int(m.group(1)))
        dims = _dims(module)
        if dims is not None:
            if path.rpartition(".")[2] in ROUTERS:
                return []
            return [_Site(name, layer, path, module, *dims, kind)]
        if is_known_experts(module):
            params = [p for p in EXPERT_PARAMS if isinstance(getattr(module, p, None), nn.Parameter)]
            return [
                _Site(f"{name}.{p}", layer, f"{path}.{p}", module, *expert_dims(module, p)[1:], False, kind,
                      expert_dims(module, p)[0], p)
                for p in params
            ]  # fmt: skip
        shapes = has_3d_parameters(module)
        if shapes and kind == "mlp":
            self.unknown_experts.append(f"{path} ({type(module).__name__}: {shapes})")
        return []

    @property
    def batch(self) -> LoRABatch | None:
        """The routing of the forward this thread is running (None: the bare base model)."""
        return getattr(self._local, "batch", None)

    @batch.setter
    def batch(self, batch: LoRABatch | None) -> None:
        self._local.batch = batch

    @classmethod
    def attach(cls, model: nn.Module) -> MultiLoRA:
        """Wrap ``model`` once; later calls return the same wrapper (engines may share a base)."""
        existing = getattr(model, "_opentinker_lora", None)
        if isinstance(existing, MultiLoRA):
            return existing
        wrapper = cls(model)
        object.__setattr__(model, "_opentinker_lora", wrapper)
        return wrapper

    @contextmanager
    def use(self, batch: LoRABatch | None) -> Iterator[None]:
        """Route the wrapped layers through ``batch`` for the duration of the block."""
        previous, self.batch = self.batch, batch
        try:
            yield
        finally:
            self.batch = previous

    def make_batch(self, entries: list[LoRAWeights | None], row_index: torch.Tensor) -> LoRABatch | None:
        if all(e is None for e in entries):
            return None
        return LoRABatch(entries, row_index, self.groups, self._expert_stacks, self.tied)


@dataclass
class _Site:
    """One LoRA target found in the model: a projection, or one fused parameter of an experts module."""

    name: str  # the path after the layer index: the target group's name
    layer: int
    path: str
    module: nn.Module
    d_in: int
    d_out: int
    fifo: bool
    kind: str
    experts: int = 0
    param: str = ""


def _replace_module(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, attr, new)
