"""Multi-turn RL with environment feedback: ``addition_retry`` after single-turn ``addition``.

One LoRA adapter, two RL stages over the Tinker client API: ``run_rl`` on ``addition`` (the fixed
single-turn task) for ``--single-steps``, then ``run_rl`` on ``addition_retry`` (a wrong reply gets
"That is not correct. Answer with just the number." and another attempt, up to 3; reward
1 - 0.3 per retry) from that very training client (weights and optimizer) for ``--retry-steps``.
The second stage's held-out evaluation (greedy, ``--eval-problems`` of the addition task's 200)
reports ``success`` (solved within the attempts), ``first_try`` and mean ``attempts``.

    OMP_NUM_THREADS=2 .venv/bin/python recipes/addition_retry/run.py              # SmolLM2-135M-Instruct
    OMP_NUM_THREADS=1 .venv/bin/python recipes/addition_retry/run.py --tiny --single-steps 2 --retry-steps 2

Writes ``<log-dir>/single/`` and ``<log-dir>/retry/`` (config.json, metrics.jsonl, curves.png,
checkpoints.jsonl) and ``<log-dir>/summary.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import opentinker
from opentinker.models.registry import SMOLLM2, TINY
from opentinker.renderers import get_renderer
from opentinker.rl.loop import RLConfig, run_rl
from opentinker.tasks import addition_retry, arithmetic


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help=f"use {TINY} instead of {SMOLLM2}")
    ap.add_argument("--log-dir", default="runs/addition_retry")
    ap.add_argument("--single-steps", type=int, default=100)
    ap.add_argument("--retry-steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--eval-problems", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=10, help="of the retry stage")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args()


async def main(args: argparse.Namespace) -> dict:
    t0 = time.monotonic()
    model = TINY if args.tiny else SMOLLM2
    service = opentinker.ServiceClient()
    renderer = get_renderer("auto", service.create_sampling_client(base_model=model).get_tokenizer())
    log = Path(args.log_dir)
    common = dict(
        base_model=model, groups_per_step=4, group_size=8, lora_rank=8, train_mlp=False,
        train_unembed=False, max_tokens=8, learning_rate=args.lr, seed=args.seed,
        progress=not args.no_progress, extra={"eval_problems": args.eval_problems},
    )  # fmt: skip
    single = RLConfig(log_dir=str(log / "single"), steps=args.single_steps, eval_every=0, **common)
    dataset, evaluator = arithmetic.build(renderer, single)
    first = await run_rl(single, service, dataset, evaluator)
    retry = RLConfig(log_dir=str(log / "retry"), steps=args.retry_steps, eval_every=args.eval_every, **common)
    dataset, evaluator = addition_retry.build(renderer, retry)
    second = await run_rl(retry, service, dataset, evaluator, training_client=first.training_client)
    evals = [r for r in second.metrics if "eval/success" in r]
    summary = {
        "model": model,
        "single": {k: first.metrics[-1].get(k) for k in ("step", "eval/accuracy")},
        "retry": [
            {k: r.get(k) for k in ("step", "eval/success", "eval/first_try", "eval/attempts")} for r in evals
        ],
        "wall_s": time.monotonic() - t0,
    }
    (log / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(parse())), indent=2))
