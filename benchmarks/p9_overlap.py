"""P9: async RL with training and sampling overlapped ÷ serialized, in trained tokens per second.

The library's RL loop (``opentinker.rl.run_rl``, ``mode="async"``, ``max_staleness=1``: the next
step's rollouts are sampled on the previous policy version while the current step trains) runs the
addition task on the same embedded runtime shape twice:

- **serialized**: sampling is served inside the training scheduler's ticks, after the fused
  forward/backward and the optimizer steps, so a sample and a training step never run at the
  same time (the former design, rebuilt outside the product in ``in_ticks.py``);
- **overlapped**: a separate sampler: the sampling loop on its own thread (``Runtime()``, the
  default) or, with ``--workers N``, N rollout worker processes (``Runtime(rollout_workers=N)``).

Both runs have the same config and seeds. Throughput is trained tokens (``train/tokens``: every
token of the datums the optimizer steps on) ÷ the run's wall clock; runs alternate (serialized,
overlapped, ...) after a one-step warm-up of each, medians quoted. ``P9`` = overlapped ÷
serialized tokens/s (target ≥ 1.3 on 2 cores). The load average is printed at start and end
(the machine's other jobs change both modes' times).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from in_ticks import serialize
from timing import write_json

import opentinker
from opentinker.renderers import ChatMLRenderer
from opentinker.rl import RLConfig, run_rl
from opentinker.service.runtime import Runtime
from opentinker.tasks.arithmetic import AdditionDataset


def run(runtime: Runtime, args: argparse.Namespace, log_dir: Path, steps: int) -> tuple[float, float]:
    """(trained tokens, wall seconds) of one async RL run of ``steps`` steps."""
    service = opentinker.ServiceClient(runtime=runtime)
    renderer = ChatMLRenderer(runtime.tokenizer(args.model))
    cfg = RLConfig(
        base_model=args.model, log_dir=str(log_dir), steps=steps, groups_per_step=args.groups,
        group_size=args.group_size, lora_rank=8, learning_rate=1e-4, max_tokens=args.max_tokens,
        mode="async", max_staleness=1, progress=False, eval_every=0, drop_constant_groups=False,
        rollouts_per_step=0, seed=0,
    )  # fmt: skip
    dataset = AdditionDataset(renderer, cfg.groups_per_step, cfg.group_size, seed=cfg.seed)
    t = time.perf_counter()
    res = asyncio.run(run_rl(cfg, service, dataset, None))
    wall = time.perf_counter() - t
    return sum(float(m.get("train/tokens", 0.0)) for m in res.metrics), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2, help="groups per step")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--workers", type=int, default=0, help="overlapped: rollout worker processes (0: a thread)"
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    args = ap.parse_args()
    torch.manual_seed(0)
    load0 = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="p9-"))
    runtimes: dict[str, Any] = {
        "serialized": Runtime(root / "serialized"),
        "overlapped": Runtime(root / "overlapped", rollout_workers=args.workers),
    }
    stack = runtimes["serialized"].base_stack(args.model)
    serialize(stack.scheduler, stack.sampler)
    sampler = f"{args.workers} rollout worker processes" if args.workers else "the sampling loop's thread"
    print(
        f"model {args.model}: async RL (max_staleness 1), {args.steps} steps of {args.groups} groups x "
        f"{args.group_size}, up to {args.max_tokens} tokens a reply; overlapped on {sampler}; "
        f"threads {torch.get_num_threads()}; load {load0[0]:.1f}"
    )
    for name, rt in runtimes.items():  # warm-up: base model load, first ticks, workers' first handoffs
        run(rt, args, root / f"warm-{name}", 1)
    rates: dict[str, list[float]] = {name: [] for name in runtimes}
    for i in range(args.repeats):
        for name, rt in runtimes.items():
            tokens, wall = run(rt, args, root / f"{name}-{i}", args.steps)
            rates[name].append(tokens / wall)
            print(f"  {name:10s} {tokens:7.0f} trained tokens in {wall:6.1f}s: {tokens / wall:7.1f} tok/s")
    for rt in runtimes.values():
        rt.shutdown()
    rs, ro = statistics.median(rates["serialized"]), statistics.median(rates["overlapped"])
    load1 = os.getloadavg()
    print(f"load average {load0[0]:.1f} at start, {load1[0]:.1f} at end (on {os.cpu_count()} cores)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_json(
            argparse.Namespace(json=args.json, device="cpu", dtype="float32"),
            {
                "P9": ro / rs,
                "trained_tokens_per_s": {"serialized": rs, "overlapped": ro},
                "workers": args.workers,
                "load_average": {"start": load0[0], "end": load1[0]},
            },
        )
    print(f"P9 {ro / rs:.2f}")


if __name__ == "__main__":  # rollout worker processes are spawned: keep the guard
    main()
