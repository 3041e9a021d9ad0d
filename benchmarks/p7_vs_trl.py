"""P7: training wall-clock to a target held-out accuracy on the fixed addition task, OpenTinker ÷ TRL.

The task (``opentinker.tasks.arithmetic``): ``What is A + B? Answer with just the number.`` (A, B
uniform in [10, 99]) through the model's chat template; reward 1 if the first integer of the
completion equals A + B; at most 8 new tokens. Accuracy: greedy, on the fixed held-out problems
(``eval_problems()``), which no training prompt ever is.

Both systems train the same model with LoRA rank 8 (alpha 32) on q/k/v/o, 4 prompts x 8
completions per step, temperature 1, the same AdamW (lr, betas 0.9/0.95, eps 1e-12, no weight
decay, no clipping, constant lr: Tinker's ``AdamParams`` defaults), one update per step, in float32
on ``--device`` (default cpu), one after the other in this process (``--order``):

* **TRL**: ``trl.GRPOTrainer`` + ``peft.LoraConfig`` over the model's local folder, conversational
  prompts, the same reward function; its own GRPO loss (``--trl-loss-type``, default ``dapo``) and
  advantage scaling (``--trl-scale-rewards``, default ``group``), ``beta`` 0 (no reference model),
  gradient checkpointing off (TRL turns it on by default; it only costs time here). A callback
  evaluates with HF ``generate`` (batched, left padding) every ``--eval-every`` steps.
* **ours**: an embedded ``opentinker.ServiceClient`` and the sync step of ``run_rl`` (rollouts with
  ``rollout_group`` -> ``build_datums`` -> ``forward_backward`` + ``optim_step`` -> fresh sampler),
  loss ``--loss``; evaluation with ``make_evaluator``. ``--ours-impl run_rl`` drives ``run_rl``
  itself instead (its evaluator reports ``race_done``; ``stop_when`` ends the run on it, so the
  last evaluation and the final checkpoint are written as in any run).

The clock counts training only: it starts after the step-0 evaluation and stops while evaluating
(model loading and set-up are outside it too). A system reaches the target at the first evaluation
with accuracy >= ``--target``; its time is the training clock then. A run also stops when its clock
passes ``--max-minutes``. Last line: ``P7 <ours time / TRL time>`` (target <= 0.5).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/p7_vs_trl.py --model opentinker/tiny \\
        --max-minutes 1 --eval-every 2 --eval-problems 20           # dry run
    .venv/bin/python benchmarks/p7_vs_trl.py                         # the measurement (SmolLM2)

``--only trl|ours`` runs one side and takes the other from ``--out`` (if there) for the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import platform
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from opentinker.models.registry import SMOLLM2, resolve_model_path
from opentinker.tasks.arithmetic import eval_problems, first_int_reward, question

GROUPS, GROUP_SIZE, RANK, ALPHA, MAX_TOKENS, TEMPERATURE = 4, 8, 8, 32, 8, 1.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
SAME = ("model", "target", "lr", "eval_every", "eval_problems", "seed")  # to pair runs of the two sides


class Race:
    """Training clock (evaluation excluded), eval trace and the stopping rule, for one system."""

    def __init__(self, name: str, target: float, max_s: float) -> None:
        self.name, self.target, self.max_s = name, target, max_s
        self.train_s = self.cpu_s = 0.0  # cpu_s: this process's CPU time (all threads) on the clock
        self._since: float | None = None
        self._cpu_since = 0.0
        self.trace: list[dict[str, float]] = []
        self.rewards: list[float] = []
        self.reached_s: float | None = None
        self.reached_step: int | None = None
        self.steps = 0

    def resume(self) -> None:
        self._since, self._cpu_since = time.perf_counter(), time.process_time()

    def pause(self) -> float:
        if self._since is not None:
            self.train_s += time.perf_counter() - self._since
            self.cpu_s += time.process_time() - self._cpu_since
            self._since = None
        return self.train_s

    def record(self, step: int, accuracy: float, eval_s: float) -> None:
        row = {
            "train_s": round(self.train_s, 3),
            "cpu_s": round(self.cpu_s, 3),
            "step": step,
            "accuracy": accuracy,
            "eval_s": round(eval_s, 3),
        }
        self.trace.append(row)
        print(
            f"  [{self.name}] step {step:4d}  train {self.train_s:8.1f}s (cpu {self.cpu_s:7.1f}s)  "
            f"acc {accuracy:.3f}  (eval {eval_s:.1f}s)"
        )
        if self.reached_s is None and accuracy >= self.target:
            self.reached_s, self.reached_step = self.train_s, step

    @property
    def done(self) -> bool:
        return self.reached_s is not None or self.train_s >= self.max_s

    def result(self) -> dict[str, Any]:
        return {
            "reached": self.reached_s is not None,
            "time_to_target_s": self.reached_s,
            "step_at_target": self.reached_step,
            "train_s": round(self.train_s, 3),
            "cpu_s": round(self.cpu_s, 3),
            "steps": self.steps,
            "best_accuracy": max((r["accuracy"] for r in self.trace), default=float("nan")),
            "trace": self.trace,
            "train_reward_per_step": self.rewards,
        }


# ------------------------------------------------------------------------------------------ TRL
def hf_accuracy(model: Any, tok: Any, problems: list[tuple[int, int]], batch: int) -> float:
    """Greedy accuracy with HF ``generate``: chat template, left padding, ``MAX_TOKENS`` new tokens."""
    import torch
    from transformers import GenerationConfig

    gen = GenerationConfig(
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": question(a, b)}], add_generation_prompt=True, tokenize=False
        )
        for a, b in problems
    ]
    was_training = model.training
    model.eval()
    scores: list[float] = []
    try:
        with torch.no_grad():
            for i in range(0, len(texts), batch):
                enc = tok(
                    texts[i : i + batch],
                    return_tensors="pt",
                    padding=True,
                    padding_side="left",
                    add_special_tokens=False,
                ).to(model.device)
                out = model.generate(**enc, generation_config=gen)
                done = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
                scores += [
                    first_int_reward(t, a + b)
                    for t, (a, b) in zip(done, problems[i : i + batch], strict=True)
                ]
    finally:
        model.train(was_training)
    return sum(scores) / len(scores)


def run_trl(args: argparse.Namespace, path: str) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    race = Race("trl", args.target, args.max_minutes * 60)
    problems = eval_problems(args.eval_problems)
    held_out = set(eval_problems())
    rng = random.Random(f"p7/trl/{args.seed}")
    rows = []
    while len(rows) < 4000:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if (a, b) not in held_out:
            rows.append({"prompt": [{"role": "user", "content": question(a, b)}], "answer": a + b})

    def reward(prompts: list, completions: list, answer: list, **_: Any) -> list[float]:
        return [first_int_reward(c[-1]["content"], int(x)) for c, x in zip(completions, answer, strict=True)]

    class EvalAndStop(TrainerCallback):
        def _eval(self, model: Any, step: int) -> None:
            t = time.perf_counter()
            acc = hf_accuracy(model, tok, problems, args.eval_batch)
            race.record(step, acc, time.perf_counter() - t)

        def on_train_begin(self, a: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            self._eval(model, 0)
            race.resume()

        def on_step_end(self, a: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            race.pause()
            race.steps = state.global_step
            if state.global_step % args.eval_every == 0:
                self._eval(model, state.global_step)
            if race.done or state.global_step >= args.max_steps:
                control.should_training_stop = True
            race.resume()

        def on_log(self, a: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
            if logs and "reward" in logs:
                race.rewards.append(float(logs["reward"]))

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out_dir = tempfile.mkdtemp(prefix="p7-trl-")
    fields = GRPOConfig.__dataclass_fields__  # transformers 5 renamed gradient_ to activation_checkpointing
    ckpt = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    config = GRPOConfig(
        output_dir=out_dir,
        num_generations=GROUP_SIZE,
        per_device_train_batch_size=GROUPS * GROUP_SIZE,  # one step = 4 prompts x 8 completions
        gradient_accumulation_steps=1,
        max_completion_length=MAX_TOKENS,
        temperature=TEMPERATURE,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-12,
        weight_decay=0.0,
        max_grad_norm=0.0,
        beta=args.beta,
        loss_type=args.trl_loss_type,
        scale_rewards=args.trl_scale_rewards,
        max_steps=args.max_steps,
        logging_steps=1,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        use_cpu=args.device == "cpu",
        seed=args.seed,
        bf16=False,
        fp16=False,
        **{ckpt: False},  # TRL turns it on by default; it only costs time here
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )
    peft_config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        peft_config=peft_config,
        callbacks=[EvalAndStop()],
    )
    trainer.remove_callback(PrinterCallback)  # its per-step log dicts; the rewards are kept in the JSON
    trainer.train()
    race.pause()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    del trainer, model
    gc.collect()
    return {**race.result(), "trainable_params": trainable}


# ------------------------------------------------------------------------------------------ ours
async def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    from tinker import types

    import opentinker
    from opentinker.client import Runtime
    from opentinker.renderers import get_renderer
    from opentinker.rl.datums import build_datums
    from opentinker.rl.loop import RLConfig, run_rl
    from opentinker.rl.rollout import group_metrics, rollout_group
    from opentinker.tasks.arithmetic import AdditionDataset, make_evaluator

    race = Race("ours", args.target, args.max_minutes * 60)
    tmp = tempfile.mkdtemp(prefix="p7-ours-")
    runtime = Runtime(Path(tmp) / "data", device=args.device)
    service = opentinker.ServiceClient(runtime=runtime)
    cfg = RLConfig(
        base_model=args.model, log_dir=str(Path(tmp) / "run"), steps=args.max_steps,
        groups_per_step=GROUPS, group_size=GROUP_SIZE, lora_rank=RANK,
        train_attn=True, train_mlp=False, train_unembed=False,
        max_tokens=MAX_TOKENS, temperature=TEMPERATURE, learning_rate=args.lr, loss_fn=args.loss,
        eval_every=args.eval_every, seed=args.seed, progress=False, name="p7",
        **dict(parse_set(kv) for kv in args.ours_set),
    )  # fmt: skip
    cfg.check()
    tokenizer = service.create_sampling_client(base_model=args.model).get_tokenizer()  # loads the model
    renderer = get_renderer("auto", tokenizer)
    dataset = AdditionDataset(renderer, GROUPS, GROUP_SIZE, seed=args.seed)
    evaluator = make_evaluator(renderer, n=args.eval_problems, max_tokens=MAX_TOKENS)

    async def evaluate(policy: Any, step: int) -> None:
        t = time.perf_counter()
        acc = (await evaluator(policy, step))["accuracy"]
        race.record(step, acc, time.perf_counter() - t)

    if args.ours_impl == "run_rl":

        async def stopping_evaluator(policy: Any, step: int) -> dict[str, float]:
            race.pause()
            race.steps = step
            await evaluate(policy, step)
            if not race.done:  # once done, the clock stays stopped for run_rl's wrap-up
                race.resume()
            return {"accuracy": race.trace[-1]["accuracy"], "race_done": float(race.done)}

        cfg.stop_when = ("eval/race_done", 1.0)
        await run_rl(cfg, service, dataset, stopping_evaluator)
        race.pause()
        metrics = Path(cfg.log_dir) / "metrics.jsonl"
        if metrics.exists():
            race.rewards = [json.loads(x).get("reward/mean") for x in metrics.read_text().splitlines()]
        runtime.shutdown()
        return race.result()

    # the sync step of run_rl, verbatim in substance (same seeds, same data path)
    tc = await service.create_lora_training_client(
        base_model=cfg.base_model, rank=cfg.lora_rank, seed=cfg.seed,
        train_attn=cfg.train_attn, train_mlp=cfg.train_mlp, train_unembed=cfg.train_unembed,
    )  # fmt: skip
    params = types.SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature)
    adam = types.AdamParams(learning_rate=cfg.learning_rate)
    policy = await tc.save_weights_and_get_sampling_client()
    await evaluate(policy, 0)
    race.resume()
    for step in range(cfg.steps):
        seed = cfg.seed * 1_000_003 + step * 10_007
        groups = list(
            await asyncio.gather(
                *(
                    rollout_group(b, policy, params, seed=seed + 31 * k, timeout_s=cfg.episode_timeout_s, policy_version=step)
                    for k, b in enumerate(dataset.batch(step))
                )
            )
        )  # fmt: skip
        datums, _ = await build_datums(groups, cfg, None)
        if datums:
            fb = tc.forward_backward(datums, cfg.loss_fn, cfg.loss_fn_config)
            opt = tc.optim_step(adam)
            await fb
            await opt
        policy = await tc.save_weights_and_get_sampling_client()
        race.pause()
        race.steps = step + 1
        race.rewards.append(group_metrics(groups)["reward/mean"])
        if (step + 1) % cfg.eval_every == 0:
            await evaluate(policy, step + 1)
        if race.done:
            break
        race.resume()
    race.pause()
    runtime.shutdown()
    return race.result()


# ------------------------------------------------------------------------------------------ main
def summary(name: str, r: dict[str, Any], target: float) -> str:
    if r["reached"]:
        return f"{name}: {r['time_to_target_s']:.1f}s to accuracy >= {target} (step {r['step_at_target']})"
    return (
        f"{name}: not reached in {r['train_s'] / 60:.1f} min ({r['steps']} steps, best accuracy "
        f"{r['best_accuracy']:.3f}); its time is a lower bound: > {r['train_s']:.1f}s"
    )


def ratio(ours: dict[str, Any], trl: dict[str, Any]) -> tuple[float, str]:
    t_ours = ours["time_to_target_s"] if ours["reached"] else ours["train_s"]
    t_trl = trl["time_to_target_s"] if trl["reached"] else trl["train_s"]
    if not ours["reached"] and not trl["reached"]:
        return float("nan"), "neither system reached the target: no ratio"
    r = t_ours / t_trl if t_trl > 0 else float("nan")
    if not ours["reached"]:
        return r, f"ours did not reach the target: {r:.3f} is a LOWER bound of the ratio"
    if not trl["reached"]:
        return r, f"TRL did not reach the target: {r:.3f} is an UPPER bound of the ratio"
    return r, f"ours / TRL time to accuracy {ours['target']}: {r:.3f}"


def parse_set(kv: str) -> tuple[str, Any]:
    """``FIELD=VALUE`` of ``--ours-set``: the value as JSON (numbers, true/false, objects), else text."""
    key, sep, value = kv.partition("=")
    if not sep:
        raise SystemExit(f"--ours-set wants FIELD=VALUE, got {kv!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=SMOLLM2)
    ap.add_argument("--target", type=float, default=0.4, help="held-out greedy accuracy to reach")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--loss", default="importance_sampling", help="our loss_fn")
    ap.add_argument("--max-minutes", type=float, default=25.0, help="training-clock cap per system")
    ap.add_argument("--max-steps", type=int, default=1_000_000, help="step cap per system")
    ap.add_argument("--eval-every", type=int, default=10, help="steps between evaluations (both)")
    ap.add_argument("--eval-problems", type=int, default=200)
    ap.add_argument("--eval-batch", type=int, default=200, help="TRL side: HF generate batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=["trl", "ours"], default=None)
    ap.add_argument("--order", choices=["trl,ours", "ours,trl"], default="trl,ours")
    ap.add_argument("--ours-impl", choices=["loop", "run_rl"], default="loop")
    ap.add_argument(
        "--ours-set", action="append", default=[], metavar="FIELD=VALUE",
        help="another RLConfig field for ours, e.g. replay_size=64 (repeatable; JSON values)",
    )  # fmt: skip
    ap.add_argument("--beta", type=float, default=0.0, help="TRL KL coefficient")
    ap.add_argument("--trl-loss-type", default="dapo")
    ap.add_argument("--trl-scale-rewards", default="group")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="benchmarks/results/p7_vs_trl.json")
    args = ap.parse_args()
    if args.eval_every < 1:
        ap.error("--eval-every must be >= 1")
    return args


def main() -> None:
    import torch
    import transformers
    import trl

    args = parse()
    path = resolve_model_path(args.model)
    out = Path(args.out)
    saved = json.loads(out.read_text()) if out.exists() else {}
    results: dict[str, Any] = {}
    for name, r in saved.get("results", {}).items():  # an earlier run of one side: same settings only
        if all(r.get("config", {}).get(k) == getattr(args, k) for k in SAME):
            results[name] = r
        else:
            print(f"(ignoring the earlier {name} result in {out}: other {', '.join(SAME)})")
    print(
        f"P7: {args.model} ({path}), LoRA r{RANK} q/k/v/o, {GROUPS} prompts x {GROUP_SIZE}, lr {args.lr}, "
        f"target {args.target} on {args.eval_problems} held-out, eval every {args.eval_every} steps, "
        f"cap {args.max_minutes} min; torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"trl {trl.__version__}, transformers {transformers.__version__}"
    )
    order = [args.only] if args.only else args.order.split(",")
    for name in order:
        print(f"{name}:")
        r = run_trl(args, path) if name == "trl" else asyncio.run(run_ours(args))
        r["target"] = args.target
        r["config"] = {k: v for k, v in vars(args).items() if k not in ("only", "order", "out")}
        r["machine"] = {"platform": platform.platform(), "torch_threads": torch.get_num_threads()}
        results[name] = r
        print("  " + summary(name, r, args.target))
        gc.collect()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "p7_vs_trl", "results": results}, indent=1))
    print(f"wrote {out}")
    if "ours" in results and "trl" in results:
        for name in ("trl", "ours"):
            if name not in order:
                print("  (from an earlier run) " + summary(name, results[name], results[name]["target"]))
        r, why = ratio(results["ours"], results["trl"])
        print(why)
        print(f"P7 {r:.3f}" if math.isfinite(r) else "P7 nan")
    else:
        print("only one system measured: no ratio")
        print("P7 nan")


if __name__ == "__main__":
    main()
