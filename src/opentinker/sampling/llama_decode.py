"""A lean forward for Llama-family models while sampling: prefill and KV-cache decode steps.

HF's module tree costs more than the arithmetic of a small model's decode step: every step walks
~20 modules per layer, grows a ``DynamicCache`` by ``torch.cat`` (a copy of the whole cache, every
layer, every step), rebuilds the attention mask, and every wrapped projection runs its own Python
``delta()`` and two small matmuls. :class:`LlamaLean` computes the same function with a few
tensor ops per layer:

* **Fused base weights.** ``q|k|v`` and ``gate|up`` are concatenated once into one matrix per layer
  (one ``F.linear`` per fused group), and the model's own frozen ``q``/``k``/``v``/``gate``/``up``
  weights become views of its rows: the HF forward (training, the fallback) and this one read one
  copy (the originals, often pages of the mmapped checkpoint, are no longer used). Built once per model (cached on it, shared by every engine and backend
  over it, rebuilt if its weights move or are written).
* **Static KV cache** (:mod:`opentinker.sampling.kv_cache`). One tensor ``[layers, 2, rows,
  kv_heads, columns, head_dim]`` written in place; rows leave and join moving only their own rows;
  columns grow by doubling when needed (never a copy per step). Left padding is a column mask.
  A decode step attends on the kv heads directly (a kv head's query heads are its "query
  positions", no repeat of K/V) with three batched ops (scores, softmax, values); the prefill
  uses SDPA with a causal + padding mask.
* **RoPE** from a table evaluated once by the model's own rotary module (same ``cos``/``sin``;
  ``rotate_half`` as a roll with the sign folded into the ``sin`` table, which is exact).
* **Multi-LoRA** from the engine's routing plan (:class:`LoRABatch`), with the same math as
  ``LoRABatch.delta``: ``y += (x @ Aᵀ) @ (scale·Bᵀ)`` per row's adapter (``None`` rows get zero
  weights), for every wrapped projection including ``lm_head``. Siblings that read the same input
  share one batched matmul on ``[A_q|A_k|A_v]`` (likewise gate/up); see :class:`LeanLoRA` for ``B``.

The result equals the HF forward up to float rounding (fused GEMMs and a different attention
kernel sum in other orders: ~1e-7 relative in fp32); ``tests/test_llama_decode.py`` checks greedy
tokens are identical and logprobs agree to 1e-5. Only models whose every part is understood take
this path (:func:`lean_llama` returns None otherwise and the sampler keeps the HF forward):
``LlamaForCausalLM`` with SiLU MLP, RMSNorm, ``"default"`` RoPE, no biases, and LoRA wrapped on
exactly the projections above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from opentinker.lora import LoRABatch, TargetGroup
from opentinker.sampling.kv_cache import LeanCache

# fused projection -> the LoRA groups it is made of (in output order)
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gu": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
    "lm_head": ("lm_head",),
}
_KNOWN_GROUPS = frozenset(g for names in FUSED.values() for g in names)
_CACHE_ATTR = "_opentinker_lean"


@dataclass
class _Layer:
    ln1: torch.Tensor  # [H]
    w_qkv: torch.Tensor  # [q_out + 2·kv_out, H]
    w_o: torch.Tensor  # [H, q_out]
    ln2: torch.Tensor  # [H]
    w_gu: torch.Tensor  # [2·I, H]
    w_down: torch.Tensor  # [H, I]


def _rope_type(config: Any) -> str | None:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        return params.get("rope_type", params.get("type", "default"))
    scaling = getattr(config, "rope_scaling", None)
    if scaling is None:
        return "default"
    return scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None


def unsupported_reason(model: Any, groups: dict[str, TargetGroup]) -> str | None:
    """Why :class:`LlamaLean` cannot run ``model`` (None if it can)."""
    config: Any = getattr(model, "config", None)
    if (
        config is None
        or type(model).__name__ != "LlamaForCausalLM"
        or getattr(config, "model_type", None) != "llama"
    ):
        return "not a LlamaForCausalLM"
    checks = {
        "rope type": _rope_type(config) == "default",
        "activation": getattr(config, "hidden_act", None) == "silu",
        "attention bias": not getattr(config, "attention_bias", False),
        "mlp bias": not getattr(config, "mlp_bias", False),
        "pretraining_tp": getattr(config, "pretraining_tp", 1) == 1,
        "rope scaling": float(getattr(model.model.rotary_emb, "attention_scaling", 1.0)) == 1.0,
        "layers": len(model.model.layers) == config.num_hidden_layers,
        "lora groups": set(groups) <= _KNOWN_GROUPS,
    }
    bad = [k for k, ok in checks.items() if not ok]
    return f"unsupported {', '.join(bad)}" if bad else None


def lean_llama(model: Any, groups: dict[str, TargetGroup]) -> LlamaLean | None:
    """The lean forward of ``model`` (built once and cached on it), or None if it is not supported."""
    if unsupported_reason(model, groups) is not None:
        return None
    lean = getattr(model, _CACHE_ATTR, None)
    if not isinstance(lean, LlamaLean) or not lean.current():
        lean = LlamaLean(model)
        object.__setattr__(model, _CACHE_ATTR, lean)
    return lean


def _weight(module: Any) -> torch.Tensor:
    return module.weight  # a MultiLoRALinear forwards .weight to its frozen base


def _fuse(params: list[torch.Tensor]) -> torch.Tensor:
    """The frozen ``params`` ([out_i, in] each) stacked into one ``[Σ out_i, in]`` matrix; each
    parameter then becomes a view of its rows (same values, contiguous), so training (the HF
    forward) and sampling read one copy of these weights, not two."""
    fused = torch.cat([p.detach() for p in params]).contiguous()
    row = 0
    for p in params:
        n = p.shape[0]
        p.data = fused[row : row + n]
        row += n
    return fused


class LlamaLean:
    """Fused frozen weights of one Llama model and its forward over a :class:`LeanCache`."""

    @torch.no_grad()
    def __init__(self, model: Any) -> None:
        config = model.config
        inner = model.model
        self.n_heads = int(config.num_attention_heads)
        self.n_kv = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.n_heads)
        self.hidden = int(config.hidden_size)
        self.inter = int(config.intermediate_size)
        self.eps = float(config.rms_norm_eps)
        self.scaling = self.head_dim**-0.5
        self.max_positions = int(config.max_position_embeddings)
        self.embed = _weight(inner.embed_tokens)
        self.norm = _weight(inner.norm)
        self.w_lm = _weight(model.lm_head)
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self.layers: list[_Layer] = []
        sources = [self.embed, self.norm, self.w_lm]
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            parts = [_weight(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)]
            ln1, ln2 = _weight(layer.input_layernorm), _weight(layer.post_attention_layernorm)
            w_o, w_down = _weight(attn.o_proj), _weight(mlp.down_proj)
            w_qkv, w_gu = _fuse(parts[:3]), _fuse(parts[3:])
            sources += [*parts, ln1, ln2, w_o, w_down]
            self.layers.append(_Layer(ln1=ln1, w_qkv=w_qkv, w_o=w_o, ln2=ln2, w_gu=w_gu, w_down=w_down))
        self._sources = [(t, t.data_ptr(), t._version) for t in sources]
        self._rotary = inner.rotary_emb
        self._cos = self._sin = torch.empty(0)
        self._rope_table(min(self.max_positions, 1024))

    def current(self) -> bool:
        """Whether the model still holds the weights these were built from (not moved, replaced
        or written in place)."""
        return all(t.data_ptr() == p and t._version == v for t, p, v in self._sources)

    def _rope_table(self, n: int) -> None:
        pos = torch.arange(n, device=self.device)[None]
        x = torch.empty(0, dtype=self.dtype, device=self.device)
        cos, sin = self._rotary(x, pos)  # the model's own rotary module: the same cos/sin as HF's
        half = cos.shape[-1] // 2
        # rotate_half(x)·sin = roll(x, half)·[-sin₁, sin₂]: the sign moves into the table (exact)
        self._cos, self._sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at positions ``pos`` ([B, T]) as [B, T, 1, head_dim]."""
        need = int(pos.max()) + 1
        if need > self._cos.shape[0]:
            self._rope_table(max(need, min(2 * self._cos.shape[0], self.max_positions)))
        return self._cos[pos].unsqueeze(2), self._sin[pos].unsqueeze(2)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the fused kernel equals HF's formula bit for bit in fp32
            return F.rms_norm(x, (self.hidden,), w, self.eps)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * h.to(x.dtype)

    def new_cache(self, rows: int, columns: int, max_columns: int) -> LeanCache:
        return LeanCache(self, rows, columns, max_columns)

    def forward(
        self,
        cache: LeanCache,
        ids: torch.Tensor,
        pos: torch.Tensor,
        valid: torch.Tensor | None,
        lora: LeanLoRA | None,
        keep: int,
    ) -> torch.Tensor:
        """Run ``ids`` ([B, T] at RoPE positions ``pos``; ``valid`` False on left padding, None =
        all real) after the ``cache.length`` columns already cached; return the logits of the last
        ``keep`` positions (0 = all), [B, keep, V]."""
        if ids.shape[1] == 1 and keep == 1 and valid is None and cache.length > 0:
            return self.decode(cache, ids, pos, lora)[:, None]
        B, T = ids.shape
        c0 = cache.length
        L = c0 + T
        cache.append(T, valid)
        keys, values = cache.keys, cache.values
        mask, causal = cache.attention_mask(c0, T)
        nq, nkv, D = self.n_heads, self.n_kv, self.head_dim
        cos, sin = self.rope(pos)
        h = F.embedding(ids, self.embed)
        half = D // 2
        for i, layer in enumerate(self.layers):
            x = self._rms(h, layer.ln1)
            qkv = F.linear(x, layer.w_qkv)
            if lora is not None:
                qkv = lora.apply(qkv, x, "qkv", i)
            qkv = qkv.view(B, T, nq + 2 * nkv, D)
            qk = qkv[:, :, : nq + nkv]
            qk = qk * cos + qk.roll(half, -1) * sin  # HF's q·cos + rotate_half(q)·sin
            kc, vc = keys[i], values[i]
            kc[:, :, c0:L] = qk[:, :, nq:].transpose(1, 2)
            vc[:, :, c0:L] = qkv[:, :, nq + nkv :].transpose(1, 2)
            q = qk[:, :, :nq].transpose(1, 2)
            att = F.scaled_dot_product_attention(
                q,
                kc[:, :, :L],
                vc[:, :, :L],
                attn_mask=mask,
                is_causal=causal,
                scale=self.scaling,
                enable_gqa=nq > nkv,
            )
            att = att.transpose(1, 2).reshape(B, T, nq * D)
            o = F.linear(att, layer.w_o)
            if lora is not None:
                o = lora.apply(o, att, "o", i)
            h = h + o
            x = self._rms(h, layer.ln2)
            gu = F.linear(x, layer.w_gu)
            if lora is not None:
                gu = lora.apply(gu, x, "gu", i)
            act = F.silu(gu[..., : self.inter]) * gu[..., self.inter :]
            d = F.linear(act, layer.w_down)
            if lora is not None:
                d = lora.apply(d, act, "down", i)
            h = h + d
        if keep:
            h = h[:, -keep:]
        x = self._rms(h, self.norm)
        logits = F.linear(x, self.w_lm)
        if lora is not None:
            logits = lora.apply(logits, x, "lm_head", 0)
        return logits

    def decode(
        self, cache: LeanCache, ids: torch.Tensor, pos: torch.Tensor, lora: LeanLoRA | None
    ) -> torch.Tensor:
        """Logits [B, V] of one new token per row (``ids``, ``pos``: [B, 1]) after the cached
        columns, whose K/V it writes into the cache. The LoRA terms come from
        :meth:`LeanLoRA.step_terms` (built once per routing plan)."""
        B = ids.shape[0]
        nq, nkv, D = self.n_heads, self.n_kv, self.head_dim
        rep, half = nq // nkv, D // 2
        c0 = cache.length
        cache.append(1, None)
        L = c0 + 1
        bias = cache.decode_bias(nkv)
        terms = None if lora is None else lora.step_terms(len(self.layers))
        cos, sin = self.rope(pos)
        cos, sin = cos[:, 0], sin[:, 0]  # [B, 1, D]
        h = F.embedding(ids[:, 0], self.embed)
        for i, layer in enumerate(self.layers):
            x = self._rms(h, layer.ln1)
            qkv = _plus_lora(F.linear(x, layer.w_qkv), x, terms, 4 * i).view(B, nq + 2 * nkv, D)
            qk = qkv[:, : nq + nkv]
            qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)  # HF's q·cos + rotate_half(q)·sin
            kc, vc = cache.keys[i], cache.values[i]
            kc[:, :, c0] = qk[:, nq:]
            vc[:, :, c0] = qkv[:, nq + nkv :]
            # a kv head's `rep` query heads act as its query positions (no repeat of K/V); three
            # batched matmul/softmax ops cost less than SDPA's kernel set-up at this size
            q = qk[:, :nq].reshape(B * nkv, rep, D)
            k3 = kc[:, :, :L].reshape(B * nkv, L, D)  # views of the cache
            v3 = vc[:, :, :L].reshape(B * nkv, L, D)
            scores = torch.baddbmm(bias, q, k3.transpose(1, 2), alpha=self.scaling)
            att = torch.bmm(torch.softmax(scores, -1), v3).view(B, nq * D)
            h = h + _plus_lora(F.linear(att, layer.w_o), att, terms, 4 * i + 1)
            x = self._rms(h, layer.ln2)
            gu = _plus_lora(F.linear(x, layer.w_gu), x, terms, 4 * i + 2)
            act = F.silu(gu[:, : self.inter]) * gu[:, self.inter :]
            h = h + _plus_lora(F.linear(act, layer.w_down), act, terms, 4 * i + 3)
        x = self._rms(h, self.norm)
        return _plus_lora(F.linear(x, self.w_lm), x, terms, 4 * len(self.layers))


# The LoRA term of one fused projection in a decode step (:meth:`LeanLoRA.step_terms`), with
# ``scale·B^T`` block-diagonal over the siblings where a projection fuses several:
#   ("mm", A^T [in, R], B^T [R, out])            every row on one entry
#   ("slots", A^T [S, in, R], B^T [S, R, out])   S slots of rows / S consecutive rows each
#   ("blocks", A^T [B, in, nb·r], B^T [B·nb, r, c], nb)
#                                                one row per slot, siblings of one rank: the output
#                                                in nb blocks of width c (one GEMV each, no zeros),
#                                                A^T's columns repeated to feed every block
#   ("split", A^T [k, in, R], B^T [k, R, out], sizes)   a few runs of unequal sizes
StepTerm = tuple[Any, ...]


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
    """The LoRA terms of one routing plan for :class:`LlamaLean`, per fused projection and layer,
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

    def _a_side(self, key: str, layer: int) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]] | None:
        """(``A^T`` of the members present, side by side; each present member's ``scale·B^T``)."""
        if (key, layer) in self._a:
            return self._a[(key, layer)]
        present = [n for n in FUSED[key] if n in self.plan.a]
        out = None
        if present:
            parts = [self.plan._weights(n, layer, self.dtype) for n in present]
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

    def step_terms(self, n_layers: int) -> tuple[StepTerm | None, ...]:
        """The LoRA terms of a decode step (one row per plan row, T = 1) for :meth:`LlamaLean.decode`:
        q|k|v, o, gate|up, down of each of ``n_layers`` layers, then ``lm_head``; built once."""
        if self._terms is None:
            keys = [(k, i) for i in range(n_layers) for k in ("qkv", "o", "gu", "down")]
            self._terms = tuple(self._step_term(k, i) for k, i in [*keys, ("lm_head", 0)])
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
