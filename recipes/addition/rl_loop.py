"""RL on 2-digit addition in one flat loop, with nothing but the Tinker client API.

    OMP_NUM_THREADS=1 .venv/bin/python recipes/addition/rl_loop.py --max-minutes 15 --eval-every 20
    OMP_NUM_THREADS=1 .venv/bin/python recipes/addition/rl_loop.py --model opentinker/tiny --steps 2

The whole algorithm, top to bottom, as the library's ``run_rl`` runs it on ``--task addition``
(same problems, reward, held-out set, hyper-parameters; the library adds async mode, multi-turn
episodes, checkpoints, replay, logging): per step, 4 problems x 8 samples from the current policy;
reward 1 if the reply's first integer is A + B; advantage = reward - the group's mean (groups that
all score the same carry no signal and are skipped); one ``forward_backward`` with the
``importance_sampling`` loss and one ``optim_step``; then a sampling client of the new weights.
Held-out accuracy: greedy on 200 fixed problems. ``--base-url URL --api-key KEY`` runs it against
``opentinker serve`` (or any Tinker server) through the official SDK.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time

from tinker import types

import opentinker

EVAL_SEED = 20_261_129  # the held-out problems: the same 200 as the library's task


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}? Answer with just the number."


def reward(text: str, a: int, b: int) -> float:
    m = re.search(r"-?\d+", text)  # exact match on the first integer; the reply may go on after it
    return 1.0 if m is not None and int(m.group()) == a + b else 0.0


def held_out(n: int) -> list[tuple[int, int]]:
    rng, out = random.Random(EVAL_SEED), []
    while len(out) < n:
        p = (rng.randint(10, 99), rng.randint(10, 99))
        if p not in out:
            out.append(p)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--base-url", default=None, help="a Tinker server (default: embedded)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--max-minutes", type=float, default=15.0, help="stop after this much training clock")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--groups", type=int, default=4, help="problems per step")
    ap.add_argument("--group-size", type=int, default=8, help="samples per problem")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-problems", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t_wall = time.monotonic()

    service = opentinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
    training = service.create_lora_training_client(
        base_model=args.model, rank=args.rank, seed=args.seed, train_attn=True, train_mlp=False, train_unembed=False
    )  # fmt: skip
    tokenizer = training.get_tokenizer()

    def prompt(a: int, b: int) -> list[int]:  # the model's own chat template, ready for the reply
        msgs = [{"role": "user", "content": question(a, b)}]
        chat = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(chat, add_special_tokens=False)

    def text(tokens: list[int]) -> str:
        return tokenizer.decode(tokens, skip_special_tokens=True)

    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]  # ChatML's end of turn
    train_params = types.SamplingParams(max_tokens=8, temperature=1.0, stop=stop)
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0, stop=stop)
    held = held_out(200)  # never trained on, whichever of them --eval-problems evaluates
    problems = held[: args.eval_problems]
    adam = types.AdamParams(learning_rate=args.lr)

    def evaluate(policy: opentinker.SamplingClient) -> float:
        # submit every request first (futures), then collect: the sampler batches them together
        futs = [policy.sample(types.ModelInput.from_ints(prompt(a, b)), 1, greedy) for a, b in problems]
        hits = [
            reward(text(f.result().sequences[0].tokens), a, b)
            for f, (a, b) in zip(futs, problems, strict=True)
        ]
        return sum(hits) / len(hits)

    policy = training.save_weights_and_get_sampling_client(name="step-0")
    first = evaluate(policy)
    print(json.dumps({"step": 0, "eval/accuracy": first}), flush=True)
    last, train_clock, step = first, 0.0, 0
    for step in range(args.steps):
        t0 = time.monotonic()
        # 1. this step's problems (never a held-out one), and group_size samples of each
        rng = random.Random(f"addition/{args.seed}/{step}")
        batch: list[tuple[int, int]] = []
        while len(batch) < args.groups:
            p = (rng.randint(10, 99), rng.randint(10, 99))
            if p not in held:
                batch.append(p)
        prompts = [prompt(a, b) for a, b in batch]
        seed = args.seed * 1_000_003 + step * 10_007  # the library's seeds: the same samples
        futs = [
            policy.sample(types.ModelInput.from_ints(ob_T), args.group_size, train_params.model_copy(update={"seed": seed + 31 * k}))
            for k, ob_T in enumerate(prompts)
        ]  # fmt: skip

        # 2. rewards -> group-relative advantages -> datums (the loss sees only the sampled tokens)
        datums: list[types.Datum] = []
        rewards: list[float] = []
        for (a, b), ob_T, fut in zip(batch, prompts, futs, strict=True):
            seqs = fut.result().sequences
            rewards_G = [reward(text(s.tokens), a, b) for s in seqs]
            rewards += rewards_G
            mean = sum(rewards_G) / len(rewards_G)
            if all(r == rewards_G[0] for r in rewards_G):
                continue  # a constant group: every advantage is 0
            for s, r in zip(seqs, rewards_G, strict=True):
                ac_T, logprobs_T = list(s.tokens), list(s.logprobs or [])
                tokens_T = ob_T + ac_T
                n_ob = len(ob_T) - 1  # input is tokens_T[:-1]; position i predicts tokens_T[i + 1]
                datums.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens_T[:-1]),
                        loss_fn_inputs={
                            "target_tokens": types.TensorData(data=tokens_T[1:], dtype="int64"),
                            "logprobs": types.TensorData(data=[0.0] * n_ob + logprobs_T, dtype="float32"),
                            "advantages": types.TensorData(data=[0.0] * n_ob + [r - mean] * len(ac_T), dtype="float32"),
                        },
                    )
                )  # fmt: skip

        # 3. the update, then a sampling client of the new weights (the next step's policy)
        if datums:
            fb = training.forward_backward(datums, "importance_sampling")
        opt = training.optim_step(adam)  # with no datums it still steps: Adam's momentum carries on
        loss = fb.result().metrics.get("loss:sum", float("nan")) if datums else float("nan")
        opt.result()
        policy = training.save_weights_and_get_sampling_client(name=f"step-{step + 1}")
        train_clock += time.monotonic() - t0

        row = {"step": step + 1, "reward/mean": sum(rewards) / len(rewards), "train/datums": len(datums),
               "loss/sum": loss, "time/train_clock_s": round(train_clock, 1)}  # fmt: skip
        done = step + 1 == args.steps or train_clock >= 60 * args.max_minutes
        if done or (args.eval_every and (step + 1) % args.eval_every == 0):
            row["eval/accuracy"] = last = evaluate(policy)  # evaluations are not on the training clock
        print(json.dumps(row), flush=True)
        if done:
            break
    summary = {"model": args.model, "steps": step + 1, "eval/accuracy_start": first, "eval/accuracy_end": last,
               "train_clock_s": round(train_clock, 1), "wall_s": round(time.monotonic() - t_wall, 1)}  # fmt: skip
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
