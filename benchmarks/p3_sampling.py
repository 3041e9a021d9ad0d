"""P3: sampling throughput with K distinct adapters in one batch ÷ HF ``generate`` on merged weights.

The baseline is the best a per-adapter stack can do for one batch: a plain HF model whose LoRA is
merged into its weights (no LoRA cost at all), generating the same batch with ``generate``. Ours
samples the same batch with every row on a *different* adapter, through the native KV-cache
backend. Both produce exactly ``--new-tokens`` tokens per row (no early stop) at temperature 1.
Runs are interleaved (ours, HF, ours, HF, ...) and medians quoted; the last line is ``P3 <ratio>``
(ours tokens/s ÷ HF tokens/s; DESIGN.md §6 target ≥ 1.5 on the tiny model, ≥ 1.0 on SmolLM2).
``--device cuda`` (and ``--dtype bfloat16``) runs both on an accelerator (each timed run ends with
a device synchronisation); ``--json`` writes the ratio and the tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from timing import add_device_args, device_of, sync, write_json
from transformers import AutoModelForCausalLM

from opentinker.engine import Engine
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="opentinker/tiny")
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--no-lean", action="store_true", help="sample through the HF module tree, not the lean Llama path"
    )
    add_device_args(ap)
    args = ap.parse_args()
    dev, dtype = device_of(args)
    torch.manual_seed(0)

    base = load_base_model(args.model, dtype=dtype, device=dev)
    engine = Engine(base, dtype=dtype)
    ids = [engine.create_adapter(LoRAConfig(rank=8, seed=i)) for i in range(args.adapters)]
    for aid in ids:  # non-zero B so every adapter really changes the function
        for t in engine.adapter_weights(aid).b.values():
            with torch.no_grad():
                t.normal_(std=0.01)
    # no prefix cache: HF prefills every call, so ours does too (the prompts repeat call to call)
    sampler = NativeBackend(engine, lean_decode=not args.no_lean, prefix_cache_bytes=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, base.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in ids]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=0, stop=[])
    reqs = [SampleRequest(aid, p, params) for aid, p in zip(ids, prompts, strict=True)]

    hf = AutoModelForCausalLM.from_pretrained(base.path, dtype=dtype).to(dev).eval()  # "merged" weights
    x = torch.tensor(prompts, device=dev)

    def ours() -> float:
        t = time.perf_counter()
        res = sampler.generate(reqs)
        sync(dev)
        dt = time.perf_counter() - t
        assert all(
            not isinstance(r, Exception) and len(r.sequences[0].tokens) == args.new_tokens for r in res
        )
        return dt

    @torch.no_grad()
    def theirs() -> float:
        t = time.perf_counter()
        out = hf.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            pad_token_id=0,
        )
        sync(dev)
        dt = time.perf_counter() - t
        assert out.shape[1] == args.prompt_len + args.new_tokens
        return dt

    ours(), theirs()  # warm-up
    a, b = [], []
    for _ in range(args.repeats):
        a.append(ours())
        b.append(theirs())
    n_tokens = args.adapters * args.new_tokens
    ta, tb = statistics.median(a), statistics.median(b)
    print(
        f"model {args.model}: batch {args.adapters} rows, {args.adapters} distinct adapters, {args.new_tokens} new tokens each"
    )
    print(
        f"  ours (K={args.adapters} adapters, native KV cache): {n_tokens / ta:8.1f} tok/s  (median {ta:.3f}s)"
    )
    print(f"  HF generate (merged weights, 1 model):  {n_tokens / tb:8.1f} tok/s  (median {tb:.3f}s)")
    write_json(args, {"P3": tb / ta, "tokens_per_s": {"ours": n_tokens / ta, "hf_generate": n_tokens / tb}})
    print(f"P3 {tb / ta:.2f}")


if __name__ == "__main__":
    main()
