"""Multi-agent RL on ``tictactoe``: agents X and O (one LoRA adapter each) play each other.

    OMP_NUM_THREADS=1 .venv/bin/python recipes/tictactoe/run.py                 # opentinker/tiny
    OMP_NUM_THREADS=1 .venv/bin/python recipes/tictactoe/run.py --steps 10      # quicker

Each trained policy (greedy) is evaluated against a uniformly random legal-move opponent over
fixed-seed games from the empty board, before training (= the untrained base policy) and every
``--eval-every`` steps. Writes ``<log-dir>/{config.json, metrics.jsonl, curves.png, checkpoints.jsonl}``.
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
from opentinker.rl.loop import RLConfig
from opentinker.rl.multiagent import run_multiagent
from opentinker.tasks.tictactoe import build


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", action="store_true", help=f"use {SMOLLM2} instead of {TINY}")
    ap.add_argument("--base-url", default=None, help="a Tinker server (default: embedded)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--log-dir", default="runs/tictactoe")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--groups", type=int, default=8, help="groups (opening positions) per step")
    ap.add_argument("--group-size", type=int, default=8, help="games per group")
    ap.add_argument("--opening-pairs", type=int, default=1, help="most random move pairs in an opening")
    ap.add_argument("--random-frac", type=float, default=0.5, help="share of groups where one side is random")
    ap.add_argument("--random-x-share", type=float, default=0.5, help="of those, share with X random")
    ap.add_argument("--illegal-reward", type=float, default=-1.0, help="reward of an illegal move")
    ap.add_argument("--shared-opponent", action="store_true", help="one random-opponent seed per group")
    ap.add_argument("--legal-bonus", type=float, default=0.0, help="reward per legal move an agent makes")
    ap.add_argument("--per-move", action="store_true", help="per-move advantages (return-to-go per move)")
    ap.add_argument("--odd-frac", type=float, default=0.0, help="share of openings with O to move")
    ap.add_argument("--eval-games", type=int, default=100)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of training games")
    ap.add_argument("--train-mlp", action="store_true", help="LoRA on the MLPs too (default: attention only)")
    ap.add_argument("--loss", default="importance_sampling")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args()


async def main(args: argparse.Namespace, service: Any) -> dict:
    t0 = time.monotonic()
    model = SMOLLM2 if args.smollm2 else TINY
    cfg = RLConfig(
        base_model=model, log_dir=args.log_dir, steps=args.steps, groups_per_step=args.groups,
        group_size=args.group_size, lora_rank=args.rank, temperature=args.temperature, train_mlp=args.train_mlp, learning_rate=args.lr, loss_fn=args.loss,
        max_tokens=4, eval_every=args.eval_every, seed=args.seed, progress=not args.no_progress,
        name="tictactoe", extra={"opening_pairs": args.opening_pairs, "random_frac": args.random_frac, "random_x_share": args.random_x_share, "illegal_reward": args.illegal_reward, "shared_opponent": args.shared_opponent, "odd_frac": args.odd_frac, "legal_bonus": args.legal_bonus, "per_move": args.per_move, "eval_games": args.eval_games},
    )  # fmt: skip
    renderer = get_renderer("auto", service.create_sampling_client(base_model=model).get_tokenizer())
    res = await run_multiagent(cfg, service, build(renderer, cfg))
    evals = [r for r in res.metrics if "eval/X/win_rate" in r]
    keys = [
        f"eval/{a}/{k}" for a in ("X", "O") for k in ("win_rate", "loss_rate", "draw_rate", "illegal_rate")
    ]
    first, last = res.metrics[:5], res.metrics[-5:]
    return {
        "model": model,
        "steps": args.steps,
        "untrained": {k: evals[0][k] for k in keys},
        "trained": {k: evals[-1][k] for k in keys},
        "selfplay_illegal_first5": sum(r["game/illegal"] for r in first) / len(first),
        "selfplay_illegal_last5": sum(r["game/illegal"] for r in last) / len(last),
        "wall_s": round(time.monotonic() - t0, 1),
        "final_paths": res.final_paths,
    }


if __name__ == "__main__":
    args = parse()
    service = opentinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
    try:
        print(json.dumps(asyncio.run(main(args, service)), indent=2))
    finally:
        runtime = getattr(service, "runtime", None)
        if runtime is not None:  # embedded: stop the engine's thread before the interpreter exits
            runtime.shutdown()
