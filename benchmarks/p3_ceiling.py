"""P3's ceiling on this machine: how fast the P3 batch could be sampled at all, beside HF and ours.

Three arms on one model, batch and dtype (P3's: 16 rows of a 32-token prompt, 32 new tokens each
at temperature 1, no early stop), interleaved (A B C, C B A, ...) after a warm-up, medians:

* **HF** — ``generate`` on one model with merged weights (P3's baseline, ``p3_sampling.py``);
* **ours** — the native sampler, every row on its own rank-8 adapter (P3's "ours");
* **floor** — the arithmetic of the same work and nothing else: no module tree, no LoRA, no cache
  bookkeeping. A plain loop of ``F.linear`` / ``bmm`` calls on the HF model's own weight tensors
  (``q|k|v`` and ``gate|up`` fused into one matrix each), per layer: the prefill (SDPA, causal,
  GQA) and then one step per further token (scores, softmax and values as two batched matmuls
  over a preallocated KV cache written in place), the MLP's ``silu(gate)·up``, the residual adds,
  the layers' and the final RMSNorm (``F.rms_norm``: without them the hidden states of real
  weights overflow), the logits of the last position and the token choice (HF's count: one
  prefill and ``new_tokens - 1`` steps). The choice is the inverse CDF at one uniform per row
  (softmax, cumulative sum, ``searchsorted``: ~1.3 ms for 16 rows of a 49152-token vocabulary
  on this CPU), as the native sampler does; HF's ``multinomial`` draws one exponential per
  vocabulary entry (~20 ms). It leaves out RoPE and
  the q/k norms (elementwise work on the heads that a fused kernel folds into the GEMMs). Qwen3.5's Gated DeltaNet layers are
  approximated: their projections' matmuls, and in a decode step the state's read-out and
  rank-1 update (two batched matmuls on a [64, 64] state per value head); the short convolution,
  the gates and the prefill's recurrence are left out.

Printed: each arm's median (seconds, tok/s), then ``P3`` (HF time ÷ ours), ``ceiling`` (HF time ÷
floor: the highest P3 any sampler could reach here with these kernels) and ``ours/floor`` (ours
time ÷ floor: 1.0 is the floor). ``--cpu-time`` times the process's CPU time (a loaded machine);
``--threads`` sets torch's CPU threads.

    python benchmarks/make_family_model.py --family qwen3 --out Q
    OMP_NUM_THREADS=1 python benchmarks/p3_ceiling.py --model Q --cpu-time --threads 1 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from p3_sampling import p3_arms
from timing import add_device_args, device_of, interleaved, write_json


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    w_in: torch.Tensor  # every projection reading the layer's input, fused
    b_in: torch.Tensor | None
    w_out: torch.Tensor  # o_proj / out_proj
    b_out: torch.Tensor | None
    w_gu: torch.Tensor
    b_gu: torch.Tensor | None
    w_down: torch.Tensor
    b_down: torch.Tensor | None
    kv: int  # index of its K/V in the cache (softmax attention), -1: linear attention
    q_out: int  # width of its query projection (Qwen3.5's holds a gate too)


def _fused(mods: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = torch.cat([m.weight.detach() for m in mods]).contiguous()
    if all(m.bias is None for m in mods):
        return w, None
    parts = [m.bias.detach() if m.bias is not None else w.new_zeros(m.out_features) for m in mods]
    return w, torch.cat(parts)


def _norm_weight(norm: Any) -> torch.Tensor:
    """An RMSNorm's scale: its weight, or ``1 + weight`` for the norms that scale by that."""
    w = norm.weight.detach()
    return 1 + w if type(norm).__name__.startswith(("Qwen3_5", "Gemma")) else w


class Floor:
    """The arithmetic of P3's batch on ``model``'s own weights (the module docstring's "floor")."""

    def __init__(self, model: Any, rows: int, prompt_len: int, new_tokens: int) -> None:
        cfg = model.config
        self.rows, self.prompt_len, self.new_tokens = rows, prompt_len, new_tokens
        self.nq, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nq
        self.scale = self.d**-0.5
        self.embed = model.get_input_embeddings().weight.detach()
        self.w_lm = model.get_output_embeddings().weight.detach()
        self.norm = _norm_weight(model.model.norm)
        self.eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        self.layers: list[_Layer] = []
        n_kv = 0
        for layer in model.model.layers:
            attn = getattr(layer, "self_attn", None) or layer.linear_attn
            out = getattr(attn, "o_proj", None) or attn.out_proj
            ins = [
                m
                for n, m in attn.named_children()
                if isinstance(m, torch.nn.Linear) and n not in ("o_proj", "out_proj")
            ]
            mlp = layer.mlp
            if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
                raise SystemExit(f"{type(mlp).__name__}: the floor covers dense gated MLPs only")
            full = hasattr(attn, "k_proj")
            self.layers.append(
                _Layer(
                    _norm_weight(layer.input_layernorm),
                    _norm_weight(layer.post_attention_layernorm),
                    *_fused(ins),
                    out.weight.detach(),
                    out.bias,
                    *_fused([mlp.gate_proj, mlp.up_proj]),
                    mlp.down_proj.weight.detach(),
                    mlp.down_proj.bias,
                    kv=n_kv if full else -1,
                    q_out=attn.q_proj.out_features if full else 0,
                )
            )
            n_kv += full
        self.inter = self.layers[0].w_gu.shape[0] // 2
        p = self.embed
        cols = prompt_len + new_tokens
        self.cache = p.new_empty(n_kv, 2, rows, self.nkv, cols, self.d)
        # Gated DeltaNet: value heads × [key dim, value dim] per row, on linear-attention layers
        self.hv = getattr(cfg, "linear_num_value_heads", 1)
        self.dk = getattr(cfg, "linear_key_head_dim", 1)
        self.dv = getattr(cfg, "linear_value_head_dim", 1)
        self.hk = getattr(cfg, "linear_num_key_heads", 1)
        n_lin = sum(layer.kv < 0 for layer in self.layers)
        self.state = p.new_zeros(n_lin, rows * self.hv, self.dk, self.dv)

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row at temperature 1 ([B, 1]): the inverse CDF at one uniform per row."""
        cdf = torch.softmax(logits.float(), -1).cumsum_(-1)
        u = torch.rand(cdf.shape[0], 1) * cdf[:, -1:]
        return torch.searchsorted(cdf, u).clamp_(max=cdf.shape[-1] - 1)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _mlp(self, h: torch.Tensor, layer: _Layer) -> torch.Tensor:
        gu = F.linear(self._rms(h, layer.ln2), layer.w_gu, layer.b_gu)
        return h + F.linear(F.silu(gu[:, : self.inter]) * gu[:, self.inter :], layer.w_down, layer.b_down)

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        nq, nkv, D = self.nq, self.nkv, self.d
        h = F.embedding(ids, self.embed).view(B * T, -1)
        for layer in self.layers:
            y = F.linear(self._rms(h, layer.ln1), layer.w_in, layer.b_in)
            if layer.kv >= 0:
                y3 = y.view(B, T, -1)
                q = y3[..., : nq * D].view(B, T, nq, D).transpose(1, 2)
                k0 = layer.q_out
                kc, vc = self.cache[layer.kv, 0], self.cache[layer.kv, 1]
                kc[:, :, :T] = y3[..., k0 : k0 + nkv * D].view(B, T, nkv, D).transpose(1, 2)
                vc[:, :, :T] = y3[..., k0 + nkv * D : k0 + 2 * nkv * D].view(B, T, nkv, D).transpose(1, 2)
                att = F.scaled_dot_product_attention(
                    q, kc[:, :, :T], vc[:, :, :T], is_causal=True, scale=self.scale, enable_gqa=nq > nkv
                )
                att = att.transpose(1, 2).reshape(B * T, nq * D)
            else:  # projections only (see the module docstring)
                att = y[:, : layer.w_out.shape[1]]
            h = self._mlp(h + F.linear(att, layer.w_out, layer.b_out), layer)
        return self._choose(F.linear(self._rms(h.view(B, T, -1)[:, -1], self.norm), self.w_lm))

    def step(self, tok: torch.Tensor, c: int) -> torch.Tensor:
        """One decode step of the tokens ``tok`` ([B, 1]) written at cache column ``c``."""
        B = tok.shape[0]
        nq, nkv, D = self.nq, self.nkv, self.d
        rep, L = nq // nkv, c + 1
        h = F.embedding(tok[:, 0], self.embed)
        lin = 0
        for layer in self.layers:
            y = F.linear(self._rms(h, layer.ln1), layer.w_in, layer.b_in)
            if layer.kv >= 0:
                k0 = layer.q_out
                kc, vc = self.cache[layer.kv, 0], self.cache[layer.kv, 1]
                kc[:, :, c] = y[:, k0 : k0 + nkv * D].view(B, nkv, D)
                vc[:, :, c] = y[:, k0 + nkv * D : k0 + 2 * nkv * D].view(B, nkv, D)
                q = y[:, : nq * D].reshape(B * nkv, rep, D)
                k3 = kc[:, :, :L].reshape(B * nkv, L, D)
                v3 = vc[:, :, :L].reshape(B * nkv, L, D)
                scores = torch.bmm(q, k3.transpose(1, 2)).mul_(self.scale)
                att = torch.bmm(torch.softmax(scores, -1), v3).view(B, nq * D)
            else:  # the state's read-out and rank-1 update per value head (see the module docstring)
                s = self.state[lin]
                lin += 1
                qk = y[:, : self.hv * self.dk].reshape(B * self.hv, 1, self.dk)
                v0 = 2 * self.hk * self.dk
                v = y[:, v0 : v0 + self.hv * self.dv].reshape(B * self.hv, 1, self.dv)
                att = torch.bmm(qk, s).view(B, self.hv * self.dv)
                s.baddbmm_(qk.transpose(1, 2), v)
            h = self._mlp(h + F.linear(att, layer.w_out, layer.b_out), layer)
        return self._choose(F.linear(self._rms(h, self.norm), self.w_lm))

    @torch.inference_mode()
    def generate(self, ids: torch.Tensor) -> torch.Tensor:
        self.state.zero_()
        tok = self.prefill(ids)
        out = [tok]
        for s in range(self.new_tokens - 1):
            tok = self.step(tok, self.prompt_len + s)
            out.append(tok)
        return torch.cat(out, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--adapters", type=int, default=16, help="rows, each on its own adapter")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    add_device_args(ap)
    args = ap.parse_args()
    if args.device != "cpu":
        raise SystemExit("the floor is a CPU measurement: --device cpu only")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    args.backend, args.no_lean = "native", False  # what p3_arms reads of P3's options
    dev, dtype = device_of(args)
    p3 = p3_arms(args, dev, dtype)
    floor = Floor(p3.hf, args.adapters, args.prompt_len, args.new_tokens)
    x = torch.tensor(p3.prompts)
    assert floor.generate(x).shape == (args.adapters, args.new_tokens)
    times = interleaved(
        {"HF": p3.theirs, "ours": p3.ours, "floor": lambda: floor.generate(x)}, args.repeats, 1
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    n = args.adapters * args.new_tokens
    print(
        f"model {args.model}, {args.dtype}, {torch.get_num_threads()} threads, "
        f"{'CPU' if args.cpu_time else 'wall'} time: {args.adapters} rows × {args.new_tokens} new tokens"
    )
    for k, t in med.items():
        print(f"  {k:<6} {n / t:8.1f} tok/s  (median {t:.3f}s of {[round(s, 3) for s in times[k]]})")
    res = {
        "P3": med["HF"] / med["ours"],
        "ceiling": med["HF"] / med["floor"],
        "ours/floor": med["ours"] / med["floor"],
    }
    write_json(args, {**res, "seconds": med})
    print("  ".join(f"{k} {v:.2f}" for k, v in res.items()))


if __name__ == "__main__":
    main()
