"""P12: test-time training inside episodes ÷ no TTT, wall time per episode, 32 concurrent episodes.

``--episodes`` (32) long guess-the-number episodes (1..``--high``, ``--max-turns`` guesses; with
1..1000 and 12 turns nearly every episode runs all 12 turns in both arms, so both decode the same
number of turns) run at once, all live, from one policy. No-TTT: every turn sampled from the
policy (one mixed batch on the sampling loop). TTT (``rl/ttt.py``): each episode forks its own
adapter and takes ``--steps`` updates on its text so far before each turn after the first (all
live episodes' updates released together and fused into the same ticks), then samples from a
snapshot of it; one ``TTTUpdates`` serves every repeat, as the RL loop's serves every step, so
the forks of the warm-up are reused. Same secrets, same seeds.  Also printed: the training ticks
of each TTT repeat and how many episodes' updates each fused, and the seconds spent in them. The arms alternate (no-TTT, TTT, ...) ``--repeats`` times after one warm-up of each;
the ratio is of the medians of wall time per episode, and of wall time per sampled turn
(target ≤ 1.5; aTTT reports 1.9); ``P12cpu`` is the same ratio in this process's CPU seconds,
which do not count the time the host gives other jobs (the wall clock does). ``--window W``, ``--window-alone`` and ``--reuse-kv`` switch on
TTT's cost options (``TTTConfig.window``: train on the last W targets; ``window_prompt=False``: on
the window without the task's prompt before it; ``TTTConfig.reuse_kv``: sample through inflight
sessions that keep earlier keys and values; all documented in ``rl/ttt.py``). On a loaded
shared machine the number is noisy: the script prints the load average at start and end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from tinker import types

import opentinker
from opentinker.renderers import get_renderer
from opentinker.rl.rollout import rollout_group
from opentinker.rl.ttt import TTTConfig, TTTStats, TTTUpdates, fork_point, ttt_rollout_group
from opentinker.service.runtime import Runtime
from opentinker.tasks.guess_number_long import LongGuessGroup, held_out_secrets


async def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--base-model", default="opentinker/tiny")
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--high", type=int, default=1000)
    ap.add_argument("--max-turns", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--steps", type=int, default=1, help="TTT updates before each turn (k)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--window", type=int, default=None, help="TTT update window W (tokens; default all)")
    ap.add_argument(
        "--reuse-kv", action="store_true", help="TTT samples through inflight sessions (KV reused)"
    )
    ap.add_argument(
        "--window-alone", action="store_true", help="with --window: train on the window without the prompt"
    )
    ap.add_argument(
        "--rollout-workers", type=int, default=0, help="sample in that many worker processes (0: a thread)"
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    runtime = Runtime(rollout_workers=a.rollout_workers) if a.rollout_workers else None
    service = opentinker.ServiceClient(runtime=runtime)
    tc = service.create_lora_training_client(
        base_model=a.base_model, rank=a.rank, seed=0, train_mlp=False, train_unembed=False
    )
    renderer = get_renderer("auto", tc.get_tokenizer())
    policy = await tc.save_weights_and_get_sampling_client()
    path = await fork_point(tc, "p12-fork")
    group = LongGuessGroup(renderer, held_out_secrets(a.episodes, a.high), high=a.high, max_turns=a.max_turns)
    params = types.SamplingParams(max_tokens=a.max_tokens, temperature=1.0)
    cfg = TTTConfig(steps=a.steps, window=a.window, reuse_kv=a.reuse_kv, window_prompt=not a.window_alone)
    updates = TTTUpdates(service, cfg)
    sched = service.runtime.base_stack(a.base_model).scheduler  # instrumentation, not the client API
    per_episode: dict[str, list[float]] = {"no_ttt": [], "ttt": []}
    per_turn: dict[str, list[float]] = {"no_ttt": [], "ttt": []}
    cpu_per_episode: dict[str, list[float]] = {"no_ttt": [], "ttt": []}
    for rep in range(a.repeats + 1):  # rep 0 warms both arms up
        for arm in ("no_ttt", "ttt"):
            stats, seen = TTTStats(), sched.stats.ticks
            t, cpu = time.perf_counter(), time.process_time()
            if arm == "ttt":
                g = await ttt_rollout_group(
                    group, policy, params, service=service, fork_path=path, cfg=cfg, seed=0, stats=stats,
                    updates=updates,
                )  # fmt: skip
            else:
                g = await rollout_group(group, policy, params, seed=0)
            wall, cpu = time.perf_counter() - t, time.process_time() - cpu
            turns = sum(len(tr.transitions) for tr in g.trajectories)
            print(
                f"rep {rep} {arm}: {wall:.2f} s ({cpu:.2f} s of CPU), {len(g.trajectories)} episodes, {turns} turns",
                flush=True,
            )
            if arm == "ttt":
                records = (sched.tick_record(t) for t in range(seen + 1, sched.stats.ticks + 1))
                trained = [r for r in records if r is not None and r.fused_requests]
                busy = sum(r.end - r.start for r in trained)
                print(
                    f"  {stats.updates} updates ({stats.forks} forks, {stats.reused} reused) in "
                    f"{len(trained)} training ticks, {busy:.2f} s; updates per tick "
                    f"{sorted((r.fused_requests for r in trained), reverse=True)}",
                    flush=True,
                )
            if rep > 0:
                per_episode[arm].append(wall / max(1, len(g.trajectories)))
                per_turn[arm].append(wall / max(1, turns))
                cpu_per_episode[arm].append(cpu / max(1, len(g.trajectories)))
    med = {k: statistics.median(v) for k, v in per_episode.items()}
    med_turn = {k: statistics.median(v) for k, v in per_turn.items()}
    ratio, ratio_turn = med["ttt"] / med["no_ttt"], med_turn["ttt"] / med_turn["no_ttt"]
    med_cpu = {k: statistics.median(v) for k, v in cpu_per_episode.items()}
    ratio_cpu = med_cpu["ttt"] / max(med_cpu["no_ttt"], 1e-9)
    print(f"load average at end: {os.getloadavg()}")
    print(f"per episode: no-TTT {med['no_ttt']:.3f} s, TTT {med['ttt']:.3f} s")
    print(f"P12 = TTT / no-TTT per episode = {ratio:.2f} (per turn {ratio_turn:.2f}; target <= 1.5)")
    print(
        f"P12cpu = the same in this process's CPU seconds = {ratio_cpu:.2f} (the host's other jobs not counted)"
    )
    if a.json is not None:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "per_episode_s": med,
                                      "P12": ratio, "P12_per_turn": ratio_turn, "cpu_per_episode_s": med_cpu,
                                      "P12cpu": ratio_cpu}, indent=1))  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
