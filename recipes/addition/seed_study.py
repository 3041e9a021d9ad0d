"""The fixed task against the clock that counts: held-out accuracy by CPU time, per seed.

Runs ``run_rl`` on the ``addition`` task with the task's own defaults (``--set FIELD=VALUE``
overrides any ``RLConfig`` field, JSON values), embedded. The clock is this process's CPU time
(user + system, all threads, children included) spent outside evaluation, so runs on a shared,
noisy machine stay comparable. A run stops at the first evaluation with accuracy >= ``--target``
or once its clock passes ``--max-cpu-minutes``.

Every evaluation (greedy, the 200 fixed held-out problems) also sorts the errors:

* ``eval/err_format``: no integer, or the first integer is one of the operands (the question
  restated, not answered);
* ``eval/err_carry``: off by exactly 10 or 100 (a carry dropped or invented);
* ``eval/err_ones``: the ones digit is wrong;
* ``eval/err_other``: any other wrong number;
* ``eval/acc_carry``, ``eval/acc_no_carry``: accuracy on the problems whose ones digits carry
  (a % 10 + b % 10 >= 10) and on the others.

The step rows of ``LOG_DIR/metrics.jsonl`` carry the exploration measurements: constant groups
(``groups/dropped_constant`` of ``groups_per_step``; ``groups/constant_reward_mean``, the share of
them that were all correct), the advantage scale (``advantage/abs_mean``) and the sampled tokens'
mean negative logprob (``policy/nll_per_token``, the entropy estimate at temperature 1).

    OMP_NUM_THREADS=1 .venv/bin/python recipes/addition/seed_study.py --seed 1 --log-dir runs/seed-1
    OMP_NUM_THREADS=1 .venv/bin/python recipes/addition/seed_study.py --model opentinker/tiny \\
        --max-cpu-minutes 0.2 --eval-every 2 --eval-problems 20 --log-dir runs/seed-tiny   # seconds
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import resource
import tempfile
from pathlib import Path
from typing import Any

from tinker import types

import opentinker
from opentinker.client import Runtime
from opentinker.models.registry import SMOLLM2
from opentinker.renderers import Renderer, get_renderer
from opentinker.rl.loop import RLConfig, run_rl
from opentinker.tasks.arithmetic import INT, AdditionDataset, eval_problems, question
from opentinker.tasks.registry import get_task


def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads) and its waited-for children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def error_class(text: str, a: int, b: int) -> str:
    """``correct``, ``format``, ``carry``, ``ones`` or ``other`` (see the module docstring)."""
    m = INT.search(text)
    if m is None:
        return "format"
    x, s = int(m.group()), a + b
    if x == s:
        return "correct"
    if x in (a, b):
        return "format"
    if abs(x - s) in (10, 100):
        return "carry"
    if x % 10 != s % 10:
        return "ones"
    return "other"


def make_classifying_evaluator(renderer: Renderer, n: int, max_tokens: int):
    """The task's greedy evaluator, with every reply's error class counted."""
    problems = eval_problems(n)
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=renderer.stop)

    async def evaluate(policy: Any, step: int) -> dict[str, float]:
        async def one(a: int, b: int) -> str:
            prompt = renderer.build_generation_prompt([{"role": "user", "content": question(a, b)}])
            resp = await policy.sample(
                prompt=types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params
            )
            return error_class(renderer.parse_response(list(resp.sequences[0].tokens))[0]["content"], a, b)

        classes = await asyncio.gather(*(one(a, b) for a, b in problems))
        out = {"accuracy": classes.count("correct") / len(classes)}
        for c in ("format", "carry", "ones", "other"):
            out[f"err_{c}"] = classes.count(c) / len(classes)
        carry = [a % 10 + b % 10 >= 10 for a, b in problems]
        for name, want in (("acc_carry", True), ("acc_no_carry", False)):
            picked = [c for c, k in zip(classes, carry, strict=True) if k == want]
            out[name] = picked.count("correct") / max(1, len(picked))
        return out

    return evaluate


def parse_set(kv: str) -> tuple[str, Any]:
    key, sep, value = kv.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set wants FIELD=VALUE, got {kv!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


async def study(args: argparse.Namespace) -> dict[str, Any]:
    spec = get_task("addition")
    fields = {**spec.defaults, "eval_every": args.eval_every, **dict(parse_set(kv) for kv in args.set)}
    known = {f.name for f in dataclasses.fields(RLConfig)}
    for key in fields:
        if key not in known or key in ("base_model", "log_dir", "steps", "seed", "progress", "name"):
            raise SystemExit(f"--set {key}=...: not an RLConfig field this study lets you set")
    cfg = RLConfig(
        base_model=args.model, log_dir=args.log_dir, steps=args.max_steps, seed=args.seed,
        progress=False, name=f"seed{args.seed}", **fields,
    )  # fmt: skip
    try:
        cfg.check()
    except ValueError as e:
        raise SystemExit(f"--set: {e}") from None
    runtime = Runtime(Path(tempfile.mkdtemp(prefix="seed-study-")) / "data")
    service = opentinker.ServiceClient(runtime=runtime)
    renderer = get_renderer("auto", service.create_sampling_client(base_model=cfg.base_model).get_tokenizer())
    dataset = AdditionDataset(renderer, cfg.groups_per_step, cfg.group_size, seed=cfg.seed)
    inner = make_classifying_evaluator(renderer, args.eval_problems, cfg.max_tokens)
    clock = {"cpu": 0.0, "since": None}
    trace: list[dict[str, float]] = []
    reached: dict[str, float] | None = None

    async def evaluator(policy: Any, step: int) -> dict[str, float]:
        nonlocal reached
        if clock["since"] is not None:
            clock["cpu"] += cpu_seconds() - clock["since"]
        out = await inner(policy, step)
        out["train_cpu_s"] = round(clock["cpu"], 2)
        trace.append({"step": step, **out})
        print(
            json.dumps({"seed": args.seed, "step": step, **{k: round(v, 4) for k, v in out.items()}}),
            flush=True,
        )
        if reached is None and out["accuracy"] >= args.target:
            reached = {"step": step, "cpu_s": clock["cpu"], "accuracy": out["accuracy"]}
        done = reached is not None or clock["cpu"] >= args.max_cpu_minutes * 60
        out["race_done"] = float(done)
        clock["since"] = None if done else cpu_seconds()
        return out

    cfg.stop_when = ("eval/race_done", 1.0)
    try:
        await run_rl(cfg, service, dataset, evaluator)
    finally:
        runtime.shutdown()
    result = {
        "seed": args.seed, "settings": {k: v for k, v in fields.items()}, "target": args.target,
        "reached": reached, "train_cpu_s": round(clock["cpu"], 2), "steps": trace[-1]["step"] if trace else 0,
        "best_accuracy": max((t["accuracy"] for t in trace), default=float("nan")), "trace": trace,
    }  # fmt: skip
    Path(args.log_dir, "study.json").write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=SMOLLM2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--max-cpu-minutes", type=float, default=15.0)
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-problems", type=int, default=200)
    ap.add_argument("--log-dir", default="runs/addition-seed")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="an RLConfig field")
    args = ap.parse_args()
    if args.eval_every < 1 or args.max_cpu_minutes <= 0:
        ap.error("--eval-every must be >= 1 and --max-cpu-minutes > 0")
    r = asyncio.run(study(args))
    got = (
        f"{r['reached']['accuracy']:.3f} at step {r['reached']['step']}, {r['reached']['cpu_s']:.0f} CPU-s"
        if r["reached"]
        else "not reached"
    )
    print(
        f"seed {r['seed']}: target {r['target']}: {got}; best {r['best_accuracy']:.3f} in {r['steps']} steps, {r['train_cpu_s']:.0f} CPU-s"
    )


if __name__ == "__main__":
    main()
