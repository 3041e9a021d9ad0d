"""Pshardsample: sampling on a sharded group (``--shard-sampling group``) against the unsharded
native sampler, on local Ray.

One batch of ``--rows`` requests (each ``--prompt`` tokens, ``--new`` new tokens, greedy, no
stop) on three samplers, interleaved (A B C, C B A, ...), the median of ``--repeats`` each:

- **group**: a group of K = ``--k`` trainer workers holding the base sharded with FSDP2, the
  leader decoding over the HF forward and the other members replaying each forward
  (:mod:`opentinker.cluster.shard_sampling`), sent as one job from this process;
- **hf**: the same decoder over the whole base in this process (``lean_decode=False``);
- **lean**: the default native sampler in this process (the lean decode path).

The ratios group ÷ hf and group ÷ lean say what sampling on the group costs. On the group, one
pass of all-gathers over the layers is timed alone (every layer unsharded and resharded, every
member at once); a job gathers once per forward, so its all-gather share is forwards × that ÷ the
job's median (an estimate: overlap, if any, is not subtracted). On CPU the members and this
process share the machine's cores.

    python benchmarks/p_shard_sample.py --model HuggingFaceTB/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import ray

from opentinker.cluster.shard_sampling import SampleJob
from opentinker.cluster.trainer import TrainerPool
from opentinker.engine import Engine
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default="opentinker/tiny")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpus", type=float, default=0.5, help="CPUs each worker asks Ray for")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    pool = TrainerPool(args.model, workers=args.k, worker_cpus=args.cpus, shard_base=args.k)
    engine = Engine(args.model)
    params = SamplingParams(max_tokens=args.new, temperature=0.0, stop=[])
    reqs = [
        SampleRequest(None, [(7 * i + 3 * j) % 500 + 5 for j in range(args.prompt)], params)
        for i in range(args.rows)
    ]
    leader = pool.workers[0].actor
    backends = {"hf": NativeBackend(engine, lean_decode=False, prefix_cache_bytes=0),
                "lean": NativeBackend(engine, prefix_cache_bytes=0)}  # fmt: skip
    forwards: list[int] = []

    job = SampleJob([(i, r, None) for i, r in enumerate(reqs)])  # the bare base: no handoff

    def group() -> None:
        out = ray.get(leader.shard_sample.remote(job))
        forwards.append(out.forwards[0])

    runs = {"group": group, **{n: (lambda b=b: b.generate(reqs)) for n, b in backends.items()}}
    times: dict[str, list[float]] = {n: [] for n in runs}
    for r in range(args.repeats + 1):  # the first round warms up, not counted
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            t = time.perf_counter()
            runs[name]()
            if r:
                times[name].append(time.perf_counter() - t)
    members = [m.actor for m in pool.members[pool.workers[0].worker_id]]
    gather = max(ray.get([m.shard_gather_seconds.remote(3) for m in members]))
    med = {n: statistics.median(v) for n, v in times.items()}
    report = {
        "model": args.model, "k": args.k, "rows": args.rows, "prompt": args.prompt, "new": args.new,
        "seconds": {n: round(v, 3) for n, v in med.items()},
        "group_over_hf": round(med["group"] / med["hf"], 2),
        "group_over_lean": round(med["group"] / med["lean"], 2),
        "forwards_per_job": forwards[-1], "gather_pass_s": round(gather, 4),
        "gather_share": round(forwards[-1] * gather / med["group"], 2),
    }  # fmt: skip
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    pool.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
