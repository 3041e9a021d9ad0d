"""P2: fused multi-adapter training steps versus one adapter, and versus one adapter at a time.

What it measures (target: docs/DESIGN.md): the wall-clock time of one fused training step over K adapters —
ONE ``forward_backward_many`` call holding K requests of ``b`` rows each (one forward, one backward
over all K·b rows) followed by each adapter's ``optim_step`` — divided by the time of the same K·b
rows trained as one request on ONE adapter (one ``forward_backward_many`` + one ``optim_step``).
Ideal 1.0, target ≤ 1.10: training K tenants together should cost about what training one tenant
on the same number of rows does; only the K small optimizer steps and the per-row gather of LoRA
weights are extra.

It also times the alternative a naive server would use: K SEQUENTIAL single-adapter steps (K
separate ``forward_backward_many`` calls of ``b`` rows, each followed by its ``optim_step``), and
prints ``P2seq <sequential/fused>`` (target ≥ 1.5): fusing is the point of the engine, because
small per-adapter batches waste the hardware (on an accelerator; on a compute-bound CPU the gain
is smaller, since per-token work dominates).

Rows are random tokens with next-token targets and unit weights (``cross_entropy``); the data is
fixed and the same for all three alternatives. Runs are interleaved (order reversed every other
round, so drift of a noisy machine hits all alike) after warm-up runs; medians are quoted.

Sizes: the defaults (K = 8, b = 2, T = 128) take about a minute on ``opentinker/tiny``. On a 2-core
CPU SmolLM2-135M needs about half a minute for one fused step of 16 × 128 tokens; use e.g.
``--model HuggingFaceTB/SmolLM2-135M-Instruct --seq 32 --repeats 5`` to stay within a few minutes.
On a shared machine add ``--threads 1``: two OpenMP threads on two busy cores stall each other and
make single runs 2-10x slower at random (torch's thread count is otherwise left at its default).
``--device cuda`` (and ``--dtype bfloat16``) runs it on an accelerator, ``--json`` writes the
ratios and the table. The last line printed is ``P2 <fused/one-adapter>``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from timing import add_device_args, check, device_of, interleaved, medians_ms, print_table, write_json

from opentinker.engine import Engine
from opentinker.engine.types import AdamParams, Example, ForwardRequest
from opentinker.lora import LoRAConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="opentinker/tiny")
    ap.add_argument("--adapters", "-k", type=int, default=8, help="K adapters in the fused step")
    ap.add_argument("--rows", "-b", type=int, default=2, help="b rows per adapter")
    ap.add_argument("--seq", type=int, default=128, help="tokens per row")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--repeats", type=int, default=7, help="timed runs of each alternative")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs of each alternative first")
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
    k, b, t = args.adapters, args.rows, args.seq
    t0 = time.perf_counter()
    engine = Engine(args.model, device=dev, dtype=dtype)
    ids = [engine.create_adapter(LoRAConfig(rank=args.rank, seed=args.seed + i)) for i in range(k)]
    solo = engine.create_adapter(LoRAConfig(rank=args.rank, seed=args.seed + k))
    tokens = torch.randint(0, engine.vocab_size, (k * b, t), generator=gen)
    examples = [
        Example(tokens[i], {"target_tokens": torch.roll(tokens[i], -1), "weights": torch.ones(t)})
        for i in range(k * b)
    ]
    per_adapter = [examples[i * b : (i + 1) * b] for i in range(k)]
    adam = AdamParams(learning_rate=args.lr)

    fused_reqs = [ForwardRequest(aid, ex) for aid, ex in zip(ids, per_adapter, strict=True)]
    one_req = ForwardRequest(solo, examples)

    def fused() -> None:
        check(engine.forward_backward_many(fused_reqs))
        for aid in ids:
            engine.optim_step(aid, adam)

    def one_adapter() -> None:
        check(engine.forward_backward_many([one_req]))
        engine.optim_step(solo, adam)

    def sequential() -> None:
        for req in fused_reqs:
            check(engine.forward_backward_many([req]))
            engine.optim_step(str(req.policy), adam)

    alternatives: dict[str, Callable[[], object]] = {
        f"one adapter, {k * b} rows, 1 optim_step": one_adapter,
        f"fused: {k} adapters x {b} rows, {k} optim_steps": fused,
        f"sequential: {k} x (fwd_bwd {b} rows + optim)": sequential,
    }
    print(
        f"model {args.model}: K={k} adapters x b={b} rows x T={t} tokens ({k * b * t} tokens a step), "
        f"rank {args.rank}; {args.warmup} warm-up + {args.repeats} timed runs each, "
        f"{torch.get_num_threads()} threads, {dev} {args.dtype}; setup {time.perf_counter() - t0:.1f} s"
    )
    times = interleaved(alternatives, args.repeats, args.warmup, dev)
    names = list(alternatives)
    print_table(times, names[0])
    one, fuse, seq = (statistics.median(times[n]) for n in names)
    write_json(
        args, {"P2": fuse / one, "P2seq": seq / fuse, "K": k, "b": b, "T": t, "median_ms": medians_ms(times)}
    )
    print(f"P2seq {seq / fuse:.2f}")
    print(f"P2 {fuse / one:.2f}")


if __name__ == "__main__":
    main()
