"""P13: training time for the multi-call planner_solver task, per-call datums ÷ merged timelines.

The planner_solver agent (tasks/planner_solver.py) makes three calls per round (planner, solver,
reviewer), each extending the previous call's context + output, and summarises its scratchpad
between rounds. One step's episodes are sampled once from the base policy (embedded client, the
task's default shape: 4 problems × 8 episodes, 3 terms = 2 rounds = 6 calls per episode, up to
16 tokens per call). Then the same groups are trained by :func:`opentinker.rl.train_step.train_step`
(datums, ``forward_backward``, ``optim_step``: the client API), interleaved, with
``merge_timelines`` on (one sequence per round, rl/timeline.py) and off (one sequence per call);
the engine's shared-prefix pass is on in both. Loss and gradient are the same either way
(tests/test_timeline.py). Prints sequences and tokens of each, the medians, and last
``P13 <per-call time / merged time>`` (> 1 = merging is faster; target ≥ 1.5).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from dataclasses import replace

import torch
from timing import interleaved, print_table
from tinker import types

import opentinker
from opentinker.renderers import get_renderer
from opentinker.rl import RLConfig, rollout_group
from opentinker.rl.datums import build_datums
from opentinker.rl.train_step import train_step
from opentinker.tasks.planner_solver import build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="opentinker/tiny")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--terms", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    service = opentinker.ServiceClient()
    tc = service.create_lora_training_client(base_model=args.model, rank=8, seed=0)
    policy = tc.save_weights_and_get_sampling_client()
    renderer = get_renderer("auto", tc.get_tokenizer())
    cfg = RLConfig(
        base_model=args.model, groups_per_step=args.groups, group_size=args.group_size,
        max_tokens=args.max_tokens, drop_constant_groups=False, extra={"terms": args.terms},
    )  # fmt: skip
    dataset, _ = build(renderer, cfg)
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)

    async def sample():
        return list(
            await asyncio.gather(
                *(rollout_group(b, policy, params, seed=k) for k, b in enumerate(dataset.batch(0)))
            )
        )

    groups = asyncio.run(sample())
    configs = {"per-call datums": replace(cfg, merge_timelines=False), "merged timelines": cfg}
    for name, c in configs.items():
        datums, m = asyncio.run(build_datums(groups, c, None))
        longest = max(d.model_input.length + 1 for d in datums)
        print(
            f"{name:<18} {len(datums):>4} sequences, {int(m['train/tokens']):>6} tokens (longest {longest}), {int(m['train/calls'])} calls"
        )

    def run(c: RLConfig):
        return lambda: asyncio.run(train_step(tc, groups, c, learning_rate=1e-6))

    times = interleaved({name: run(c) for name, c in configs.items()}, args.repeats, warmup=1)
    print(
        f"{args.model}: {args.groups} problems x {args.group_size} episodes, {args.terms} terms, max_tokens {args.max_tokens}"
    )
    print_table(times, "merged timelines")
    ratio = statistics.median(times["per-call datums"]) / statistics.median(times["merged timelines"])
    print(f"P13 {ratio:.2f}")


if __name__ == "__main__":
    main()
