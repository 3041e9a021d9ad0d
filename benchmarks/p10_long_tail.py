"""P10: mean time-to-result of RL-shaped sampling with a long-tailed length distribution,
continuous batching ÷ batches run to completion; and training + sampling overlapped ÷ serialized.

**Long tail.** RL clients submit groups (one prompt, ``--group`` samples with their own seeds) of
``--adapters`` policy snapshots at a steady rate (one group every ``--gap-ms``). Each reply's
length is drawn from a long-tailed distribution: most are short (``--short`` tokens, uniform), a
``--long-frac`` of them long (``--long`` tokens); replies run to their length (``stop=[]``), so
both modes decode exactly the same tokens. The same arrival schedule and requests go through the
sampling loop (``sampling/loop.py``) with continuous batching (a request joins the running batch
at the next decode step and is answered at its own stop) and without (``continuous=False``: a
batch runs to completion, new arrivals wait for the next one, as ``generate`` and the former
in-tick sampler did). Time-to-result is submit → future resolved, per request. Runs alternate
(continuous, to-completion, ...); medians of the per-run means. ``P10`` = to-completion ÷
continuous (target ≥ 2).

**Overlap.** ``--train-steps`` pipelined forward_backward + optim_step of one adapter (``--train-rows``
rows of ``--train-len`` tokens) and the same sampling requests, all submitted at once to one
scheduler: sampling inside its ticks (serialized, the former design: ``in_ticks.py``) or on the sampling loop's own
thread (overlapped). ``P10_overlap`` = serialized wall ÷ overlapped wall (≥ 1: overlapping is not
slower). torch ops release the GIL, so the two threads use the machine's cores at once.

The machine's load changes both; the script prints the load average at start and end. The
defaults are sized for a loaded 2-core machine (SmolLM2 decode steps of ~0.5 s there); on an idle
one, ``--long 128 256 --groups 12 --gap-ms 500 --repeats 3`` is the fuller shape.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from concurrent.futures import Future

import torch
from in_ticks import TickSampling
from timing import add_device_args, device_of, write_json

from opentinker.engine import AdamParams, Engine, Example, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams
from opentinker.sampling.loop import SamplingCore, SamplingLoop
from opentinker.scheduler import Scheduler


def workload(args: argparse.Namespace, snaps: list[str], vocab: int) -> list[tuple[float, SampleRequest]]:
    """(arrival offset in seconds, request) of every reply, in arrival order."""
    rng = random.Random(0)
    out = []
    for k in range(args.groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(args.prompt_len // 2, args.prompt_len))]
        snap = snaps[k % len(snaps)]
        for j in range(args.group):
            n = rng.randint(*args.long) if rng.random() < args.long_frac else rng.randint(*args.short)
            params = SamplingParams(max_tokens=n, temperature=1.0, seed=k * 100 + j, stop=[])
            out.append((k * args.gap_ms / 1000, SampleRequest(snap, prompt, params)))
    return out


def train_data(vocab: int, rows: int, length: int) -> list[Example]:
    """``rows`` random cross-entropy rows of ``length`` tokens."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(rows):
        seq = torch.randint(3, vocab, (length + 1,), generator=g)
        out.append(Example(seq[:-1], {"target_tokens": seq[1:], "weights": torch.ones(length)}))
    return out


def run_stream(loop: SamplingLoop, reqs: list[tuple[float, SampleRequest]]) -> list[float]:
    """Submit on schedule; return each request's time-to-result (seconds)."""
    ttr: list[float] = [0.0] * len(reqs)
    futs: list[Future] = []
    t0 = time.perf_counter()
    for i, (at, req) in enumerate(reqs):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sent = time.perf_counter()
        fut = loop.submit(req).future
        fut.add_done_callback(lambda _f, i=i, sent=sent: ttr.__setitem__(i, time.perf_counter() - sent))
        futs.append(fut)
    for f in futs:
        f.result()
    return ttr


def overlap(
    engine: Engine,
    backend: NativeBackend,
    aid: str,
    reqs: list[SampleRequest],
    args: argparse.Namespace,
    *,
    loop: bool,
) -> float:
    """Wall seconds to finish ``--train-steps`` training steps and every sample, submitted at once."""
    sched = Scheduler(engine)
    sched.rollout = (
        SamplingLoop(SamplingCore(backend.decoder(snapshots_only=True), backend))
        if loop
        else TickSampling(sched, backend)
    )
    data = train_data(engine.vocab_size, args.train_rows, args.train_len)
    try:
        t = time.perf_counter()
        futs = [sched.submit_sample(r).future for r in reqs]
        for _ in range(args.train_steps):
            futs.append(sched.submit_forward(aid, ForwardRequest(aid, data)))
            futs.append(sched.submit_optim(aid, AdamParams(learning_rate=1e-4)))
        for f in futs:
            f.result()
        return time.perf_counter() - t
    finally:
        sched.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--groups", type=int, default=5)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--gap-ms", type=float, default=2000.0)
    ap.add_argument("--short", type=int, nargs=2, default=(2, 6))
    ap.add_argument("--long", type=int, nargs=2, default=(48, 64))
    ap.add_argument("--long-frac", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--train-rows", type=int, default=4)
    ap.add_argument("--train-len", type=int, default=32)
    ap.add_argument("--no-overlap", action="store_true", help="skip the overlap measurement")
    add_device_args(ap)
    args = ap.parse_args()
    dev, dtype = device_of(args)
    torch.manual_seed(0)
    load0 = os.getloadavg()

    engine = Engine(load_base_model(args.model, dtype=dtype, device=dev), dtype=dtype)
    snaps = []
    for i in range(args.adapters):
        aid = engine.create_adapter(LoRAConfig(rank=8, seed=i))
        with torch.no_grad():  # non-zero B: every adapter really changes the function
            for t in engine.adapter_weights(aid).b.values():
                t.normal_(std=0.01)
        snaps.append(engine.snapshot(aid).snapshot_id)
    reqs = workload(args, snaps, engine.vocab_size)
    tokens = sum(r.params.max_tokens for _, r in reqs)
    backend = NativeBackend(engine, prefix_cache_bytes=0)
    loops = {
        name: SamplingLoop(SamplingCore(backend.decoder(snapshots_only=True), backend, continuous=c))
        for name, c in (("continuous", True), ("to_completion", False))
    }
    print(
        f"model {args.model}: {len(reqs)} replies ({args.groups} groups of {args.group}, {args.adapters} snapshots), "
        f"one group every {args.gap_ms:.0f} ms; {tokens} tokens; lengths {args.short} "
        f"or {args.long} ({args.long_frac:.0%}); threads {torch.get_num_threads()}; load {load0[0]:.1f}"
    )
    run_stream(loops["continuous"], reqs[: args.group])  # warm-up
    means: dict[str, list[float]] = {name: [] for name in loops}
    p90: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(args.repeats):
        for name, loop in loops.items():
            ttr = run_stream(loop, reqs)
            means[name].append(statistics.mean(ttr))
            p90[name].append(sorted(ttr)[int(0.9 * len(ttr))])
            print(f"  {name:14s} mean time-to-result {means[name][-1]:6.2f}s  p90 {p90[name][-1]:6.2f}s")
    for name, loop in loops.items():
        print(f"  {name}: {loop.stats.steps} decode steps, {loop.stats.joined} joined mid-decode")
        loop.shutdown()
    mc, mt = statistics.median(means["continuous"]), statistics.median(means["to_completion"])
    results: dict[str, object] = {
        "P10": mt / mc,
        "mean_ttr_s": {"continuous": mc, "to_completion": mt},
        "p90_ttr_s": {k: statistics.median(v) for k, v in p90.items()},
    }
    if not args.no_overlap:
        aid = engine.create_adapter(LoRAConfig(rank=8, seed=99))
        plain = [r for _, r in reqs]
        overlap(engine, backend, aid, plain[: args.group], args, loop=True)  # warm-up
        walls: dict[str, list[float]] = {"serialized": [], "overlapped": []}
        for _ in range(args.repeats):
            walls["serialized"].append(overlap(engine, backend, aid, plain, args, loop=False))
            walls["overlapped"].append(overlap(engine, backend, aid, plain, args, loop=True))
            print(
                f"  training + sampling: serialized {walls['serialized'][-1]:6.2f}s  overlapped {walls['overlapped'][-1]:6.2f}s"
            )
        ws, wo = statistics.median(walls["serialized"]), statistics.median(walls["overlapped"])
        results["P10_overlap"] = ws / wo
        results["train_and_sample_wall_s"] = {"serialized": ws, "overlapped": wo}
    load1 = os.getloadavg()
    results["load_average"] = {"start": load0[0], "end": load1[0]}
    print(f"load average {load0[0]:.1f} at start, {load1[0]:.1f} at end (on {os.cpu_count()} cores)")
    write_json(args, results)
    if "P10_overlap" in results:
        print(f"P10_overlap {results['P10_overlap']:.2f}")
    print(f"P10 {mt / mc:.2f}")


if __name__ == "__main__":
    main()
