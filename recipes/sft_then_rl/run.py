"""SFT on the bundled arithmetic chat set, then RL on the ``addition`` task from the SFT'ed adapter.

One LoRA adapter goes through both stages over the Tinker client API: ``run_sft`` trains it on
``chat_sft``'s bundled set (2-digit additions, none of the 200 held-out eval problems), then
``run_rl`` continues from that very training client (weights and optimizer) on ``addition``.
Greedy accuracy on the 200 held-out problems is measured before SFT, after SFT and after RL.

    OMP_NUM_THREADS=1 .venv/bin/python recipes/sft_then_rl/run.py             # opentinker/tiny
    OMP_NUM_THREADS=1 .venv/bin/python recipes/sft_then_rl/run.py --smollm2   # SmolLM2-135M-Instruct

Writes ``<log-dir>/sft/`` and ``<log-dir>/rl/`` (config.json, metrics.jsonl, curves.png,
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
from opentinker.sft.loop import SFTConfig, run_sft
from opentinker.tasks import arithmetic, chat


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--smollm2", action="store_true", help=f"use {SMOLLM2} instead of {TINY}")
    ap.add_argument("--base-url", default=None, help="a Tinker server (default: embedded)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--log-dir", default="runs/sft_then_rl")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--sft-epochs", type=int, default=8, help="0 = no SFT (an RL-only baseline)")
    ap.add_argument("--sft-batch", type=int, default=32)
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--rl-steps", type=int, default=200)
    ap.add_argument("--rl-lr", type=float, default=5e-4)
    ap.add_argument("--rl-temperature", type=float, default=1.0)
    ap.add_argument(
        "--rl-optimizer",
        choices=("continue", "fresh"),
        default="continue",
        help="RL continues the SFT'ed client (Adam state included) or starts from the SFT checkpoint's "
        "weights with a fresh Adam",
    )
    ap.add_argument("--groups", type=int, default=32, help="RL groups (problems) per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--eval-problems", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args()


async def main(args: argparse.Namespace) -> dict:
    t0 = time.monotonic()
    model = SMOLLM2 if args.smollm2 else TINY
    out = Path(args.log_dir)
    service = opentinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
    tc = await service.create_lora_training_client(
        base_model=model, rank=args.rank, seed=args.seed, train_attn=True, train_mlp=True, train_unembed=False
    )
    renderer = get_renderer("auto", tc.get_tokenizer())

    sft_cfg = SFTConfig(
        base_model=model, log_dir=str(out / "sft"), epochs=args.sft_epochs, batch_size=args.sft_batch,
        learning_rate=args.sft_lr, lr_schedule="linear", lora_rank=args.rank, eval_every=0,
        seed=args.seed, progress=not args.no_progress, name="sft",
    )  # fmt: skip
    train, eval_set = chat.build(renderer, sft_cfg)
    accuracy = arithmetic.make_evaluator(renderer, n=args.eval_problems, max_tokens=8)
    rl_tc, sft_path, sft_evals = tc, None, []
    if args.sft_epochs > 0:  # (0: an RL-only baseline on the same fresh adapter)
        sft = await run_sft(sft_cfg, service, train, eval_set, evaluator=accuracy, training_client=tc)
        rl_tc, sft_path = sft.training_client, sft.final_path
        sft_evals = [r for r in sft.metrics if "eval/accuracy" in r]
    t_sft = time.monotonic() - t0

    rl_cfg = RLConfig(
        base_model=model, log_dir=str(out / "rl"), steps=args.rl_steps, groups_per_step=args.groups,
        group_size=args.group_size, lora_rank=args.rank, learning_rate=args.rl_lr, max_tokens=8,
        temperature=args.rl_temperature,
        eval_every=0, seed=args.seed, progress=not args.no_progress, name="rl",
        extra={"eval_problems": args.eval_problems},
    )  # fmt: skip
    dataset, evaluator = arithmetic.build(renderer, rl_cfg)
    if args.rl_optimizer == "fresh" and sft_path is not None:
        rl_tc = await service.create_training_client_from_state(sft_path)
    rl = await run_rl(rl_cfg, service, dataset, evaluator, training_client=rl_tc)

    rl_evals = [r for r in rl.metrics if "eval/accuracy" in r]
    evals = sft_evals or rl_evals[:1]  # without SFT, RL's first eval is the "before" and "after SFT"
    rewards = [r["reward/mean"] for r in rl.metrics]
    k = max(1, min(20, len(rewards) // 2))
    summary = {
        "model": model,
        "accuracy_before_sft": evals[0]["eval/accuracy"],
        "accuracy_after_sft": evals[-1]["eval/accuracy"],
        "accuracy_after_rl": rl_evals[-1]["eval/accuracy"],
        "eval_nll_per_token_before_sft": evals[0].get("eval/nll_per_token"),
        "eval_nll_per_token_after_sft": evals[-1].get("eval/nll_per_token"),
        "sft_steps": sft_evals[-1]["step"] if sft_evals else 0,
        "rl_steps": args.rl_steps,
        f"rl_reward_first_{k}_steps": sum(rewards[:k]) / k,
        f"rl_reward_last_{k}_steps": sum(rewards[-k:]) / k,
        "time_sft_s": round(t_sft, 1),
        "time_total_s": round(time.monotonic() - t0, 1),
        "sft_checkpoint": sft_path,
        "rl_checkpoint": rl.final_path,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    result = asyncio.run(main(parse()))
    print(json.dumps(result, indent=2))
