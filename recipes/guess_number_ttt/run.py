"""Success on held-out long guess-the-number episodes with and without test-time training.

Same policy (a fresh rank-8 adapter, LoRA B = 0: the base model's behaviour), same secrets, same
sampling seeds; the two arms run one after another, each with all its episodes live at once, or
``--concurrent`` of them at a time (the same chunks and seeds in both arms: a bound on memory for
larger models, since one fused update holds every live episode's activations).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from tinker import types

import opentinker
from opentinker.renderers import get_renderer
from opentinker.rl.rollout import rollout_group
from opentinker.rl.ttt import TTTConfig, TTTStats, TTTUpdates, fork_point, ttt_rollout_group
from opentinker.rl.types import TrajectoryGroup
from opentinker.tasks.guess_number_long import LongGuessGroup, held_out_secrets, last_metrics, per_guess


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-model", default="opentinker/tiny")
    ap.add_argument("--episodes", type=int, default=128)
    ap.add_argument("--high", type=int, default=1000)
    ap.add_argument("--max-turns", type=int, default=12)
    ap.add_argument("--informative", action="store_true")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ngram", type=int, default=3)
    ap.add_argument("--repeat-weight", type=float, default=0.25)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--window", type=int, default=None, help="TTT update window W (tokens; default all)")
    ap.add_argument(
        "--reuse-kv", action="store_true", help="TTT samples through inflight sessions (KV reused)"
    )
    ap.add_argument(
        "--window-alone", action="store_true", help="with --window: train on the window without the prompt"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrent", type=int, default=0, help="episodes live at once (0: all)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    service = opentinker.ServiceClient()
    tc = service.create_lora_training_client(
        base_model=a.base_model, rank=a.rank, seed=a.seed, train_mlp=False, train_unembed=False
    )
    renderer = get_renderer("auto", tc.get_tokenizer())
    policy = await tc.save_weights_and_get_sampling_client()
    path = await fork_point(tc, "ttt-fork")
    secrets = held_out_secrets(a.episodes, a.high)
    n = a.concurrent if a.concurrent > 0 else len(secrets)
    groups = [
        LongGuessGroup(
            renderer, secrets[i : i + n], high=a.high, max_turns=a.max_turns, informative=a.informative
        )
        for i in range(0, len(secrets), n)
    ]
    params = types.SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature)
    cfg = TTTConfig(
        steps=a.steps,
        learning_rate=a.lr,
        ngram=a.ngram,
        repeat_weight=a.repeat_weight,
        window=a.window,
        reuse_kv=a.reuse_kv,
        window_prompt=not a.window_alone,
    )
    updates = TTTUpdates(service, cfg)  # the chunks reuse each other's forks
    out: dict[str, dict[str, float]] = {}
    for arm in ("no_ttt", "ttt"):
        t = time.monotonic()
        stats = TTTStats()
        gs: list[TrajectoryGroup] = []
        for c, group in enumerate(groups):
            seed = a.seed + 1_000 * c
            if arm == "ttt":
                gs.append(
                    await ttt_rollout_group(
                        group, policy, params, service=service, fork_path=path, cfg=cfg, seed=seed, stats=stats,
                        updates=updates,
                    )
                )  # fmt: skip
            else:
                gs.append(await rollout_group(group, policy, params, seed=seed))
            print(f"  {arm} chunk {c + 1}/{len(groups)}: {time.monotonic() - t:.0f} s", flush=True)
        wall = time.monotonic() - t
        out[arm] = {
            "episodes": float(sum(len(g.trajectories) for g in gs)), "errors": float(sum(g.errors for g in gs)),
            "success": last_metrics(gs, "success"), "turns": last_metrics(gs, "turns"),
            "invalid": last_metrics(gs, "invalid"), "repeat": per_guess(gs, "repeat"),
            "in_range": per_guess(gs, "in_range"), "wall_s": wall,
            "wall_s_per_turn": wall / max(1.0, sum(len(t.transitions) for g in gs for t in g.trajectories)),
            **(stats.metrics() if arm == "ttt" else {}),
        }  # fmt: skip
        print(arm, json.dumps({k: round(v, 4) for k, v in out[arm].items()}), flush=True)
    await updates.close()
    ratio = out["ttt"]["wall_s"] / out["no_ttt"]["wall_s"]  # same episodes, all live at once
    per_turn = out["ttt"]["wall_s_per_turn"] / out["no_ttt"]["wall_s_per_turn"]
    print(
        f"success: TTT {out['ttt']['success']:.3f} vs no-TTT {out['no_ttt']['success']:.3f}; "
        f"cost TTT / no-TTT: {ratio:.2f} per episode, {per_turn:.2f} per turn"
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {"args": vars(a), "results": out, "cost_ratio": ratio, "cost_ratio_per_turn": per_turn},
                f,
                indent=1,
            )


if __name__ == "__main__":
    asyncio.run(main())
