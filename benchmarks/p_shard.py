"""Psharded: a base sharded over K trainer workers (``--shard-base K``, FSDP2) against one worker
holding the whole base, on local Ray.

1. **Memory per worker**, for each K of ``--ks``: a pool of one group of K workers, each
   reporting the base bytes it holds (its FSDP shard: exact), its resident memory after start-up
   and one training step (RSS, ``/proc/self/statm``; ``rss_trimmed_MiB``: after handing freed
   heap pages back to the system) and its peak RSS (``ru_maxrss``): after start-up alone
   (``loaded_peak_rss_MiB``: the load's peak) and after the step. A member of a group (K > 1)
   builds its base on the meta device and reads only its own shard of the weights
   (:mod:`opentinker.cluster.shard_load`): no process holds the whole base, at start-up either.
2. **Step time**, K = 1 and K = ``--ratio-k`` side by side, interleaved (A B, B A, ...): one
   training step (a fused ``forward_backward`` of ``--rows`` rows of ``--seq`` tokens, then
   ``optim_step``) on each; the ratio of medians sharded ÷ unsharded. On the K-worker group, the
   all-gather time of one pass over the layers is timed alone (every layer unsharded and
   resharded, every member at once); a step gathers twice (forward, then backward), so its
   all-gather share is 2 × that ÷ the sharded step's median (an estimate: overlap with compute,
   if any, is not subtracted).

On CPU the K workers share the machine's cores, so the step ratio here mostly measures the
rows split over workers against their contention; on devices each worker has its own.

    python benchmarks/p_shard.py --model HuggingFaceTB/SmolLM2-135M-Instruct --ks 1 2 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import ray

from opentinker.cluster.trainer import TrainerPool
from opentinker.engine import AdamParams, ForwardRequest
from opentinker.engine.types import Example
from opentinker.lora import LoRAConfig

MiB = 2**20


class Driver:
    """One pool's leader, driven as the router does (ordered ops)."""

    def __init__(self, pool: TrainerPool) -> None:
        self.pool, self.leader, self.seq = pool, pool.workers[0], 0

    def op(self, kind: str, payload: Any, *args: Any) -> Any:
        ref = self.leader.actor.submit.remote("m", self.seq, kind, payload, args, {})
        self.seq += 1
        return self.pool.get(self.leader, "m", ref)

    def step(self, examples: list[Example]) -> None:
        self.op("forward", ForwardRequest("m", examples))
        self.op("optim", AdamParams(learning_rate=1e-4))

    def members(self) -> list[Any]:
        return [m.actor for m in self.pool.members.get(self.leader.worker_id, [self.leader])]


def data(vocab: int, rows: int, seq: int) -> list[Example]:
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(rows):
        toks = torch.randint(3, vocab, (seq + 1,), generator=g)
        out.append(Example(toks[:-1], {"target_tokens": toks[1:], "weights": torch.ones(seq)}))
    return out


def start(model: str, k: int, cpus: float) -> Driver:
    pool = TrainerPool(model, workers=k, worker_cpus=cpus, shard_base=k)
    d = Driver(pool)
    d.op("call", "create_adapter", LoRAConfig(rank=16, seed=0), "m")
    return d


def memory(d: Driver, examples: list[Example]) -> dict[str, Any]:
    loaded = ray.get([a.rss_bytes.remote() for a in d.members()])  # start-up only: the load's peak
    d.step(examples)
    infos = ray.get([a.info.remote() for a in d.members()])
    rss = ray.get([a.rss_bytes.remote() for a in d.members()])
    trimmed = ray.get([a.rss_bytes.remote(trim=True) for a in d.members()])
    return {
        "base_MiB": [round(i["base_bytes"] / MiB, 1) for i in infos],
        "loaded_peak_rss_MiB": [round(r["peak"] / MiB, 1) for r in loaded],
        "rss_MiB": [round(r["rss"] / MiB, 1) for r in rss],
        "rss_trimmed_MiB": [round(r["rss"] / MiB, 1) for r in trimmed],
        "peak_rss_MiB": [round(r["peak"] / MiB, 1) for r in rss],
    }


def step_ratio(plain: Driver, sharded: Driver, examples: list[Example], repeats: int) -> dict[str, Any]:
    for d in (plain, sharded):
        d.step(examples)
    times: dict[str, list[float]] = {"unsharded": [], "sharded": []}
    pair = [("unsharded", plain), ("sharded", sharded)]
    for rep in range(repeats):
        for name, d in pair if rep % 2 == 0 else reversed(pair):
            t0 = time.perf_counter()
            d.step(examples)
            times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    gather = max(ray.get([a.shard_gather_seconds.remote(repeats) for a in sharded.members()]))
    return {
        "step_ms": {n: round(v * 1e3, 1) for n, v in med.items()},
        "ratio_sharded_over_unsharded": round(med["sharded"] / med["unsharded"], 3),
        "gather_pass_ms": round(gather * 1e3, 1),
        "all_gather_share": round(2 * gather / med["sharded"], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--ks", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--ratio-k", type=int, default=2, help="the step-time ratio's K (0: no ratio)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpus", type=float, default=2.0, help="the local Ray instance's CPUs")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    out: dict[str, Any] = {"model": args.model, "rows": args.rows, "seq": args.seq, "memory": {}}
    try:
        for k in args.ks:
            d = start(args.model, k, args.cpus / max(k, 1 + args.ratio_k))
            examples = data(d.pool.limits["vocab_size"], args.rows, args.seq)
            out["memory"][k] = memory(d, examples)
            print(f"K={k}: {json.dumps(out['memory'][k])}", flush=True)
            d.pool.shutdown()
        if not args.ratio_k:
            return
        share = args.cpus / (1 + args.ratio_k)
        plain, sharded = start(args.model, 1, share), start(args.model, args.ratio_k, share)
        examples = data(plain.pool.limits["vocab_size"], args.rows, args.seq)
        out["step"] = step_ratio(plain, sharded, examples, args.repeats)
        print(f"K=1 vs K={args.ratio_k}: {json.dumps(out['step'])}", flush=True)
    finally:
        ray.shutdown()
        if args.json is not None:
            args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
