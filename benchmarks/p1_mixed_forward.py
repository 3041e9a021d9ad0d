"""P1: the cost of mixing many adapters in one forward batch (docs/DESIGN.md, "Performance targets").

What it measures: the wall-clock time of one no-grad forward of a batch of ``B`` rows in which every
row goes through a DIFFERENT LoRA adapter (K = B, all rank ``r``), divided by the time of the same
batch with every row on ONE adapter. Ideal 1.0, target ≤ 1.10: a multi-tenant server only works if
serving sixteen users in one batch costs about what serving one user sixteen rows does.

Which engine path: the headline ``P1`` uses the sampler's path, ``engine.routing(policies)`` around
``engine.base.model(input_ids=...)`` (a prefill: logits for every position, no loss). The trainer's
forward-only path, ``forward_backward_many`` with ``backward=False`` requests (which adds the padded
batch assembly, ``logsumexp`` and per-row losses), is timed as well and printed as ``P1engine``.

The comparison: ``peft``'s own mixed-batch inference — a separate HF copy of the same base model
wrapped as a ``PeftModel`` holding the same K adapters (exported with ``engine.export_peft``), called
with ``adapter_names=[...]`` per row. peft loops over the distinct adapters in every LoRA layer
(one gather, two matmuls and one scatter-add per adapter per layer), so its cost grows with K; ours
gathers each row's A and B and does two batched matmuls. ``P1peft`` is ``peft_time / our_time`` for
the mixed batch (target ≥ 3 at K = 16); ``P1peftself`` is peft's own mixed ÷ single-adapter
(``set_adapter``) time, for context. Once, before timing, our mixed logits are compared with
peft's (max abs difference printed): the two must compute the same function.

The adapters get random non-zero B matrices (a fresh adapter has B = 0), so the LoRA path computes
something real and the logits comparison is meaningful. Runs are interleaved (alternating order
each round, so slow drift of a noisy machine affects all alternatives alike) and medians are quoted.

Sizes: the defaults (B = 16, T = 128) take well under a minute on ``opentinker/tiny``. On a 2-core
CPU, SmolLM2-135M at B = 16 × 128 takes ~7 s per forward on one thread; use e.g.
``--model HuggingFaceTB/SmolLM2-135M-Instruct --seq 32 --repeats 5`` to stay within a few minutes.
On a shared machine add ``--threads 1``: two OpenMP threads on two busy cores stall each other and
make single runs 2-10x slower at random (torch's thread count is otherwise left at its default).
``--device cuda`` (and ``--dtype bfloat16``) runs it on an accelerator, ``--json`` writes the
ratios and the table (``benchmarks/device_check.py`` does both). The last line printed is
``P1 <mixed/single>``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from timing import add_device_args, device_of, interleaved, medians_ms, print_table, write_json

from opentinker.engine import Engine
from opentinker.engine.types import Example, ForwardRequest
from opentinker.lora import LoRAConfig


def randomize_b(engine: Engine, adapter_id: str, gen: torch.Generator, std: float) -> None:
    """Give an adapter non-zero B matrices (in place), so its LoRA delta is not identically zero."""
    weights = engine.adapter_weights(adapter_id)
    with torch.no_grad():
        for b in weights.b.values():
            b.copy_(torch.randn(b.shape, generator=gen) * std)


def build_peft_model(
    engine: Engine, adapter_ids: list[str], workdir: Path, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """A separate HF copy of the base model wrapped as a PeftModel holding the same adapters."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(engine.base.path, dtype=dtype, attn_implementation="sdpa")
    hf.to(engine.device).eval()
    model = None
    with warnings.catch_warnings():  # peft warns that lm_head is tied to the embeddings: we only run it
        warnings.simplefilter("ignore")
        for aid in adapter_ids:
            folder = engine.export_peft(aid, workdir / aid)
            if model is None:
                model = PeftModel.from_pretrained(hf, str(folder), adapter_name=aid)
            else:
                model.load_adapter(str(folder), adapter_name=aid)
    assert model is not None
    model.to(engine.device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="opentinker/tiny")
    ap.add_argument("--batch", type=int, default=16, help="rows B; the mixed batch uses K = B adapters")
    ap.add_argument("--seq", type=int, default=128, help="tokens per row")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7, help="timed runs of each alternative")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs of each alternative first")
    ap.add_argument("--b-std", type=float, default=0.01, help="std of the random LoRA B weights")
    ap.add_argument("--no-peft", action="store_true", help="skip the peft comparison")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (default 0: leave torch's own default)"
    )
    add_device_args(ap)
    args = ap.parse_args()
    dev, dtype = device_of(args)

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    engine = Engine(args.model, device=dev, dtype=dtype)
    ids = [engine.create_adapter(LoRAConfig(rank=args.rank, seed=args.seed + k)) for k in range(args.batch)]
    for aid in ids:
        randomize_b(engine, aid, gen, args.b_std)
    tokens_cpu = torch.randint(0, engine.vocab_size, (args.batch, args.seq), generator=gen)
    tokens = tokens_cpu.to(dev)  # the routed forward's input; the engine moves datums itself
    examples = [
        Example(
            tokens_cpu[i], {"target_tokens": torch.roll(tokens_cpu[i], -1), "weights": torch.ones(args.seq)}
        )
        for i in range(args.batch)
    ]
    mixed_policies: list[str | None] = list(ids)
    single_policies: list[str | None] = [ids[0]] * args.batch

    def routed(policies: list[str | None]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with torch.no_grad(), engine.routing(policies):
                return engine.base.model(input_ids=tokens, use_cache=False).logits

        return run

    def requests(policies: list[str | None]) -> Callable[[], object]:
        reqs = [ForwardRequest(p, [ex], backward=False) for p, ex in zip(policies, examples, strict=True)]

        def run() -> object:
            out = engine.forward_backward_many(reqs)
            bad = [r for r in out if isinstance(r, Exception)]
            if bad:
                raise bad[0]
            return out

        return run

    alternatives: dict[str, Callable[[], object]] = {
        "ours single (routing)": routed(single_policies),
        "ours mixed (routing)": routed(mixed_policies),
        "ours single (fwd_bwd_many, no bwd)": requests(single_policies),
        "ours mixed (fwd_bwd_many, no bwd)": requests(mixed_policies),
    }

    if not args.no_peft:
        with tempfile.TemporaryDirectory(prefix="p1-peft-") as tmp:
            peft_model = build_peft_model(engine, ids, Path(tmp), dtype)

        def peft_run(names: list[str] | None) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                with torch.no_grad():
                    if names is None:
                        return peft_model(input_ids=tokens, use_cache=False).logits
                    return peft_model(input_ids=tokens, use_cache=False, adapter_names=names).logits

            return run

        peft_model.set_adapter(ids[0])  # type: ignore[operator]
        alternatives["peft mixed (adapter_names)"] = peft_run(list(ids))
        alternatives["peft single (set_adapter)"] = peft_run(None)
        ours_mixed = alternatives["ours mixed (routing)"]().float()  # type: ignore[union-attr]
        theirs_mixed = alternatives["peft mixed (adapter_names)"]().float()  # type: ignore[union-attr]
        ours_single = alternatives["ours single (routing)"]().float()  # type: ignore[union-attr]
        theirs_single = alternatives["peft single (set_adapter)"]().float()  # type: ignore[union-attr]
        diff_mixed = float((ours_mixed - theirs_mixed).abs().max())  # type: ignore[operator]
        diff_single = float((ours_single - theirs_single).abs().max())  # type: ignore[operator]
        scale = float(ours_mixed.abs().max())  # type: ignore[union-attr]
        print(
            f"check: max |ours - peft| logits: mixed {diff_mixed:.2e}, single {diff_single:.2e} "
            f"(max |logit| {scale:.2f})"
        )

    print(
        f"model {args.model}: B={args.batch} rows x T={args.seq} tokens, rank {args.rank}, "
        f"K={args.batch} adapters in the mixed batch; {args.warmup} warm-up + {args.repeats} timed runs each, "
        f"{torch.get_num_threads()} threads, {dev} {args.dtype}; setup {time.perf_counter() - t0:.1f} s"
    )
    times = interleaved(alternatives, args.repeats, args.warmup, dev)
    print_table(times, "ours single (routing)")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    p1 = med["ours mixed (routing)"] / med["ours single (routing)"]
    p1_engine = med["ours mixed (fwd_bwd_many, no bwd)"] / med["ours single (fwd_bwd_many, no bwd)"]
    results: dict[str, object] = {"P1": p1, "P1engine": p1_engine, "B": args.batch, "T": args.seq}
    print(f"P1engine {p1_engine:.2f}")
    if not args.no_peft:
        results["P1peftself"] = med["peft mixed (adapter_names)"] / med["peft single (set_adapter)"]
        results["P1peft"] = med["peft mixed (adapter_names)"] / med["ours mixed (routing)"]
        results["max_abs_logit_diff_vs_peft"] = {
            "mixed": diff_mixed,
            "single": diff_single,
            "max_logit": scale,
        }
        print(f"P1peftself {results['P1peftself']:.2f}")
        print(f"P1peft {results['P1peft']:.2f}")
    write_json(args, {**results, "median_ms": medians_ms(times)})
    print(f"P1 {p1:.2f}")


if __name__ == "__main__":
    main()
