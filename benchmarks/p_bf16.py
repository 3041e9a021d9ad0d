"""bf16 ÷ fp32: P2 (a fused multi-adapter training step) and P3 (multi-adapter sampling) with the
frozen base in bfloat16 against the same base in float32, side by side in one run.

Two engines over the same model — one loaded in float32, one in bfloat16 — each with the same K
adapters (LoRA weights, gradients and optimizer state are fp32 in both). Per round, interleaved
(fp32, bf16, then bf16, fp32, ...; after warm-ups on each):

- P2: one fused ``forward_backward_many`` over K adapters × b rows of T tokens plus each adapter's
  ``optim_step`` (``benchmarks/p2_fused_train.py``'s fused step);
- P3: the native KV-cache sampler on K prompts, each row on its own adapter, ``--new-tokens``
  tokens each at temperature 1 (``benchmarks/p3_sampling.py``'s "ours"), no prefix cache.

Printed: each median, and the speed ratios ``P2 bf16/fp32`` and ``P3 bf16/fp32`` (fp32 time ÷
bf16 time: > 1 means bf16 is faster; docs/DESIGN.md "Performance targets": ≥ 1.6 on SmolLM2). Also the sampler's
agreement with the trainer on the bf16 base (mean and max |Δlogprob| and the tinker-cookbook's
``kl_sample_train_v1``, the mean of sampler minus trainer logprob over sampled tokens).

    python benchmarks/p_bf16.py --model opentinker/tiny --threads 1
    python benchmarks/p_bf16.py --model HuggingFaceTB/SmolLM2-135M-Instruct --seq 64 --repeats 5 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from timing import add_device_args, check, device_of, interleaved, write_json

from opentinker.engine import Engine
from opentinker.engine.types import AdamParams, Example, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams


def build(model: str, dev: torch.device, dtype: torch.dtype, k: int, rank: int) -> tuple[Engine, list[str]]:
    """An engine over ``model`` in ``dtype`` with K adapters whose B is non-zero (every adapter
    changes the function, so the sampler really applies K different LoRAs)."""
    engine = Engine(model, device=dev, dtype=dtype)
    ids = [engine.create_adapter(LoRAConfig(rank=rank, seed=i)) for i in range(k)]
    gen = torch.Generator().manual_seed(0)  # the same B values in both engines
    for aid in ids:
        for t in engine.adapter_weights(aid).b.values():
            with torch.no_grad():
                t.copy_(torch.randn(t.shape, generator=gen) * 0.01)
    return engine, ids


def train_step(engine: Engine, ids: list[str], examples: list[Example], b: int) -> Callable[[], None]:
    reqs = [ForwardRequest(aid, examples[i * b : (i + 1) * b]) for i, aid in enumerate(ids)]
    adam = AdamParams(learning_rate=1e-6)  # tiny: the weights (and so the sampler's work) stay put

    def run() -> None:
        check(engine.forward_backward_many(reqs))
        for aid in ids:
            engine.optim_step(aid, adam)

    return run


def sample_step(
    engine: Engine, ids: list[str], prompts: list[list[int]], new_tokens: int
) -> tuple[NativeBackend, list[SampleRequest], Callable[[], None]]:
    sampler = NativeBackend(engine, prefix_cache_bytes=0)
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=0, stop=[])
    reqs = [SampleRequest(aid, p, params) for aid, p in zip(ids, prompts, strict=True)]

    def run() -> None:
        res = sampler.generate(reqs)
        assert all(not isinstance(r, Exception) and len(r.sequences[0].tokens) == new_tokens for r in res)

    return sampler, reqs, run


def agreement(engine: Engine, sampler: NativeBackend, reqs: list[SampleRequest]) -> dict[str, float]:
    """Sampled tokens' logprobs (sampler) against ``forward`` on the same weights (trainer)."""
    diffs = []
    for req, res in zip(reqs, sampler.generate(reqs), strict=True):
        assert not isinstance(res, Exception)
        seq = res.sequences[0]
        toks = req.prompt + seq.tokens
        ex = Example(torch.tensor(toks[:-1]), {"target_tokens": torch.tensor(toks[1:])})
        out = engine.forward_backward(ForwardRequest(req.policy, [ex], backward=False)).outputs[0]
        diffs.append(torch.tensor(seq.logprobs) - out["logprobs"][len(req.prompt) - 1 :].cpu())
    d = torch.cat(diffs).double()
    return {
        "mean_abs": float(d.abs().mean()),
        "max_abs": float(d.abs().max()),
        "kl_sample_train_v1": float(d.mean()),
        "kl_sample_train_v2": float(0.5 * (d**2).mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="opentinker/tiny")
    ap.add_argument("--adapters", "-k", type=int, default=8, help="K adapters (P2 and P3)")
    ap.add_argument("--rows", "-b", type=int, default=2, help="P2: b rows per adapter")
    ap.add_argument("--seq", type=int, default=128, help="P2: tokens per row")
    ap.add_argument("--prompt-len", type=int, default=32, help="P3: prompt tokens per row")
    ap.add_argument("--new-tokens", type=int, default=32, help="P3: sampled tokens per row")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    add_device_args(ap)
    args = ap.parse_args()
    dev, _ = device_of(args)  # --dtype is ignored: both are run
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    engines = {name: build(args.model, dev, dt, args.adapters, args.rank) for name, dt in
               (("fp32", torch.float32), ("bf16", torch.bfloat16))}  # fmt: skip
    g = torch.Generator().manual_seed(0)
    vocab, k, b, t = engines["fp32"][0].vocab_size, args.adapters, args.rows, args.seq
    tokens = torch.randint(3, vocab, (k * b, t), generator=g)
    examples = [
        Example(tokens[i], {"target_tokens": torch.roll(tokens[i], -1), "weights": torch.ones(t)})
        for i in range(k * b)
    ]
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(k)]
    p2 = {f"P2 {n}": train_step(e, ids, examples, b) for n, (e, ids) in engines.items()}
    samplers = {n: sample_step(e, ids, prompts, args.new_tokens) for n, (e, ids) in engines.items()}
    p3 = {f"P3 {n}": s[2] for n, s in samplers.items()}
    print(
        f"model {args.model} on {dev}, {torch.get_num_threads()} threads: K={k} adapters (rank {args.rank}); "
        f"P2 {k}x{b} rows x {t} tokens; P3 {k} rows, prompt {args.prompt_len}, {args.new_tokens} new "
        f"tokens; {args.warmup} warm-up + {args.repeats} timed each; setup {time.perf_counter() - t0:.1f} s"
    )
    times = interleaved({**p2, **p3}, args.repeats, args.warmup, dev)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        print(
            f"  {name:<10} median {med[name] * 1e3:9.1f} ms  (min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f})"
        )
    bf16_engine = engines["bf16"][0]
    agree = agreement(bf16_engine, samplers["bf16"][0], samplers["bf16"][1])
    fp32_agree = agreement(engines["fp32"][0], samplers["fp32"][0], samplers["fp32"][1])
    print(
        f"  sampler vs trainer, bf16 base: mean |dlogprob| {agree['mean_abs']:.2e}, max {agree['max_abs']:.2e}, "
        f"kl_sample_train_v1 {agree['kl_sample_train_v1']:.2e}, v2 {agree['kl_sample_train_v2']:.2e} "
        f"(fp32 base: mean {fp32_agree['mean_abs']:.2e}, max {fp32_agree['max_abs']:.2e})"
    )
    ratios = {"P2": med["P2 fp32"] / med["P2 bf16"], "P3": med["P3 fp32"] / med["P3 bf16"]}
    write_json(args, {**ratios, "agreement_bf16": agree, "agreement_fp32": fp32_agree,
                      "median_ms": {n: m * 1e3 for n, m in med.items()}})  # fmt: skip
    print(
        f"P2 bf16/fp32 {ratios['P2']:.2f}   P3 bf16/fp32 {ratios['P3']:.2f}   (speed: fp32 time / bf16 time)"
    )


if __name__ == "__main__":
    main()
