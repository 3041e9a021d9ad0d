"""Four adapters learn four reasoning-gym skills in one batch over one base model, then every
adapter (and the base model) is evaluated on every skill's held-out problems.

    OMP_NUM_THREADS=2 .venv/bin/python recipes/skills/skills.py --seed 0 --log-dir runs/skills/seed0

Each skill is a ``reasoning_gym:<dataset>?<options>`` task of the library (scored by reasoning-gym's
own ``score_answer``); the four runs train concurrently (``run_rl_many``: one multi-LoRA run, their
requests fused in the scheduler's batches). The end is a table: rows the base model and the four
adapters, columns the four skills, cells the held-out accuracy (greedy, exact answer), written to
``LOG_DIR/skills.json`` and printed as markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import opentinker
from opentinker.renderers import get_renderer
from opentinker.rl import RLConfig, run_rl_many
from opentinker.tasks import get_task

SKILLS = {
    "add": "reasoning_gym:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=1&size=2000",
    "gcd": "reasoning_gym:gcd?min_numbers=2&max_numbers=2&min_value=2&max_value=30&size=2000",
    "count": "reasoning_gym:letter_counting?min_words=3&max_words=5&size=2000",
    "lcm": "reasoning_gym:lcm?min_numbers=2&max_numbers=2&min_value=2&max_value=10&size=2000",
}
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def config(skill: str, args: argparse.Namespace) -> RLConfig:
    return RLConfig(
        base_model=args.base_model, log_dir=str(Path(args.log_dir) / skill), name=skill, seed=args.seed,
        steps=args.steps, max_train_s=args.max_train_s, groups_per_step=args.groups, group_size=8,
        max_tokens=args.max_tokens, learning_rate=args.lr, eval_every=0, progress=False,
        extra={"eval_problems": args.eval_problems},
    )  # fmt: skip


async def main(args: argparse.Namespace) -> dict[str, Any]:
    service = opentinker.ServiceClient()
    renderer = get_renderer("auto", service.runtime.tokenizer(args.base_model))
    built = {}
    for skill, task in SKILLS.items():
        cfg = config(skill, args)
        dataset, evaluator = get_task(task).build()(renderer, cfg)
        built[skill] = (cfg, dataset, evaluator)
    t0 = time.monotonic()
    # evaluators run after training (one matrix), not inside the runs
    results = await run_rl_many([(c, d, None) for c, d, _ in built.values()], service)
    train_s = time.monotonic() - t0
    policies: dict[str, Any] = {"base": service.create_sampling_client(base_model=args.base_model)}
    for skill, res in zip(SKILLS, results, strict=True):
        policies[skill] = await res.training_client.save_weights_and_get_sampling_client()
    t1 = time.monotonic()
    # every (policy, skill) pair at once: their sample requests share the sampler's batches
    pairs = [(who, skill) for who in policies for skill in SKILLS]
    evals = await asyncio.gather(*(built[s][2](policies[w], args.steps) for w, s in pairs))
    table: dict[str, dict[str, float]] = {w: {} for w in policies}
    for (who, skill), m in zip(pairs, evals, strict=True):
        table[who][skill] = m["accuracy"]
    out = {
        "seed": args.seed, "skills": SKILLS, "accuracy": table, "train_s": train_s,
        "eval_s": time.monotonic() - t1, "steps": [len(r.metrics) for r in results],
    }  # fmt: skip
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.log_dir) / "skills.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


def markdown(out: dict[str, Any]) -> str:
    skills = list(out["skills"])
    lines = ["| adapter | " + " | ".join(skills) + " |", "|---" * (len(skills) + 1) + "|"]
    for who, row in out["accuracy"].items():
        lines.append(f"| {who} | " + " | ".join(f"{row[s]:.2f}" for s in skills) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log-dir", default="runs/skills")
    p.add_argument("--base-model", default=SMOLLM2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--max-train-s", type=float, default=480.0, help="stop training after this much clock")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-problems", type=int, default=30)
    p.add_argument("--groups", type=int, default=2, help="problems per step per skill (8 samples each)")
    out = asyncio.run(main(p.parse_args()))
    print(markdown(out))
    print(f"train {out['train_s']:.0f}s  eval {out['eval_s']:.0f}s  steps {out['steps']}")
