"""A multi-turn RL run's sampling time per step with the sampler's prefix cache ÷ without it.

Runs the same RL task (default: ``calculator``, up to three turns per episode) for a few steps
twice in one process, each time on a fresh embedded runtime — once with the default prefix cache,
once with ``prefix_cache_bytes=0`` — and prints each step's ``time/sample_s`` and
``time/train_s``. The last line is ``prefix_reuse_rl <ratio>`` (median sampling time per step
without the cache ÷ with it). Same seed, so both runs play nearly the same episodes (turns per
episode are printed to compare).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

import opentinker
from opentinker.renderers import get_renderer
from opentinker.rl.loop import RLConfig, run_rl
from opentinker.sampling.native import DEFAULT_PREFIX_CACHE_BYTES
from opentinker.service.runtime import Runtime
from opentinker.tasks.registry import get_task


def run(args: argparse.Namespace, cache_bytes: int, folder: Path) -> list[dict]:
    runtime = Runtime(folder / "data", prefix_cache_bytes=cache_bytes)
    try:
        service = opentinker.ServiceClient(runtime=runtime)
        tokenizer = service.create_sampling_client(base_model=args.model).get_tokenizer()
        renderer = get_renderer("auto", tokenizer)
        cfg = RLConfig(
            base_model=args.model, log_dir=str(folder / "run"), steps=args.steps, groups_per_step=args.groups,
            group_size=args.group_size, max_tokens=args.max_tokens, learning_rate=3e-4, eval_every=0,
            progress=False, seed=0,
        )  # fmt: skip
        dataset, _ = get_task(args.task).build()(renderer, cfg)
        asyncio.run(run_rl(cfg, service, dataset, None))
        return [json.loads(x) for x in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    finally:
        runtime.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--task", default="calculator")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    medians = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cache_bytes in (("with the prefix cache", DEFAULT_PREFIX_CACHE_BYTES), ("without", 0)):
            rows = run(args, cache_bytes, Path(tmp) / str(cache_bytes))
            sample = [r["time/sample_s"] for r in rows]
            medians[name] = statistics.median(sample)
            print(
                f"  {name:22s} sample s/step {[round(x, 1) for x in sample]}, train s/step "
                f"{[round(r['time/train_s'], 1) for r in rows]}, turns/episode "
                f"{[round(r['env/turns_mean'], 2) for r in rows]}"
            )
    print(f"prefix_reuse_rl {medians['without'] / medians['with the prefix cache']:.2f}")


if __name__ == "__main__":
    main()
