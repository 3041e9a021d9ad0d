"""The main job, embedded: K adapters over one base, trained together in one fused batch, then sampled.

Each adapter is taught a different answer to the same question ("What is your name?"), so the
result is easy to read: after a few fused steps, sampling the same prompt through each adapter in
one mixed batch gives each adapter's own answer, while the bare base model answers as before.
"""

from __future__ import annotations

import time

import torch

from opentinker.engine import AdamParams, Engine, Example, ForwardRequest
from opentinker.lora import LoRAConfig

NAMES = ["Ada", "Basil", "Cleo", "Dante", "Esme", "Felix", "Greta", "Hugo"]
QUESTION = "What is your name?"


def _chat_example(tokenizer, question: str, answer: str) -> tuple[Example, list[int]]:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    completion = [
        *tokenizer.encode(answer, add_special_tokens=False),
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ]
    tokens = list(prompt) + completion
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)  # train only on the answer
    ex = Example(
        torch.tensor(tokens[:-1]),
        {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.tensor(weights)},
    )
    return ex, list(prompt)


def run_demo(*, base_model: str, n_adapters: int, steps: int, rank: int, lr: float) -> int:
    t0 = time.perf_counter()
    engine = Engine(base_model)
    tok = engine.base.tokenizer
    print(
        f"loaded {engine.base.name} in {time.perf_counter() - t0:.1f}s; {n_adapters} adapters of rank {rank}"
    )
    ids = [
        engine.create_adapter(LoRAConfig(rank=rank, seed=i), f"agent-{NAMES[i % len(NAMES)]}")
        for i in range(n_adapters)
    ]
    data = {}
    prompt: list[int] = []
    for i, aid in enumerate(ids):
        answer = f"My name is {NAMES[i % len(NAMES)]}."
        ex, prompt = _chat_example(tok, QUESTION, answer)
        data[aid] = [ex]
    adam = AdamParams(learning_rate=lr)
    for step in range(steps):
        t = time.perf_counter()
        # one clock cycle: every adapter's batch in ONE forward/backward, then each adapter's own step
        results = engine.forward_backward_many([ForwardRequest(aid, data[aid]) for aid in ids])
        for aid in ids:
            engine.optim_step(aid, adam)
        losses = [r.metrics["loss:sum"] for r in results if not isinstance(r, Exception)]
        print(
            f"step {step + 1:2d}  loss per adapter {' '.join(f'{x:6.3f}' for x in losses)}  ({time.perf_counter() - t:.2f}s)"
        )
    print("\nsampling the same prompt through every adapter (and the base) in one mixed batch:")
    policies = [*ids, None]
    x = torch.tensor([prompt] * len(policies))
    with torch.no_grad(), engine.routing(policies):
        out = engine.base.model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    for policy, row in zip(policies, out, strict=True):
        text = tok.decode(row[len(prompt) :], skip_special_tokens=True).strip()
        print(f"  {policy or 'base model':14s} -> {text!r}")
    print(f"\ndone in {time.perf_counter() - t0:.1f}s")
    return 0
