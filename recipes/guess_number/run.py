"""RL on ``guess_number`` (multi-turn: guess 1..100 with Higher./Lower. feedback) on one LoRA adapter.

    OMP_NUM_THREADS=1 .venv/bin/python recipes/guess_number/run.py                 # opentinker/tiny
    OMP_NUM_THREADS=1 .venv/bin/python recipes/guess_number/run.py --steps 10      # quicker

Writes ``<log-dir>/{config.json, metrics.jsonl, curves.png, checkpoints.jsonl}`` and prints the
evaluation (greedy on 25 held-out secrets; ``sampled_success`` at temperature 1) before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import opentinker
from opentinker.models.registry import SMOLLM2, TINY
from opentinker.renderers import get_renderer
from opentinker.rl.loop import RLConfig, run_rl
from opentinker.tasks.guess_number import build


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", action="store_true", help=f"use {SMOLLM2} instead of {TINY}")
    ap.add_argument("--base-url", default=None, help="a Tinker server (default: embedded)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--log-dir", default="runs/guess_number")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4, help="groups (secrets) per step")
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--max-turns", type=int, default=7)
    ap.add_argument("--max-opening", type=int, default=0, help="train from up to N scripted bisection turns")
    ap.add_argument("--eval-samples", type=int, default=8, help="sampled eval episodes per held-out secret")
    ap.add_argument("--train-mlp", action="store_true", help="LoRA on the MLPs too (default: attention only)")
    ap.add_argument("--normalize-std", action="store_true", help="divide advantages by the group's std")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--loss", default="importance_sampling")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args()


async def main(args: argparse.Namespace, service: Any) -> dict:
    t0 = time.monotonic()
    model = SMOLLM2 if args.smollm2 else TINY
    cfg = RLConfig(
        base_model=model, log_dir=args.log_dir, steps=args.steps, groups_per_step=args.groups,
        group_size=args.group_size, lora_rank=args.rank, train_mlp=args.train_mlp,
        normalize_std=args.normalize_std, temperature=args.temperature, learning_rate=args.lr, loss_fn=args.loss,
        max_tokens=12, eval_every=args.eval_every, seed=args.seed, progress=not args.no_progress,
        plot_keys=("reward/mean", "env/success", "env/bisect", "eval/success", "eval/sampled_success", "eval/sampled_bisect"),
        name="guess_number", extra={"max_turns": args.max_turns, "max_opening": args.max_opening, "eval_samples": args.eval_samples},
    )  # fmt: skip
    tc = await service.create_lora_training_client(
        base_model=model,
        rank=args.rank,
        seed=args.seed,
        train_attn=True,
        train_mlp=args.train_mlp,
        train_unembed=False,
    )
    renderer = get_renderer("auto", tc.get_tokenizer())
    dataset, evaluator = build(renderer, cfg)
    res = await run_rl(cfg, service, dataset, evaluator, training_client=tc)
    evals = [r for r in res.metrics if "eval/success" in r]
    keys = (
        "eval/success",
        "eval/turns",
        "eval/sampled_success",
        "eval/sampled_bisect",
        "eval/sampled_in_range",
    )
    k = max(1, min(10, len(res.metrics) // 2))

    def train(rows: list[dict], key: str) -> float:
        return round(sum(r[key] for r in rows) / len(rows), 3)

    summary = {
        "model": model,
        "steps": args.steps,
        "eval_before": {key: evals[0][key] for key in keys},
        "eval_after": {key: evals[-1][key] for key in keys},
        f"train_first{k}_steps": {key: train(res.metrics[:k], key) for key in ("env/success", "env/bisect")},
        f"train_last{k}_steps": {key: train(res.metrics[-k:], key) for key in ("env/success", "env/bisect")},
        "wall_s": round(time.monotonic() - t0, 1),
        "final_path": res.final_path,
    }
    return summary


if __name__ == "__main__":
    args = parse()
    service = opentinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
    try:
        print(json.dumps(asyncio.run(main(args, service)), indent=2))
    finally:
        runtime = getattr(service, "runtime", None)
        if runtime is not None:  # embedded: stop the engine's thread before the interpreter exits
            runtime.shutdown()
