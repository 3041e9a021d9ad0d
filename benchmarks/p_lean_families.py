"""The sampler's lean forward ÷ HF's forward, every family on one shape, side by side in one process.

Each family is a random model of ``make_family_model.py``'s ``small`` shape (hidden 256, 4 layers,
8/2 heads of 32, MLP 768; its own norms, biases and windows). The same batch (16 rows, each on
its own rank-8 adapter with non-zero B, 32-token prompts, 32 new tokens at temperature 1, no
early stop, no prefix cache) is sampled by ``NativeBackend`` on the lean path and by
``NativeBackend(lean_decode=False)`` (HF's module tree and ``DynamicCache``, the same LoRA
routing). Every alternative of every family runs in one interleaved round (A B C ..., then
reversed) after a warm-up, and medians are quoted: ``ratio`` = HF time ÷ lean time (> 1: the lean
path is faster). A family the lean path does not cover prints why (``NativeBackend.lean_reason``)
and is not timed: both would run HF's forward.

    OMP_NUM_THREADS=1 python benchmarks/p_lean_families.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable

import torch
from make_family_model import build
from timing import check, interleaved

from opentinker.engine import Engine
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams

FAMILIES = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "phi3",
    "olmo2",
    "granite",
    "gpt2",
    "qwen3_5_text",
]


def _setup(family: str, folder: str, args: argparse.Namespace) -> tuple[NativeBackend, list[SampleRequest]]:
    base = load_base_model(build(family, "small", folder))
    engine = Engine(base, max_rank=8)
    ids = [engine.create_adapter(LoRAConfig(rank=8, seed=i)) for i in range(args.rows)]
    with torch.no_grad():
        for aid in ids:
            for t in engine.adapter_weights(aid).b.values():
                t.normal_(std=0.01)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, base.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in ids]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=0, stop=[])
    return NativeBackend(engine, prefix_cache_bytes=0), [
        SampleRequest(a, p, params) for a, p in zip(ids, prompts, strict=True)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="*", default=FAMILIES)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    runs: dict[str, Callable[[], object]] = {}
    skipped: dict[str, str] = {}
    tmp = tempfile.mkdtemp(prefix="lean-families-")
    for family in args.families:
        lean, reqs = _setup(family, f"{tmp}/{family}", args)
        if lean.lean_reason is not None:
            skipped[family] = lean.lean_reason
            continue
        hf = NativeBackend(lean.engine, lean_decode=False, prefix_cache_bytes=0)
        runs[f"{family}/lean"] = lambda s=lean, r=reqs: check(s.generate(r))
        runs[f"{family}/hf"] = lambda s=hf, r=reqs: check(s.generate(r))
    times = interleaved(runs, args.repeats, warmup=1)
    tokens = args.rows * args.new_tokens
    print(
        f"{args.rows} rows on {args.rows} adapters, {args.prompt_len}-token prompts, {args.new_tokens} new tokens"
    )
    print(f"{'family':<14} {'lean tok/s':>11} {'HF tok/s':>10} {'ratio':>7}")
    for family in args.families:
        if family in skipped:
            print(f"{family:<14} {'—':>11} {'—':>10} {'—':>7}  HF forward only: {skipped[family]}")
            continue
        tl, th = (statistics.median(times[f"{family}/{k}"]) for k in ("lean", "hf"))
        print(f"{family:<14} {tokens / tl:>11.1f} {tokens / th:>10.1f} {th / tl:>7.2f}")


if __name__ == "__main__":
    main()
