"""The lean forward of the sampler: prefill and KV-cache decode steps of the common dense families
(Llama, Mistral, Qwen2, Qwen3, Gemma 3) and of the MoE families Qwen3-MoE and Mixtral.

HF's module tree costs more than the arithmetic of a small model's decode step: every step walks
~20 modules per layer, grows a ``DynamicCache`` by ``torch.cat`` (a copy of the whole cache, every
layer, every step), rebuilds the attention mask, and every wrapped projection runs its own Python
``delta()`` and two small matmuls. :class:`LeanModel` computes the same function with a few
tensor ops per layer, built from the model's own modules and weights:

* **Fused base weights.** ``q|k|v`` and ``gate|up`` (weights and biases) are concatenated once
  into one matrix per layer (one ``F.linear`` per fused group), and the model's own frozen
  weights become views of its rows: the HF forward (training, the fallback) and this one read one
  copy. Built once per model (cached on it, shared by every engine and backend over it, rebuilt
  if its weights move or are written).
* **Static KV cache** (:mod:`opentinker.sampling.kv_cache`). Rows leave and join moving only their
  own rows; left padding is a column mask. A decode step attends on the kv heads directly (a kv
  head's query heads are its "query positions", no repeat of K/V) with three batched ops; the
  prefill uses SDPA with a causal + padding (+ window) mask.
* **RoPE** from tables evaluated once by the model's own rotary module (one per layer type where
  the model has several, e.g. Gemma 3's local and global bases), ``rotate_half`` as a roll with
  the sign folded into the ``sin`` table (exact).
* **Multi-LoRA** from the engine's routing plan (:mod:`opentinker.sampling.lean_lora`).
* **MoE blocks** (``MOE_BLOCKS``): the router's softmax and top-k with HF's arithmetic, then the
  routed experts through :func:`~opentinker.lora.experts.experts_forward`, the function the
  engine's ``MultiLoRAExperts`` runs, fed each row's entry and the (expert, entry) LoRA pairs
  from the same routing plan. A model may mix MoE and dense MLP layers (Qwen3-MoE's
  ``mlp_only_layers`` / ``decoder_sparse_step``); a block with anything beside its router and
  experts (a shared expert: Qwen3.5-MoE, GLM-4 MoE, DeepSeek V3) is refused.

What differs between the families it serves is data, read from the modules: biases on ``q|k|v``
(Qwen2), an RMSNorm of each query and key head before RoPE (Qwen3, Gemma 3), Gemma's ``(1 + w)``
norms computed in fp32, its sandwich norms (after attention and after the MLP), its scaled
embedding, ``query_pre_attn_scalar`` (the attention module's own ``scaling``), its final logit
soft-cap, the MLP's own activation module, and a **sliding window** per layer (Mistral, Mixtral,
Gemma 3's local layers, Qwen2/3's windowed layers): a key is visible to a query at most ``window - 1``
positions before it, HF's rule. The lean cache keeps every column and masks the older ones
(positions counted over a row's real columns: every row holds its whole sequence from position
0, so a column's position is the number of real columns up to it, minus one).

The result equals the HF forward up to float rounding (fused GEMMs and another attention kernel sum
in other orders); ``tests/test_llama_decode.py`` and ``tests/test_lean_families.py`` check greedy
tokens are identical and logprobs agree within ``tests/tolerances.py``. Only models whose every
part is understood take this path: :func:`unsupported_reason` says why another does not, and the
sampler then keeps the HF forward (``NativeBackend.lean_reason``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from opentinker.lora import TargetGroup
from opentinker.lora.experts import experts_forward, is_known_experts
from opentinker.sampling.kv_cache import LeanCache
from opentinker.sampling.lean_lora import KNOWN_GROUPS, LeanLoRA, _plus_lora

# model_type -> its causal-LM class: the families whose every part the lean forward computes
FAMILIES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# MoE block class -> whether its router rounds the top-k weights to the logits' dtype (Qwen3-MoE)
# or keeps them in fp32 (Mixtral). Both: softmax in fp32, top-k, renormalised if the router's
# ``norm_topk_prob`` (Mixtral has none: always), then the routed experts and nothing beside them
MOE_BLOCKS: dict[str, bool] = {"Qwen3MoeSparseMoeBlock": True, "MixtralSparseMoeBlock": False}
GEMMA_NORMS = frozenset({"gemma3_text"})  # RMSNorm scaled by (1 + w), computed in fp32
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})  # a fixed table per position
_CACHE_ATTR = "_opentinker_lean"


@dataclass
class _Mlp:
    w_gu: torch.Tensor  # [2·I, H]
    b_gu: torch.Tensor | None
    w_down: torch.Tensor
    b_down: torch.Tensor | None
    act: Callable[[torch.Tensor], torch.Tensor]
    inter: int  # I


@dataclass
class _Moe:
    router: torch.Tensor  # [E, H]
    top_k: int
    norm: bool  # renormalise the top-k probabilities
    cast: bool  # round them to the logits' dtype
    experts: Any  # the routed-experts module (transformers' fused layout)


@dataclass
class _Layer:
    ln1: torch.Tensor  # the attention's input norm
    w_qkv: torch.Tensor  # [q_out + 2·kv_out, H]
    b_qkv: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [nq + nkv, D]: each query and key head's norm weights
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    post_attn: torch.Tensor | None  # a norm of the attention's output (Gemma's sandwich)
    ln2: torch.Tensor  # the MLP's input norm
    mlp: _Mlp | _Moe
    post_mlp: torch.Tensor | None
    scaling: float
    window: int | None  # sliding window (None: full attention)
    rope: str  # its RoPE table's key


def _rope_type(config: Any) -> str | None:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        if params and all(isinstance(v, dict) for v in params.values()):  # one per layer type
            types = {_rope_type_of(v) for v in params.values()}
            return types.pop() if len(types) == 1 else "mixed"
        return _rope_type_of(params)
    scaling = getattr(config, "rope_scaling", None)
    if scaling is None:
        return "default"
    return _rope_type_of(scaling) if isinstance(scaling, dict) else None


def _rope_type_of(params: dict[str, Any]) -> str:
    return str(params.get("rope_type", params.get("type", "default")))


def _module(m: Any) -> Any:
    return getattr(m, "base", m)  # a MultiLoRALinear wraps its frozen base


def _window(model: Any, attn: Any) -> int | None:
    if hasattr(attn, "sliding_window"):
        w = attn.sliding_window
    else:  # Mistral's and Mixtral's attention read their config's
        mistral = model.config.model_type in ("mistral", "mixtral")
        w = getattr(model.config, "sliding_window", None) if mistral else None
    return None if w is None else int(w)


def _layer_problems(layer: Any) -> list[str]:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    bad = []
    if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        bad.append("attention projections")
    elif getattr(attn, "attn_logit_softcapping", None) is not None:
        bad.append("attention soft-capping")
    elif not getattr(attn, "is_causal", True):
        bad.append("bidirectional attention")
    if hasattr(mlp, "experts"):
        bad += _moe_problems(mlp)
    elif mlp is None or not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        bad.append("gated MLP")
    return bad


def _moe_problems(block: Any) -> list[str]:
    name = type(block).__name__
    if name not in MOE_BLOCKS:
        return [f"MoE block {name}"]
    if {n for n, _ in block.named_children()} != {"gate", "experts"}:
        return [f"{name} with modules beside its router and experts"]
    if not (hasattr(block.gate, "top_k") and isinstance(getattr(block.gate, "weight", None), torch.Tensor)):
        return [f"router {type(block.gate).__name__}"]
    if not is_known_experts(_module(block.experts)):
        return [f"experts layout {type(_module(block.experts)).__name__}"]
    return []


def unsupported_reason(model: Any, groups: dict[str, TargetGroup]) -> str | None:
    """Why :class:`LeanModel` cannot run ``model`` (None if it can)."""
    config: Any = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    name = type(model).__name__
    if config is None or FAMILIES.get(str(family)) != name:
        return f"no lean forward for {family} ({name}); it covers {', '.join(sorted(FAMILIES))}"
    inner = model.model
    checks = {
        "rope type": _rope_type(config) in STATIC_ROPE and hasattr(inner, "rotary_emb"),
        "pretraining_tp": getattr(config, "pretraining_tp", 1) == 1,
        "layers": len(inner.layers) == config.num_hidden_layers,
        "lora groups": set(groups) <= KNOWN_GROUPS,
    }
    bad = [k for k, ok in checks.items() if not ok]
    for layer in inner.layers:
        bad += [p for p in _layer_problems(layer) if p not in bad]
    return f"{family}: unsupported {', '.join(bad)}" if bad else None


def lean_model(model: Any, groups: dict[str, TargetGroup]) -> LeanModel | None:
    """The lean forward of ``model`` (built once and cached on it), or None if it is not supported."""
    if unsupported_reason(model, groups) is not None:
        return None
    lean = getattr(model, _CACHE_ATTR, None)
    if not isinstance(lean, LeanModel) or not lean.current():
        lean = LeanModel(model)
        object.__setattr__(model, _CACHE_ATTR, lean)
    return lean


def _no_pairs(param: str, dtype: torch.dtype) -> None:
    return None


def _fuse(params: list[torch.Tensor]) -> torch.Tensor:
    """The frozen ``params`` ([out_i, ...] each) stacked into one ``[Σ out_i, ...]`` tensor; each
    parameter then becomes a view of its rows (same values, contiguous), so training (the HF
    forward) and sampling read one copy of these weights, not two."""
    fused = torch.cat([p.detach() for p in params]).contiguous()
    row = 0
    for p in params:
        n = p.shape[0]
        p.data = fused[row : row + n]
        row += n
    return fused


def _fuse_biases(mods: list[Any]) -> torch.Tensor | None:
    biases = [_module(m).bias for m in mods]
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):  # a missing bias is zero
        ws = [_module(m).weight for m in mods]
        return torch.cat(
            [
                b.detach() if b is not None else w.new_zeros(w.shape[0])
                for b, w in zip(biases, ws, strict=True)
            ]
        )
    return _fuse(biases)


class LeanModel:
    """Fused frozen weights of one model and its forward over a :class:`LeanCache`."""

    @torch.no_grad()
    def __init__(self, model: Any) -> None:
        config = model.config
        inner = model.model
        self.n_heads = int(config.num_attention_heads)
        self.n_kv = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.n_heads)
        self.hidden = int(config.hidden_size)
        self.eps = float(config.rms_norm_eps)
        self.gemma = config.model_type in GEMMA_NORMS
        self.max_positions = int(config.max_position_embeddings)
        self.embed = _module(inner.embed_tokens).weight
        scale = getattr(inner.embed_tokens, "embed_scale", None)
        self.embed_scale = None if scale is None else scale.to(self.embed.dtype)
        self.w_lm = _module(model.lm_head).weight
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self._sources: list[torch.Tensor] = [self.embed, self.w_lm]
        self.norm = self._norm(inner.norm)
        types = getattr(config, "layer_types", None)
        self._layer_type = "layer_type" in inspect.signature(inner.rotary_emb.forward).parameters
        self.layers = [
            self._layer(model, layer, str(types[i]) if types else "") for i, layer in enumerate(inner.layers)
        ]
        self._versions = [(t, t.data_ptr(), t._version) for t in self._sources]
        self._rotary = inner.rotary_emb
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_tables(min(self.max_positions, 1024))

    def _norm(self, module: Any) -> torch.Tensor:
        """The weight this forward multiplies by (Gemma's ``1 + w`` in fp32)."""
        w = module.weight
        self._sources.append(w)
        return (1.0 + w.float()) if self.gemma else w

    def _mlp(self, mlp: Any) -> _Mlp | _Moe:
        if hasattr(mlp, "experts"):
            router = _module(mlp.gate).weight
            self._sources.append(router)
            return _Moe(
                router=router,
                top_k=int(mlp.gate.top_k),
                norm=bool(getattr(mlp.gate, "norm_topk_prob", True)),
                cast=MOE_BLOCKS[type(mlp).__name__],
                experts=_module(mlp.experts),
            )
        gu = [mlp.gate_proj, mlp.up_proj]
        parts = [_module(m).weight for m in gu]
        self._sources += [*parts, _module(mlp.down_proj).weight]
        b_gu = _fuse_biases(gu)  # before the weights move
        act = mlp.act_fn
        return _Mlp(
            w_gu=_fuse(parts),
            b_gu=b_gu,
            w_down=_module(mlp.down_proj).weight,
            b_down=_module(mlp.down_proj).bias,
            act=F.silu if isinstance(act, torch.nn.SiLU) else act,
            inter=int(parts[0].shape[0]),
        )

    def _layer(self, model: Any, layer: Any, kind: str) -> _Layer:
        attn = layer.self_attn
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        parts = [_module(m).weight for m in qkv]
        self._sources += [*parts, _module(attn.o_proj).weight]
        b_qkv = _fuse_biases(qkv)  # before the weights move
        qk_norm = None
        if hasattr(attn, "q_norm"):
            q, k = self._norm(attn.q_norm), self._norm(attn.k_norm)
            qk_norm = torch.cat([q.expand(self.n_heads, -1), k.expand(self.n_kv, -1)])
        sandwich = hasattr(layer, "pre_feedforward_layernorm")  # Gemma: norms after attention and MLP too
        return _Layer(
            ln1=self._norm(layer.input_layernorm),
            w_qkv=_fuse(parts),
            b_qkv=b_qkv,
            qk_norm=qk_norm,
            w_o=_module(attn.o_proj).weight,
            b_o=_module(attn.o_proj).bias,
            post_attn=self._norm(layer.post_attention_layernorm) if sandwich else None,
            ln2=self._norm(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm),
            mlp=self._mlp(layer.mlp),
            post_mlp=self._norm(layer.post_feedforward_layernorm) if sandwich else None,
            scaling=float(attn.scaling),
            window=_window(model, attn),
            rope=kind if self._layer_type else "",
        )

    def current(self) -> bool:
        """Whether the model still holds the weights these were built from (not moved, replaced
        or written in place)."""
        return all(t.data_ptr() == p and t._version == v for t, p, v in self._versions)

    def _rope_tables(self, n: int) -> None:
        pos = torch.arange(n, device=self.device)[None]
        x = torch.empty(0, dtype=self.dtype, device=self.device)
        for kind in {layer.rope for layer in self.layers}:
            # the model's own rotary module: the same cos/sin as HF's
            cos, sin = self._rotary(x, pos, kind) if kind else self._rotary(x, pos)
            half = cos.shape[-1] // 2
            # rotate_half(x)·sin = roll(x, half)·[-sin₁, sin₂]: the sign moves into the table (exact)
            self._tables[kind] = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)

    def rope(self, pos: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos and signed sin at positions ``pos`` ([B, T]) as [B, T, 1, head_dim], per table."""
        need = int(pos.max()) + 1
        have = next(iter(self._tables.values()))[0].shape[0]
        if need > have:
            self._rope_tables(max(need, min(2 * have, self.max_positions)))
        return {k: (c[pos].unsqueeze(2), s[pos].unsqueeze(2)) for k, (c, s) in self._tables.items()}

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """HF's RMSNorm of ``x``'s last dim times ``w`` (that dim's weights, or [heads, D])."""
        if x.dtype == torch.float32:  # the fused kernel equals HF's formula in fp32
            if w.dim() == 1:
                return F.rms_norm(x, (x.shape[-1],), w, self.eps)
            return F.rms_norm(x, (x.shape[-1],), None, self.eps) * w
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:  # Gemma scales in fp32, then rounds
            return (h * w).to(x.dtype)
        return w * h.to(x.dtype)

    def _qk(self, qkv: torch.Tensor, layer: _Layer, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The query and key heads of ``qkv`` ([..., heads, D]) normed (if the model does) and rotated."""
        qk = qkv[..., : self.n_heads + self.n_kv, :]
        if layer.qk_norm is not None:
            qk = self._rms(qk, layer.qk_norm)
        return torch.addcmul(qk * cos, qk.roll(self.head_dim // 2, -1), sin)  # q·cos + rotate_half(q)·sin

    def _logits(self, x: torch.Tensor, lora: Any, terms: Any) -> torch.Tensor:
        x = self._rms(x, self.norm)
        y = F.linear(x, self.w_lm)
        if terms is not None:
            y = _plus_lora(y, x, terms, 4 * len(self.layers))
        elif lora is not None:
            y = lora.apply(y, x, "lm_head", 0)
        if self.softcap is not None:
            y = torch.tanh(y / self.softcap) * self.softcap
        return y

    def _dense(self, x: torch.Tensor, mlp: _Mlp, lora: LeanLoRA | None, i: int) -> torch.Tensor:
        """The gated MLP of layer ``i`` on ``x`` [B, T, H]."""
        gu = F.linear(x, mlp.w_gu, mlp.b_gu)
        if lora is not None:
            gu = lora.apply(gu, x, "gu", i)
        act = mlp.act(gu[..., : mlp.inter]) * gu[..., mlp.inter :]
        d = F.linear(act, mlp.w_down, mlp.b_down)
        return d if lora is None else lora.apply(d, act, "down", i)

    def _moe(self, x: torch.Tensor, moe: _Moe, lora: LeanLoRA | None, i: int, t: int) -> torch.Tensor:
        """The MoE block of layer ``i`` on ``x`` [B·T, H] (``t`` tokens a row, rows row-major):
        its router's top-k (HF's arithmetic), then every routed expert with its entry's LoRA
        pair (:func:`~opentinker.lora.experts.experts_forward`, as the engine's LoRA layer)."""
        logits = F.linear(x, moe.router)
        top, index = torch.topk(torch.softmax(logits, -1, dtype=torch.float), moe.top_k, dim=-1)
        if moe.norm:
            top = top / top.sum(-1, keepdim=True)
        weights = top.to(logits.dtype) if moe.cast else top
        routed = None if lora is None else lora.experts(i)
        if routed is None:
            entry, n_ent, pairs = index.new_zeros(x.shape[0]), 1, _no_pairs
        else:
            rows, n_ent, pairs = routed
            entry = rows if t == 1 else rows.repeat_interleave(t)
        return experts_forward(moe.experts, x, index, weights, entry, n_ent, pairs)

    def _embed(self, ids: torch.Tensor, lora: LeanLoRA | None) -> torch.Tensor:
        h = F.embedding(ids, self.embed)
        d = None if lora is None else lora.plan.embedding_delta(ids, h.dtype)  # a tied unembedding's
        h = h if d is None else h + d
        return h if self.embed_scale is None else h * self.embed_scale

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
        masks = {w: cache.attention_mask(c0, T, w) for w in {layer.window for layer in self.layers}}
        nq, nkv, D = self.n_heads, self.n_kv, self.head_dim
        tables = self.rope(pos)
        h = self._embed(ids, lora)
        for i, layer in enumerate(self.layers):
            x = self._rms(h, layer.ln1)
            qkv = F.linear(x, layer.w_qkv, layer.b_qkv)
            if lora is not None:
                qkv = lora.apply(qkv, x, "qkv", i)
            qkv = qkv.view(B, T, nq + 2 * nkv, D)
            qk = self._qk(qkv, layer, *tables[layer.rope])
            kc, vc = cache.keys[i], cache.values[i]
            kc[:, :, c0:L] = qk[:, :, nq:].transpose(1, 2)
            vc[:, :, c0:L] = qkv[:, :, nq + nkv :].transpose(1, 2)
            mask, causal = masks[layer.window]
            att = F.scaled_dot_product_attention(
                qk[:, :, :nq].transpose(1, 2),
                kc[:, :, :L],
                vc[:, :, :L],
                attn_mask=mask,
                is_causal=causal,
                scale=layer.scaling,
                enable_gqa=nq > nkv,
            )
            att = att.transpose(1, 2).reshape(B, T, nq * D)
            o = F.linear(att, layer.w_o, layer.b_o)
            if lora is not None:
                o = lora.apply(o, att, "o", i)
            h = h + (o if layer.post_attn is None else self._rms(o, layer.post_attn))
            x = self._rms(h, layer.ln2)
            if isinstance(layer.mlp, _Moe):
                d = self._moe(x.view(B * T, -1), layer.mlp, lora, i, T).view(B, T, -1)
            else:
                d = self._dense(x, layer.mlp, lora, i)
            h = h + (d if layer.post_mlp is None else self._rms(d, layer.post_mlp))
        if keep:
            h = h[:, -keep:]
        return self._logits(h, lora, None)

    def decode(
        self, cache: LeanCache, ids: torch.Tensor, pos: torch.Tensor, lora: LeanLoRA | None
    ) -> torch.Tensor:
        """Logits [B, V] of one new token per row (``ids``, ``pos``: [B, 1]) after the cached
        columns, whose K/V it writes into the cache. The LoRA terms come from
        :meth:`LeanLoRA.step_terms` (built once per routing plan)."""
        B = ids.shape[0]
        nq, nkv, D = self.n_heads, self.n_kv, self.head_dim
        rep = nq // nkv
        c0 = cache.length
        cache.append(1, None)
        L = c0 + 1
        biases = {w: cache.decode_bias(nkv, w) for w in {layer.window for layer in self.layers}}
        terms = None if lora is None else lora.step_terms(len(self.layers))
        tables = {k: (c[:, 0], s[:, 0]) for k, (c, s) in self.rope(pos).items()}  # [B, 1, D]
        h = self._embed(ids[:, 0], lora)
        for i, layer in enumerate(self.layers):
            x = self._rms(h, layer.ln1)
            y = F.linear(x, layer.w_qkv, layer.b_qkv)
            qkv = _plus_lora(y, x, terms, 4 * i).view(B, nq + 2 * nkv, D)
            qk = self._qk(qkv, layer, *tables[layer.rope])
            kc, vc = cache.keys[i], cache.values[i]
            kc[:, :, c0] = qk[:, nq:]
            vc[:, :, c0] = qkv[:, nq + nkv :]
            # a kv head's `rep` query heads act as its query positions (no repeat of K/V); three
            # batched matmul/softmax ops cost less than SDPA's kernel set-up at this size
            q = qk[:, :nq].reshape(B * nkv, rep, D)
            k3 = kc[:, :, :L].reshape(B * nkv, L, D)  # views of the cache
            v3 = vc[:, :, :L].reshape(B * nkv, L, D)
            scores = torch.baddbmm(biases[layer.window], q, k3.transpose(1, 2), alpha=layer.scaling)
            att = torch.bmm(torch.softmax(scores, -1), v3).view(B, nq * D)
            o = _plus_lora(F.linear(att, layer.w_o, layer.b_o), att, terms, 4 * i + 1)
            h = h + (o if layer.post_attn is None else self._rms(o, layer.post_attn))
            x, mlp = self._rms(h, layer.ln2), layer.mlp
            if isinstance(mlp, _Moe):
                d = self._moe(x, mlp, lora, i, 1)
            else:
                gu = _plus_lora(F.linear(x, mlp.w_gu, mlp.b_gu), x, terms, 4 * i + 2)
                act = mlp.act(gu[:, : mlp.inter]) * gu[:, mlp.inter :]
                d = _plus_lora(F.linear(act, mlp.w_down, mlp.b_down), act, terms, 4 * i + 3)
            h = h + (d if layer.post_mlp is None else self._rms(d, layer.post_mlp))
        return self._logits(h, None, terms)
