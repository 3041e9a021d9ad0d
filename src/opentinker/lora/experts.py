"""Multi-LoRA on the routed experts of a mixture-of-experts layer.

In transformers 5 the routed experts of every MoE family (Qwen3-MoE, Qwen3.5-MoE, Mixtral, OLMoE,
GLM-4 MoE, DeepSeek V3, gpt-oss, ...) are one module holding fused 3-D parameters, called as
``experts(x [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``:

    gate_up_proj [E, 2I, H] (or up_proj [E, I, H])      down_proj [E, H, I]
    ([E, in, out] instead when the module says ``is_transposed``; biases [E, out] with ``has_bias``)

Each adapter holds, per expert projection and layer, one rank-r pair per expert::

    A: [L, E, r, in]     B: [L, E, out, r]

Semantics, for a token ``t`` on adapter ``a`` routed to experts ``e_1..e_k`` with router weights
``w_1..w_k`` (the router is the base model's, unchanged)::

    h_j  = act(W_gu[e_j] x_t + b_gu[e_j] + s_a · B_gu[a, e_j] A_gu[a, e_j] x_t)     (gate ⊙ up)
    y_t  = Σ_j w_j · (W_d[e_j] h_j + b_d[e_j] + s_a · B_d[a, e_j] A_d[a, e_j] h_j)

that is, each routed expert's own delta, inside the expert (before its activation for gate/up) and
weighted by the router exactly as the base expert's output is. This is what merging ``s·B_e A_e``
into each expert's weights gives, so PEFT's ``target_parameters`` and a merged model agree with it.

The router is not adapted: it only picks the top-k experts, a discontinuous choice with no useful
gradient at its switching points, and adapting it shifts load between experts that were trained
balanced; Tinker's ``train_mlp`` and vLLM's MoE LoRA adapt the experts alone. Its auxiliary
load-balancing loss is not added either (``output_router_logits`` is ignored): with the router
frozen it has no parameter to act on.

Compute, for a batch mixing K entries: every (token, expert) assignment is sorted by
(expert, entry). The base projections run as one grouped matmul over the E expert segments, the
LoRA terms as two grouped matmuls over the E·K (expert, entry) segments (``torch.nn.functional.
grouped_mm``), the segments worked out once per layer for both projections, so no Python loop runs
over experts, adapters or tokens, whatever K is. On CPU ``grouped_mm`` runs one ``mm`` per segment
(~2 µs each, most of what mixing K adapters adds): where many segments are empty (many adapters,
skewed routing) only the others are visited. When the rows are few beside the E·K segments (a
decode step), each row gathers its own expert's pair for two batched matmuls instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# a fused parameter's LoRA for this forward, expert-major over the batch's K entries:
# (A [E·K, r, in], B^T [E·K, r, out], each entry's scale [K]), or None if no entry trains it.
# A keeps its own layout: a grouped matmul by A^T as a transposed view of it runs the shrink
# (``x A^T``, r columns) about 2x faster on CPU than by a contiguous A^T, and its backward as fast;
# B^T contiguous is the faster one for the expand's backward (``dy B``, r columns)
ExpertPairs = Callable[[str, torch.dtype], "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None"]

# the fused expert parameters a LoRA pair goes on, in the order the forward uses them
EXPERT_PARAMS = ("gate_up_proj", "up_proj", "down_proj")
# below one row per GATHER_BELOW (expert, adapter) segments (a decode step's few rows over E·K
# segments), each row gathers its own pair (one ``index_select`` of contiguous [r, in] blocks) for
# two batched matmuls, instead of a grouped matmul that visits every segment, most of them empty.
# With more rows the grouped matmul wins on CPU time, also at E·K = 512 segments of ~4 rows (the
# MoE benchmark's mixed forward), as did ``bmm`` over zero-padded tiles of each segment's rows
GATHER_BELOW = 2
# with over 1/SKIP_EMPTY_ABOVE of the (expert, adapter) segments empty (many adapters, skewed
# routing), the grouped matmuls visit only the others: a gather of their pairs costs less than the
# per-segment calls (one ``mm`` each on CPU, 4 a layer forward and 8 more backward) it saves
SKIP_EMPTY_ABOVE = 4
# what transformers' ``use_experts_implementation`` sets on every experts class it knows
_EXPERTS_ATTRS = ("has_gate", "has_bias", "is_transposed", "num_experts")


def is_known_experts(module: nn.Module) -> bool:
    """An experts module whose layout (fused 3-D parameters, flags) this layer implements."""
    if not all(hasattr(module, a) for a in _EXPERTS_ATTRS):
        return False
    if getattr(module, "is_concatenated", True) is False and not hasattr(type(module), "_apply_gate"):
        return False
    params = dict(module.named_parameters(recurse=False))
    proj = "gate_up_proj" if module.has_gate else "up_proj"
    return all(p in params and params[p].dim() == 3 for p in (proj, "down_proj"))


def has_3d_parameters(module: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """The 3-D parameters directly on ``module`` (expert weights of a layout we may not know)."""
    return [(n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False) if p.dim() == 3]


def expert_dims(module: nn.Module, param: str) -> tuple[int, int, int]:
    """(experts, in, out) of one fused expert parameter."""
    e, d1, d2 = getattr(module, param).shape
    return (int(e), int(d1), int(d2)) if module.is_transposed else (int(e), int(d2), int(d1))


def grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x`` [N, in] (rows sorted by group, ``offs`` the groups' ends) times its group's ``w``
    [G, in, out], as one ``grouped_mm``; where its kernels' 16-byte stride alignment does not
    hold, one matmul per non-empty group (5x slower on this CPU for 512 groups of 4 rows)."""
    x = x.to(w.dtype)
    size = x.element_size()
    if all(s == 1 or (s * size) % 16 == 0 for s in (*x.stride(), *w.stride())):
        return F.grouped_mm(x, w, offs=offs)
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    parts = [p @ w[g] for g, p in enumerate(torch.split(x, counts)) if p.shape[0]]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[2])


def _linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Rows of ``x`` (sorted by expert, ``offs`` the segments' ends) through their expert's ``w``."""
    return grouped(x, w if transposed else w.transpose(1, 2), offs)  # w: [E, in, out]


def _offsets(key: torch.Tensor, groups: int) -> torch.Tensor:
    return torch.bincount(key, minlength=groups).cumsum(0).to(torch.int32)


class _Segments:
    """Where one MoE layer's assignments, sorted by (expert, entry) segment, meet their LoRA pairs:
    worked out once per layer call and shared by its projections (gate/up, then down). With few
    rows beside the E·K segments (decoding) each row gathers its own pair; otherwise one grouped
    matmul runs over the segments."""

    def __init__(self, key_sorted: torch.Tensor, entry_sorted: torch.Tensor, n_seg: int) -> None:
        self.key, self.entry = key_sorted, entry_sorted
        self.offs: torch.Tensor | None = None  # the grouped matmul's segment ends
        self.used: torch.Tensor | None = None  # the segments it visits, if not all of them
        if key_sorted.numel() * GATHER_BELOW >= n_seg:
            counts = torch.bincount(key_sorted, minlength=n_seg)
            used = counts.nonzero().squeeze(1)
            if (n_seg - used.numel()) * SKIP_EMPTY_ABOVE > n_seg:
                self.used, counts = used, counts[used]
            self.offs = counts.cumsum(0).to(torch.int32)

    def lora(
        self, inp: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:
        """Each row's ``scale · B A x`` [N, out] with its segment's pair:
        ``b_t`` [S, r, out] (segment ``e·K + entry``), ``scale`` [K] per entry; ``a`` [S, r, in]."""
        x = inp.to(a.dtype)
        if self.offs is None:  # each row with its own pair
            a_rows, b_rows = a.index_select(0, self.key), b_t.index_select(0, self.key)
            h = torch.bmm(x[:, None, :], a_rows.transpose(1, 2)) * scale[self.entry, None, None]
            return torch.bmm(h, b_rows).squeeze(1)
        if self.used is not None:  # only the segments with rows
            a, b_t = a.index_select(0, self.used), b_t.index_select(0, self.used)
        a_t = a.transpose(1, 2)  # [S, in, r], a view
        if (a.shape[2] * a.element_size()) % 16:  # its stride breaks grouped_mm's alignment
            a_t = a_t.contiguous()
        return grouped(grouped(x, a_t, self.offs) * scale[self.entry, None], b_t, self.offs)


def experts_forward(
    base: Any,  # the experts module (transformers' layout: see the module docstring)
    x: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
    entry_t: torch.Tensor,  # [T] each token's entry among the batch's K
    n_ent: int,
    pairs: ExpertPairs,
) -> torch.Tensor:
    """The experts' output [T, H] with each assignment's own expert delta (module docstring)."""
    n_tok, k = top_k_index.shape
    n_exp = int(base.num_experts)
    expert = top_k_index.reshape(-1)  # [N = T·k] each assignment's expert
    key = expert * n_ent + entry_t.repeat_interleave(k)  # sorting by it sorts by expert first
    key_sorted, perm = torch.sort(key, stable=True)
    expert_sorted = key_sorted // n_ent
    offs_e = _offsets(expert, n_exp)
    segments = _Segments(key_sorted, key_sorted % n_ent, n_exp * n_ent)

    def project(inp: torch.Tensor, param: str) -> torch.Tensor:
        out = _linear(inp, getattr(base, param), offs_e, base.is_transposed)
        if base.has_bias:
            out = out + getattr(base, f"{param}_bias")[expert_sorted]
        pair = pairs(param, out.dtype)
        return out if pair is None else out + segments.lora(inp, *pair)

    h = project(x[perm // k], "gate_up_proj" if base.has_gate else "up_proj")
    h = base._apply_gate(h) if base.has_gate else base.act_fn(h)
    out = project(h, "down_proj") * top_k_weights.reshape(-1)[perm, None].to(h.dtype)
    unsorted = torch.empty_like(out).index_copy(0, perm, out)  # back to (token, slot) order
    return unsorted.view(n_tok, k, -1).sum(1).to(x.dtype)
