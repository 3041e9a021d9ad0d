"""The HF path's decoding state, one kind per layer: rows selected, merged, stored and loaded.

:class:`~opentinker.sampling.forward.HFForward` runs the model's own forward over a
``DynamicCache``, whose layers are of two kinds:

* **attention** (``DynamicLayer``): ``keys`` [B, heads, T, dk] and ``values`` [B, heads, T, dv],
  one column per token, right-aligned (left padding masked by the attention mask). Rows leave by
  ``index_select``, batches join by left-padding the narrower one's columns, and a row is stored
  for the next turn as its unpadded columns, which the prefix cache may cut at any length.
  ``dk`` and ``dv`` may differ: **MLA** (DeepSeek V3) is served in the representation HF's forward
  caches, the *compressed latent* (the "keys" slot holds the normalised ``kv_lora_rank`` latent,
  the "values" slot the shared RoPE key, one head each; ``expand_kv`` runs ``kv_b_proj`` over the
  cached columns at every forward). We keep it rather than an expanded per-head K/V because (1)
  it is what the forward the trainer runs reads and writes, so sampler = trainer holds with no MLA
  code of ours, including a LoRA on ``kv_b_proj`` (each row's adapter expands the latent at every
  step, exactly as in training; an expanded cache would have to be expanded per adapter by us),
  and (2) it is ``kv_lora_rank + rope`` numbers per token instead of ``heads * (dk + dv)``
  (576 vs 40960 in DeepSeek V3's real shape). Its cost, re-expanding every cached column at each
  step, is the HF forward's; a weight-absorbed MLA decode would avoid it.
* **recurrent** (``LinearAttentionLayer``: Gated DeltaNet in Qwen3.5 / Qwen3-Next, Mamba2 in
  Nemotron-H; also the empty placeholder HF puts at MLP/MoE-only layers): per row a short
  convolution state [B, channels, kernel] and a recurrent state (GDN [B, heads, dk, dv], Mamba2
  [B, heads, head_dim, state]), the state *after* the row's last token, no columns. Rows leave
  by ``index_select`` and batches join by concatenation (the rows' columns play no part). A row
  is stored as its states at the end of its tokens: such an entry serves only a prompt that
  continues *all* of its tokens (:attr:`RowState.cuttable` is False, and
  :class:`~opentinker.sampling.prefix_cache.PrefixCache` matches it whole or not at all).

The states are cloned when stored and when loaded: HF updates them in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

# layer kinds whose cache is keys and values / a recurrent state / nothing (HF's placeholder)
KV_KINDS = frozenset({"full_attention", "attention", "sliding_attention", "chunked_attention"})
RECURRENT_KINDS = frozenset({"linear_attention"})
NO_CACHE_KINDS = frozenset({"mlp", "moe"})

# one row's recurrent layer: (conv states, recurrent states), per state index (None: unused)
States = tuple[tuple[torch.Tensor | None, ...], tuple[torch.Tensor | None, ...]]


def layer_kinds(model: Any) -> list[str]:
    """The cache kind of each decoder layer of ``model`` (its text config's ``layer_types``; every
    layer full attention when it has none)."""
    config: Any = model.config
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = getattr(config, "layer_types", None)
    return [str(k) for k in kinds] if kinds else ["full_attention"] * int(config.num_hidden_layers)


def is_recurrent(model: Any) -> bool:
    """Whether some layer of ``model`` keeps a recurrent state."""
    return any(k in RECURRENT_KINDS for k in layer_kinds(model))


def is_windowed(model: Any) -> bool:
    """Whether some attention layer of ``model`` has a sliding window (or chunks): HF's mask then
    counts a key's distance to the query in cache columns, so a row's columns must be contiguous."""
    config: Any = model.config
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = set(layer_kinds(model))
    return bool(kinds & {"sliding_attention", "chunked_attention"}) or (
        getattr(config, "sliding_window", None) is not None
    )


def new_cache(model: Any) -> DynamicCache:
    """An empty cache for ``model``: HF's lazy all-attention one, or one layer per kind when some
    layer is recurrent (every attention kind as a plain ``DynamicLayer``: its window is the
    attention mask's business, as in the lazy cache)."""
    if not is_recurrent(model):
        return DynamicCache()
    layers: list[Any] = [
        DynamicLayer() if k in KV_KINDS else LinearAttentionLayer(number_of_states=1)
        for k in layer_kinds(model)
    ]
    cache = DynamicCache()
    cache.layers, cache.layer_class_to_replicate = layers, None
    return cache


@dataclass(frozen=True)
class RowState:
    """One row's decoding state after its ``length`` tokens, for the prefix cache: per layer its
    keys and values ([heads, length, dk], [heads, length, dv]) in ``kv``, or its recurrent
    states in ``states`` (None in the other; in both for a layer without a cache)."""

    length: int
    kv: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]
    states: tuple[States | None, ...]

    @property
    def cuttable(self) -> bool:
        """Whether a prefix of it is a valid state (no layer holds a recurrent state)."""
        return all(s is None for s in self.states)

    @property
    def nbytes(self) -> int:
        tensors = [t for kv in self.kv if kv is not None for t in kv]
        tensors += [t for st in self.states if st is not None for part in st for t in part if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def cut(self, n: int) -> RowState:
        """The state after its first ``n`` tokens (only ``n == length`` for a recurrent one)."""
        if n == self.length:
            return self
        if not self.cuttable:
            raise ValueError(f"a recurrent state after {self.length} tokens cannot be cut to {n}")
        return RowState(
            n, tuple(None if kv is None else (kv[0][:, :n], kv[1][:, :n]) for kv in self.kv), self.states
        )


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> DynamicCache:
    """A new cache of ``cache``'s rows ``rows`` (kept, dropped or repeated, in this order)."""
    out = DynamicCache()
    out.layers, out.layer_class_to_replicate = [], None
    layer: Any
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionLayer):
            out.layers.append(_state_layer(layer, lambda t: t.index_select(0, rows)))
        else:
            out.layers.append(_kv_layer(layer.keys.index_select(0, rows), layer.values.index_select(0, rows)))
    return out


def merge_caches(a: DynamicCache, b: DynamicCache, width: int) -> DynamicCache:
    """``a``'s rows then ``b``'s; attention columns left-padded to ``width``."""
    out = DynamicCache()
    out.layers, out.layer_class_to_replicate = [], None
    x: Any
    y: Any
    for x, y in zip(a.layers, b.layers, strict=True):
        if isinstance(x, LinearAttentionLayer):
            assert isinstance(y, LinearAttentionLayer)
            out.layers.append(_join_states(x, y))
        else:
            keys = torch.cat([_left_pad(x.keys, width), _left_pad(y.keys, width)])
            out.layers.append(
                _kv_layer(keys, torch.cat([_left_pad(x.values, width), _left_pad(y.values, width)]))
            )
    return out


def row_state(cache: DynamicCache, row: int, cols: torch.Tensor) -> RowState:
    """A copy of row ``row``'s state: its attention columns ``cols``, its recurrent states."""
    kvs: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    states: list[States | None] = []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionLayer):
            conv = tuple(_row(layer.conv_states.get(i), row) for i in range(layer.number_of_states))
            rec = tuple(_row(layer.recurrent_states.get(i), row) for i in range(layer.number_of_states))
            kvs.append(None)
            states.append((conv, rec) if any(t is not None for t in conv + rec) else None)
        else:
            kv: Any = layer
            kvs.append((kv.keys[row].index_select(1, cols), kv.values[row].index_select(1, cols)))
            states.append(None)
    return RowState(len(cols), tuple(kvs), tuple(states))


def load_states(cache: DynamicCache, rows: list[RowState | None]) -> torch.Tensor:
    """Fill the empty ``cache`` with the rows' states (None: a row starting from nothing, zero
    recurrent state), attention columns right-aligned; returns their attention mask [B, P]."""
    ref = next(s for s in rows if s is not None)
    if not cache.layers:  # HF's lazy all-attention cache
        layers: list[Any] = [DynamicLayer() if kv is not None else LinearAttentionLayer() for kv in ref.kv]
        cache.layers = layers
    end = max(s.length for s in rows if s is not None)
    device = next(t for kv in ref.kv if kv is not None for t in kv).device if any(ref.kv) else None
    mask = torch.zeros(len(rows), end, dtype=torch.long, device=device)
    for i, s in enumerate(rows):
        if s is not None:
            mask[i, end - s.length :] = 1
    for li, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionLayer):
            if ref.states[li] is not None:
                _load_recurrent(layer, [None if s is None else s.states[li] for s in rows])
            continue
        k0, v0 = _some(ref.kv[li])
        keys = k0.new_zeros(len(rows), k0.shape[0], end, k0.shape[2])
        values = v0.new_zeros(len(rows), v0.shape[0], end, v0.shape[2])
        for i, s in enumerate(rows):
            if s is not None:
                k, v = _some(s.kv[li])
                keys[i, :, end - s.length :], values[i, :, end - s.length :] = k, v
        kv_layer: Any = layer
        kv_layer.update(keys, values)
    return mask


def _some(kv: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    assert kv is not None, "rows of one model hold the same layer kinds"
    return kv


def _load_recurrent(layer: LinearAttentionLayer, entries: list[States | None]) -> None:
    ref = next(e for e in entries if e is not None)
    slots: list[tuple[dict[int, Any], dict[int, Any]]] = [
        (layer.conv_states, layer.is_conv_states_initialized),
        (layer.recurrent_states, layer.is_recurrent_states_initialized),
    ]
    for kind, (states, flags) in enumerate(slots):
        for i, t0 in enumerate(ref[kind]):
            if t0 is None:
                continue
            got = [None if e is None else e[kind][i] for e in entries]
            states[i] = torch.stack([t0.new_zeros(t0.shape) if t is None else t for t in got]).clone()
            flags[i] = layer.has_previous_state[i] = True
            layer.device, layer.dtype = t0.device, t0.dtype
            if kind == 0:
                layer.conv_kernel_size[i] = t0.shape[-1]


def _row(t: torch.Tensor | None, row: int) -> torch.Tensor | None:
    return None if t is None else t[row].clone()


def _kv_layer(keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    layer = DynamicLayer()
    layer.update(keys, values)
    return layer


def _state_layer(layer: LinearAttentionLayer, f: Any) -> LinearAttentionLayer:
    """A copy of ``layer`` with ``f`` applied to each of its states (the flags kept)."""
    out = LinearAttentionLayer(number_of_states=layer.number_of_states)
    for i in range(layer.number_of_states):
        for src, dst in (
            (layer.conv_states, out.conv_states),
            (layer.recurrent_states, out.recurrent_states),
        ):
            t = src.get(i)
            dst[i] = None if t is None else f(t)
        out.is_conv_states_initialized[i] = layer.is_conv_states_initialized[i]
        out.is_recurrent_states_initialized[i] = layer.is_recurrent_states_initialized[i]
        out.has_previous_state[i] = layer.has_previous_state[i]
        out.conv_kernel_size[i] = layer.conv_kernel_size[i]
    out.device, out.dtype = layer.device, layer.dtype
    return out


def _join_states(a: LinearAttentionLayer, b: LinearAttentionLayer) -> LinearAttentionLayer:
    """``a``'s rows then ``b``'s, state by state (both initialised alike: one model, one prefill)."""
    out = _state_layer(a, lambda t: t)
    for i in range(a.number_of_states):
        for src, other, dst in (
            (a.conv_states, b.conv_states, out.conv_states),
            (a.recurrent_states, b.recurrent_states, out.recurrent_states),
        ):
            x, y = src.get(i), other.get(i)
            dst[i] = None if x is None or y is None else torch.cat([x, y])
    return out


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` [B, heads, T, D] with zero columns prepended up to ``width``."""
    n = t.shape[2]
    if n == width:
        return t
    return torch.cat([t.new_zeros(t.shape[0], t.shape[1], width - n, t.shape[3]), t], dim=2)
