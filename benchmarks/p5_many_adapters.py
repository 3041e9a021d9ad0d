"""P5: does the number of REGISTERED adapters slow down training of the ACTIVE ones?

What it measures (target: docs/DESIGN.md): the throughput (tokens/s) of fused training steps — one
``forward_backward_many`` over 8 active adapters × ``b`` rows each, then each active adapter's
``optim_step`` — in an engine that holds 1,000 registered adapters, divided by the same step in an
engine that holds only the 8 active ones. Ideal 1.0, target ≥ 0.95: a server keeps every tenant's
adapter resident, and idle tenants must cost memory only, never time (no per-step scans over all
adapters, no optimizer or routing state that grows with N, no garbage-collector pressure that
shows up in step time).

Both engines wrap the SAME ``BaseModel`` object (loaded once; ``MultiLoRA.attach`` wraps it once),
so the only difference between them is the registry. Steps alternate between the two engines
(order reversed every other round), after warm-up steps on each; medians are quoted. The active
adapters of the big engine are spread over its registry (first, last and in between), not just
the first 8 created.

The sampler is measured the same way: one mixed batch of one request per active adapter in each
engine, printed as ``P5sample <time with 8 registered / time with N registered>``.

Process-wide effects (allocator, garbage collector) would slow BOTH engines once the big registry
exists and so cancel in that ratio; the small engine's step is therefore also timed before the big
registry is created (not interleaved with the rest), printed as ``P5before <thr_N / thr_8_before>``.

It also times ``create_adapter`` for each of the N adapters and compares the median of the last 10
with the median of the first 10 (``P5create <last/first>``; flat in N means ≈ 1.0), and prints the
median per tenth of the N so that a trend (cost growing with N) can be told from a step. A step is
usually the memory system, not the engine: early adapters reuse memory the process freed before
(already mapped, fast), later ones touch fresh pages (page faults; on a VM past a few GB, slower
still). ``P5churn`` isolates the engine's own work: creating and deleting 10 more adapters (freed
memory is reused) with N registered ÷ with 8 registered, interleaved (≈ 1.0 means flat in N).

Memory: every registered adapter holds its A and B (rank 8: ~0.2 MB on ``opentinker/tiny``,
~11 MB on SmolLM2-135M, so 1,000 of them need ~11 GB there). The estimate is printed before
creation; use ``--registered`` to shrink N on a small machine.

Sizes: the defaults (8 active × b = 2 × T = 128) take about a minute on ``opentinker/tiny``. On a
2-core CPU use e.g. ``--model HuggingFaceTB/SmolLM2-135M-Instruct --seq 32 --repeats 5`` for SmolLM2
(add ``--threads 1`` on a shared machine: two OpenMP threads on two busy cores stall each other).
The last line printed is ``P5 <throughput_N / throughput_8>``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from timing import check, interleaved

from opentinker.engine import Engine
from opentinker.engine.types import AdamParams, Example, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="opentinker/tiny")
    ap.add_argument("--registered", type=int, default=1000, help="adapters registered in the big engine")
    ap.add_argument("--active", type=int, default=8, help="adapters trained in each step")
    ap.add_argument("--rows", "-b", type=int, default=2, help="rows per active adapter")
    ap.add_argument("--seq", type=int, default=128, help="tokens per row")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--repeats", type=int, default=7, help="timed steps on each engine")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps on each engine first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (default 0: leave torch's own default)"
    )
    args = ap.parse_args()
    if args.registered < args.active or args.registered < 20:
        ap.error("--registered must be at least --active and at least 20")

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    n, k, b, t = args.registered, args.active, args.rows, args.seq
    t0 = time.perf_counter()
    base = load_base_model(args.model)
    small = Engine(base)
    big = Engine(base)
    assert small.lora is big.lora, "both engines must share the base model's LoRA wrapper"

    small_ids = [small.create_adapter(LoRAConfig(rank=args.rank, seed=args.seed + i)) for i in range(k)]
    tokens = torch.randint(0, base.vocab_size, (k * b, t), generator=gen)
    examples = [
        Example(tokens[i], {"target_tokens": torch.roll(tokens[i], -1), "weights": torch.ones(t)})
        for i in range(k * b)
    ]
    per_adapter = [examples[j * b : (j + 1) * b] for j in range(k)]
    adam = AdamParams(learning_rate=args.lr)

    def step(engine: Engine, ids: list[str]) -> Callable[[], None]:
        reqs = [ForwardRequest(aid, ex) for aid, ex in zip(ids, per_adapter, strict=True)]

        def run() -> None:
            check(engine.forward_backward_many(reqs))
            for aid in ids:
                engine.optim_step(aid, adam)

        return run

    print(
        f"model {args.model}; step: {k} active adapters x b={b} rows x T={t} tokens ({k * b * t} tokens), "
        f"fwd_bwd + {k} optim_steps; {args.warmup} warm-up + {args.repeats} timed steps each, "
        f"{torch.get_num_threads()} threads; setup {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    # Process-wide effects (allocator, garbage collector) would slow both engines alike once the big
    # registry exists, so the small engine is also timed before it is created (not interleaved).
    name_before, name_small, name_big = (
        f"{k} registered, before the {n}",
        f"{k} registered",
        f"{n} registered",
    )
    times = interleaved({name_before: step(small, small_ids)}, args.repeats, args.warmup)

    per_adapter_mb = small.adapter_weights(small_ids[0]).nbytes() / 2**20
    print(
        f"registering {n} adapters of rank {args.rank} "
        f"(~{per_adapter_mb:.2f} MiB each, ~{per_adapter_mb * n / 1024:.2f} GiB in all)",
        flush=True,
    )
    create_s: list[float] = []
    big_ids: list[str] = []
    for i in range(n):
        c0 = time.perf_counter()
        big_ids.append(big.create_adapter(LoRAConfig(rank=args.rank, seed=args.seed + i)))
        create_s.append(time.perf_counter() - c0)
    # Active adapters spread over the registry: the first, the last, and evenly in between.
    active_big = [big_ids[round(j * (n - 1) / max(k - 1, 1))] for j in range(k)]

    alternatives: dict[str, Callable[[], object]] = {
        name_small: step(small, small_ids),
        name_big: step(big, active_big),
    }
    times.update(interleaved(alternatives, args.repeats, args.warmup))
    tokens_per_step = k * b * t
    width = max(len(name) for name in times)
    print(f"{'engine':<{width}} {'median ms':>10} {'min ms':>9} {'max ms':>9} {'tokens/s':>10}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"{name:<{width}} {med * 1e3:>10.1f} {min(ts) * 1e3:>9.1f} {max(ts) * 1e3:>9.1f} "
            f"{tokens_per_step / med:>10.0f}"
        )
    first, last = statistics.median(create_s[:10]), statistics.median(create_s[-10:])
    print(
        f"create_adapter: first 10 median {first * 1e3:.2f} ms, last 10 median {last * 1e3:.2f} ms, "
        f"all {n}: median {statistics.median(create_s) * 1e3:.2f} ms, total {sum(create_s):.1f} s"
    )
    tenth = max(n // 10, 1)
    profile = " ".join(
        f"{statistics.median(create_s[i : i + tenth]) * 1e3:.2f}" for i in range(0, n - tenth + 1, tenth)
    )
    print(f"create_adapter median ms per tenth of the {n} (a trend, or a step?): {profile}")
    # Steady state: create and delete 10 adapters in each engine (freed memory is reused, so this
    # isolates the engine's own per-adapter work from first-touch page faults), interleaved.
    cfg = LoRAConfig(rank=args.rank, seed=args.seed)

    def churn(engine: Engine) -> Callable[[], None]:
        def run() -> None:
            for aid in [engine.create_adapter(cfg) for _ in range(10)]:
                engine.delete_adapter(aid)

        return run

    churn_s = interleaved({name_small: churn(small), name_big: churn(big)}, args.repeats, args.warmup)
    churn_small, churn_big = (statistics.median(churn_s[name]) / 10 for name in (name_small, name_big))
    print(
        f"create+delete of 10 more (steady state): {churn_small * 1e3:.2f} ms/adapter with {k} registered, "
        f"{churn_big * 1e3:.2f} ms/adapter with {n} registered"
    )
    # The sampler too: one mixed batch, a request per active adapter, same in both engines.
    prompt = tokens[0, :16].tolist()
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=0, stop=[])

    def sample(engine: Engine, ids: list[str]) -> Callable[[], None]:
        backend = NativeBackend(engine, prefix_cache_bytes=0)  # every call prefills (prompts repeat)
        reqs = [SampleRequest(aid, prompt, params) for aid in ids]

        def run() -> None:
            check(backend.generate(reqs))

        return run

    sample_s = interleaved(
        {name_small: sample(small, small_ids), name_big: sample(big, active_big)}, args.repeats, args.warmup
    )
    sample_small, sample_big = (statistics.median(sample_s[name]) for name in (name_small, name_big))
    print(
        f"sampling {k} x 8 tokens, one request per active adapter: {sample_small * 1e3:.1f} ms with {k} "
        f"registered, {sample_big * 1e3:.1f} ms with {n} registered"
    )
    throughput = {name: tokens_per_step / statistics.median(ts) for name, ts in times.items()}
    print(f"P5sample {sample_small / sample_big:.2f}")
    print(f"P5churn {churn_big / churn_small:.2f}")
    print(f"P5create {last / first:.2f}")
    print(f"P5before {throughput[name_big] / throughput[name_before]:.2f}")
    print(f"P5 {throughput[name_big] / throughput[name_small]:.2f}")


if __name__ == "__main__":
    main()
