"""P7mt: 8 concurrent RL-style loops in one engine ÷ the same 8 loops one after another.

Each loop is what an RL client does every step, through the public client API: save a snapshot and
sample a group (``num_samples``) from it, build importance-sampling datums with group-relative
advantages, ``forward_backward``, ``optim_step``. Run concurrently (one thread per client), the
scheduler fuses the clients' forward/backward passes into one batch per tick and decodes all their
samples as one mixed-adapter batch; run one after another, nothing can be shared. Same total work
both ways. Last line: ``P7mt <aggregate throughput ratio>`` (docs/DESIGN.md's target ≥ 3).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import numpy as np
from tinker import types

import opentinker
from opentinker.client import Runtime


def rl_loop(service, seed: int, steps: int, group: int, new_tokens: int, model: str) -> None:
    tc = service.create_lora_training_client(model, rank=8, seed=seed)
    tok = tc.get_tokenizer()
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        a, b = (int(x) for x in rng.integers(10, 99, 2))
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}],
            add_generation_prompt=True,
        )["input_ids"]
        sampler = tc.save_weights_and_get_sampling_client()
        params = types.SamplingParams(max_tokens=new_tokens, temperature=1.0, stop=[])
        res = sampler.sample(types.ModelInput.from_ints(prompt), group, params).result()
        rewards = np.array([float(str(a + b) in tok.decode(s.tokens)) for s in res.sequences])
        adv = rewards - rewards.mean() + 0.01
        data = []
        for s, adv_i in zip(res.sequences, adv, strict=True):
            toks = list(prompt) + list(s.tokens)
            n = len(toks) - 1
            lp = [0.0] * (len(prompt) - 1) + list(s.logprobs)
            av = [0.0] * (len(prompt) - 1) + [float(adv_i)] * len(s.tokens)
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(toks[:-1]),
                    loss_fn_inputs={"target_tokens": toks[1:], "logprobs": lp[:n], "advantages": av[:n]},
                )
            )
        tc.forward_backward(data, "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="opentinker/tiny")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    runtime = Runtime(tempfile.mkdtemp(prefix="p7mt-"))
    runtime.base_stack(args.model)  # load once, outside the timings
    work = (args.steps, args.group, args.new_tokens, args.model)

    def concurrent() -> float:
        t = time.perf_counter()
        threads = [
            threading.Thread(target=rl_loop, args=(opentinker.ServiceClient(runtime=runtime), i, *work))
            for i in range(args.clients)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.perf_counter() - t

    def sequential() -> float:
        t = time.perf_counter()
        for i in range(args.clients):
            rl_loop(opentinker.ServiceClient(runtime=runtime), i, *work)
        return time.perf_counter() - t

    concurrent(), sequential()  # warm-up
    c, s = [], []
    for _ in range(args.repeats):
        c.append(concurrent())
        s.append(sequential())
    tc, ts = statistics.median(c), statistics.median(s)
    print(
        f"model {args.model}: {args.clients} RL loops x {args.steps} steps, group {args.group}, {args.new_tokens} new tokens"
    )
    print(f"  concurrent (one engine, fused ticks): {tc:7.2f}s")
    print(f"  one after another:                    {ts:7.2f}s")
    runtime.shutdown()
    print(f"P7mt {ts / tc:.2f}")


if __name__ == "__main__":
    main()
