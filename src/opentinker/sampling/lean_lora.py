"""The multi-LoRA terms of the lean forward (:mod:`opentinker.sampling.lean_model`), fused per
group of sibling projections.

The math is ``LoRABatch.delta``'s: ``y += (x @ Aᵀ) @ (scale·Bᵀ)`` per row's adapter (``None`` rows
get zero weights), for every wrapped projection including ``lm_head``. Siblings that read the same
input (``q|k|v``, ``gate|up``) share one batched matmul on ``[A_q|A_k|A_v]``; see
:class:`LeanLoRA` for ``B``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from opentinker.lora import LoRABatch, TargetGroup
from opentinker.lora.experts import ExpertPairs
from opentinker.lora.layers import layer_of

# fused projection -> the LoRA groups it is made of (in output order)
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gu": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
    "lm_head": ("lm_head",),
}
# a routed-experts module's fused parameter -> its LoRA group (``LoRABatch.expert_weights``)
EXPERT_GROUPS: dict[str, str] = {
    "gate_up_proj": "mlp.experts.gate_up_proj",
    "up_proj": "mlp.experts.up_proj",
    "down_proj": "mlp.experts.down_proj",
}
KNOWN_GROUPS = frozenset([*(g for names in FUSED.values() for g in names), *EXPERT_GROUPS.values()])


def _positions(group: TargetGroup) -> dict[int, int]:
    """The model layer of each of ``group``'s layers -> its index in the group (they differ where
    only some layers have the group: the dense MLP layers of a mostly-MoE model)."""
    return {layer_of(path) or 0: pos for pos, path in enumerate(group.paths)}


# The LoRA term of one fused projection in a decode step (:meth:`LeanLoRA.step_terms`), with
# ``scale·B^T`` block-diagonal over the siblings where a projection fuses several:
#   ("mm", A^T [in, R], B^T [R, out])            every row on one entry
#   ("slots", A^T [S, in, R], B^T [S, R, out])   S slots of rows / S consecutive rows each
#   ("blocks", A^T [B, in, nb·r], B^T [B·nb, r, c], nb)
#                                                one row per slot, siblings of one rank: the output
#                                                in nb blocks of width c (one GEMV each, no zeros),
#                                                A^T's columns repeated to feed every block
#   ("split", A^T [k, in, R], B^T [k, R, out], sizes)   a few runs of unequal sizes
# On a CPU with a half-precision base, A^T and B^T are fp32 (:func:`_cpu_fp32`).
StepTerm = tuple[Any, ...]


def _cpu_fp32(term: StepTerm) -> StepTerm:
    """``term`` with its weights in fp32 if they are half precision on a CPU: there the decode
    step's small batched GEMVs (one row per adapter) run 2-4x faster in fp32 than in bf16, and
    casting their input and adding their output back cost less than that."""
    a = term[1]
    if a.device.type != "cpu" or a.dtype not in (torch.bfloat16, torch.float16):
        return term
    return (term[0], a.float(), term[2].float(), *term[3:])


def _delta(x: torch.Tensor, term: StepTerm, n_out: int) -> torch.Tensor:
    """The LoRA term ``term`` of ``x`` ([B, in], in the term's dtype) as a new [B, n_out] tensor."""
    mode, a, b = term[0], term[1], term[2]
    B = x.shape[0]
    if mode == "mm":
        return (x @ a) @ b
    if mode == "blocks":
        nb = term[3]
        return torch.bmm(torch.bmm(x.view(B, 1, -1), a).view(B * nb, 1, -1), b).view(B, n_out)
    if mode == "slots":
        s = a.shape[0]
        return torch.bmm(torch.bmm(x.view(s, -1, x.shape[-1]), a), b).view(B, n_out)
    assert mode == "split"
    return torch.cat([(xk @ a[j]) @ b[j] for j, xk in enumerate(torch.split(x, term[3]))])


def _plus_lora(
    y: torch.Tensor, x: torch.Tensor, terms: tuple[StepTerm | None, ...] | None, k: int
) -> torch.Tensor:
    """``y`` ([B, out], a fresh base output, updated in place) plus the LoRA term ``terms[k]`` of
    ``x`` ([B, in])."""
    term = None if terms is None else terms[k]
    if term is None:
        return y
    mode, a = term[0], term[1]
    B, n_out = y.shape
    if a.dtype != y.dtype:  # fp32 terms of a half-precision step (_cpu_fp32)
        return y.add_(_delta(x.to(a.dtype), term, n_out))
    if mode == "mm":
        return y.addmm_(x @ a, term[2])
    if mode == "blocks":
        b, nb = term[2], term[3]
        xa = torch.bmm(x.view(B, 1, -1), a)  # [B, 1, nb·r]
        return y.view(B * nb, 1, -1).baddbmm_(xa.view(B * nb, 1, -1), b).view(B, n_out)
    if mode == "slots":
        s = a.shape[0]
        xa = torch.bmm(x.view(s, -1, x.shape[-1]), a)
        return y.view(s, -1, n_out).baddbmm_(xa, term[2]).view(B, n_out)
    assert mode == "split"
    b, sizes = term[2], term[3]
    for j, (xk, yk) in enumerate(zip(torch.split(x, sizes), torch.split(y, sizes), strict=True)):
        yk.addmm_(xk @ a[j], b[j])
    return y


class LeanLoRA:
    """The LoRA terms of one routing plan for :class:`~opentinker.sampling.lean_model.LeanModel`, per fused projection and layer,
    built on first use from the plan's per-slot ``A^T`` / ``scale·B^T`` (``LoRABatch._weights``):

    * ``A^T`` of the siblings side by side, ``[S, in, R]`` (one batched matmul for q|k|v);
    * for a decode step with one row per slot (:meth:`step_terms`): the output cut into ``nb``
      equal blocks (the gcd of the siblings' widths), ``A^T``'s columns repeated per block and
      ``B`` as ``[S·nb, r, c]``, so every block is one GEMV and nothing reads zeros; the fused add
      lands in the base output as a view;
    * otherwise (prefill, runs of several rows, one entry for all rows): ``B`` block-diagonal
      ``[S, R, out]`` (2-D for one entry), one ``baddbmm`` into the base output (:meth:`apply`).
    """

    def __init__(self, plan: LoRABatch, groups: dict[str, TargetGroup], dtype: torch.dtype) -> None:
        self.plan = plan
        self.groups = groups
        self.dtype = dtype
        self._a: dict[tuple[str, int], tuple[torch.Tensor, list[tuple[str, torch.Tensor]]] | None] = {}
        self._diag: dict[tuple[str, int], torch.Tensor] = {}
        self._terms: tuple[StepTerm | None, ...] | None = None
        self._pos = {name: _positions(g) for name, g in groups.items()}

    def _a_side(self, key: str, layer: int) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]] | None:
        """(``A^T`` of the members present, side by side; each present member's ``scale·B^T``)."""
        if (key, layer) in self._a:
            return self._a[(key, layer)]
        present = [n for n in FUSED[key] if n in self.plan.a and layer in self._pos[n]]
        out = None
        if present:
            parts = [self.plan._weights(n, self._pos[n][layer], self.dtype) for n in present]
            a = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts], dim=-1)
            out = (a, [(n, p[1]) for n, p in zip(present, parts, strict=True)])
        self._a[(key, layer)] = out
        return out

    def _block_diag(
        self, key: str, layer: int, a: torch.Tensor, bs: list[tuple[str, torch.Tensor]]
    ) -> torch.Tensor:
        hit = self._diag.get((key, layer))
        if hit is not None:
            return hit
        names = FUSED[key]
        if len(names) == 1:
            b = bs[0][1]
        else:
            own = dict(bs)
            b = a.new_zeros(*a.shape[:-2], a.shape[-1], sum(self.groups[n].d_out for n in names))
            r0 = o0 = 0
            for n in names:
                d_out = self.groups[n].d_out
                if n in own:
                    r = own[n].shape[-2]
                    b[..., r0 : r0 + r, o0 : o0 + d_out] = own[n]
                    r0 += r
                o0 += d_out
        self._diag[(key, layer)] = b
        return b

    def _blocks(
        self, key: str, layer: int, a: torch.Tensor, bs: list[tuple[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(``A^T`` with each member's columns repeated once per block of its output; ``B`` blocks
        ``[S·nb, r, c]``; ``nb``), or None unless every member is present with one rank."""
        names = FUSED[key]
        if not (len(bs) == len(names) and bs[0][1].dim() == 3 and len({b.shape[-2] for _, b in bs}) == 1):
            return None
        r = bs[0][1].shape[-2]
        c = math.gcd(*(self.groups[n].d_out for n in names))
        cols: list[torch.Tensor] = []
        blocks = []
        for j, (_, b) in enumerate(bs):
            nb = b.shape[-1] // c
            cols += [torch.arange(j * r, (j + 1) * r, device=b.device)] * nb
            blocks.append(b.reshape(b.shape[0], r, nb, c).transpose(1, 2))  # [S, nb_j, r, c]
        b_all = torch.cat(blocks, dim=1)
        nb = b_all.shape[1]
        a_rep = a if nb == len(bs) else a.index_select(-1, torch.cat(cols))
        return a_rep, b_all.reshape(-1, r, c).contiguous(), nb

    def experts(self, layer: int) -> tuple[torch.Tensor, int, ExpertPairs] | None:
        """For the routed experts of model layer ``layer``: each row's entry [B], the number of
        entries and the pairs callable of :func:`~opentinker.lora.experts.experts_forward` (what
        the engine's ``MultiLoRAExperts`` gives it), or None if no entry trains them."""
        plan = self.plan
        at = {
            p: (g, self._pos[g][layer])
            for p, g in EXPERT_GROUPS.items()
            if g in plan.a and layer in self._pos[g]
        }
        if not at:
            return None

        def pairs(param: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
            hit = at.get(param)
            return None if hit is None else plan.expert_weights(hit[0], hit[1], dtype)

        return plan.row_index, len(plan.entries), pairs

    def step_terms(self, n_layers: int) -> tuple[StepTerm | None, ...]:
        """The LoRA terms of a decode step (one row per plan row, T = 1) for :meth:`LeanModel.decode`:
        q|k|v, o, gate|up, down of each of ``n_layers`` layers, then ``lm_head``; built once."""
        if self._terms is None:
            keys = [(k, i) for i in range(n_layers) for k in ("qkv", "o", "gu", "down")]
            terms = (self._step_term(k, i) for k, i in [*keys, ("lm_head", 0)])
            self._terms = tuple(None if t is None else _cpu_fp32(t) for t in terms)
        return self._terms

    def _step_term(self, key: str, layer: int) -> StepTerm | None:
        w = self._a_side(key, layer)
        if w is None:
            return None
        a, bs = w
        plan = self.plan
        if plan.single is not None:
            return ("mm", a, self._block_diag(key, layer, a, bs))
        if plan.split is not None:
            return ("split", a, self._block_diag(key, layer, a, bs), list(plan.split))
        if not plan.run_len or plan.run_len == 1:  # one row per slot
            blk = self._blocks(key, layer, a, bs) if len(FUSED[key]) > 1 else None
            if blk is not None:
                return ("blocks", *blk)
        return ("slots", a, self._block_diag(key, layer, a, bs))

    def apply(self, y: torch.Tensor, x: torch.Tensor, key: str, layer: int) -> torch.Tensor:
        """``y + delta`` for ``x`` ([B, T, in]) and the base output ``y`` ([B, T, out], contiguous),
        which it may update in place (the big prefill outputs are not copied)."""
        w = self._a_side(key, layer)
        if w is None:
            return y
        a, bs = w
        plan = self.plan
        B, T, n_out = y.shape
        n = plan.run_len or 1  # equal runs: one slot per run; otherwise one slot per row
        b = self._block_diag(key, layer, a, bs)
        if plan.single is not None:  # every row on one entry
            return y.view(B * T, n_out).addmm_(x.reshape(B * T, -1) @ a, b).view(B, T, n_out)
        if plan.split is not None:  # a few runs of unequal lengths
            xs, ys = torch.split(x, plan.split), torch.split(y, plan.split)
            outs = [
                torch.addmm(yk.reshape(-1, n_out), xk.reshape(-1, xk.shape[-1]) @ a[k], b[k])
                for k, (xk, yk) in enumerate(zip(xs, ys, strict=True))
            ]
            return torch.cat(outs).view(B, T, n_out)
        s = B // n
        xa = torch.bmm(x.reshape(s, n * T, -1), a)
        return y.view(s, n * T, n_out).baddbmm_(xa, b).view(B, T, n_out)
