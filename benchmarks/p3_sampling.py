"""P3: sampling throughput with K distinct adapters in one batch ÷ HF ``generate`` on merged weights.

The baseline is the best a per-adapter stack can do for one batch: a plain HF model whose LoRA is
merged into its weights (no LoRA cost at all), generating the same batch with ``generate``. Ours
samples the same batch with every row on a *different* adapter, through the native KV-cache
backend. Both produce exactly ``--new-tokens`` tokens per row (no early stop) at temperature 1.
Runs are interleaved (ours, HF, ours, HF, ...) and medians quoted; the last line is ``P3 <ratio>``
(ours tokens/s ÷ HF tokens/s; docs/DESIGN.md's target ≥ 1.5 on the tiny model, ≥ 1.0 on SmolLM2).
``--backend vllm`` adds vLLM's engine (runtime LoRA, one ``LoRARequest`` per adapter's snapshot) on
the same adapters and prompts, interleaved with the others, and prints native ÷ vLLM tokens/s
(``P3-vllm``); the adapters then leave the unembedding untrained (vLLM's LoRA does not serve it).
``--device cuda`` (and ``--dtype bfloat16``) runs both on an accelerator (each timed run ends with
a device synchronisation); ``--json`` writes the ratio and the tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from timing import add_device_args, clock, device_of, sync, write_json
from transformers import AutoModelForCausalLM

from opentinker.engine import Engine
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams

RANK = 8  # every adapter's LoRA rank


@dataclass
class P3Arms:
    """P3's arms (:func:`p3_arms`) and what they were built from."""

    ours: Callable[[], float]
    theirs: Callable[[], float]
    engine: Engine
    ids: list[str]
    prompts: list[list[int]]
    params: SamplingParams
    hf: Any


def p3_arms(args: argparse.Namespace, dev: torch.device, dtype: torch.dtype) -> P3Arms:
    """P3's two timed arms on ``args``' model, batch and dtype: ours (every row on its own adapter,
    the native sampler) and HF ``generate`` on one model (merged weights), each returning its
    seconds; plus the engine, the adapters, the prompts and the HF model."""
    torch.manual_seed(0)
    base = load_base_model(args.model, dtype=dtype, device=dev)
    engine = Engine(base, dtype=dtype)
    unembed = args.backend == "native"
    ids = [
        engine.create_adapter(LoRAConfig(rank=RANK, seed=i, train_unembed=unembed))
        for i in range(args.adapters)
    ]
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
        t = clock()
        res = sampler.generate(reqs)
        sync(dev)
        dt = clock() - t
        assert all(
            not isinstance(r, Exception) and len(r.sequences[0].tokens) == args.new_tokens for r in res
        )
        return dt

    @torch.no_grad()
    def theirs() -> float:
        t = clock()
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
        dt = clock() - t
        assert out.shape[1] == args.prompt_len + args.new_tokens
        return dt

    return P3Arms(ours, theirs, engine, ids, prompts, params, hf)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="opentinker/tiny")
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--no-lean", action="store_true", help="sample through the HF module tree, not the lean forward"
    )
    ap.add_argument("--backend", choices=("native", "vllm"), default="native")
    ap.add_argument("--vllm-memory", type=float, default=0.15, help="vLLM's gpu_memory_utilization")
    add_device_args(ap)
    args = ap.parse_args()
    if args.cpu_time and args.backend == "vllm":
        raise SystemExit("--cpu-time counts this process only: vLLM computes in processes of its own")
    dev, dtype = device_of(args)
    p3 = p3_arms(args, dev, dtype)
    engine, ids, prompts, params = p3.engine, p3.ids, p3.prompts, p3.params
    ours, theirs = p3.ours, p3.theirs
    runs: list[Callable[[], float]] = [ours, theirs]
    if args.backend == "vllm":
        from opentinker.sampling.vllm_backend import VLLMBackend

        snaps = [engine.snapshot(aid).snapshot_id for aid in ids]
        vllm = VLLMBackend.for_engine(
            engine,
            measure_mismatch=False,
            max_loras=args.adapters,
            max_lora_rank=RANK,  # the adapters' own rank: vLLM computes every adapter at max_lora_rank
            gpu_memory_utilization=args.vllm_memory,
        )
        vreqs = [SampleRequest(sid, p, params) for sid, p in zip(snaps, prompts, strict=True)]

        def theirs_vllm() -> float:
            t = clock()
            res = vllm.generate(vreqs)
            dt = clock() - t
            assert all(
                not isinstance(r, Exception) and len(r.sequences[0].tokens) == args.new_tokens for r in res
            ), res
            return dt

        runs.append(theirs_vllm)
    for run in runs:  # warm-up
        run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(args.repeats):
        for run, ts in zip(runs, times, strict=True):
            ts.append(run())
    n_tokens = args.adapters * args.new_tokens
    ta, tb = statistics.median(times[0]), statistics.median(times[1])
    print(
        f"model {args.model}: batch {args.adapters} rows, {args.adapters} distinct adapters, {args.new_tokens} new tokens each"
    )
    print(
        f"  ours (K={args.adapters} adapters, native KV cache): {n_tokens / ta:8.1f} tok/s  (median {ta:.3f}s)"
    )
    print(f"  HF generate (merged weights, 1 model):  {n_tokens / tb:8.1f} tok/s  (median {tb:.3f}s)")
    rates = {"ours": n_tokens / ta, "hf_generate": n_tokens / tb}
    result: dict[str, object] = {"P3": tb / ta, "tokens_per_s": rates}
    if args.backend == "vllm":
        tv = statistics.median(times[2])
        rates["vllm"] = n_tokens / tv
        result["P3-vllm"] = tv / ta
        print(
            f"  vLLM (K={args.adapters} LoRARequests, its own engine): {n_tokens / tv:8.1f} tok/s  (median {tv:.3f}s)"
        )
        print(f"P3-vllm {tv / ta:.2f}  (native tok/s / vLLM tok/s)")
    write_json(args, result)
    print(f"P3 {tb / ta:.2f}")


if __name__ == "__main__":  # vLLM's engine starts child processes: keep the guard
    main()
