"""P8: a GRPO-shaped training step with shared-prefix batching ÷ the same step in one padded pass.

RL with group-relative advantages trains on ``group`` sampled completions of each prompt, so most
of every row is its prompt. The engine computes a prefix shared by rows of one policy once
(``engine/prefix.py``) and runs only each row's suffix on top of its KV cache. This times one
``forward_backward_many`` + ``optim_step`` on ``prompts`` prompts x ``group`` completions (the
fixed addition task's shape by default: 4 prompts of ~46 tokens that share a 30-token "system
prompt" head, 8 completions of 1-8 tokens, ``importance_sampling``), with sharing on and off,
interleaved; medians. Results are equal either way (tests/test_shared_prefix.py). The last line
is ``P8 <one-pass / shared>`` (> 1 = sharing is faster).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from timing import check, interleaved, print_table

from opentinker.engine import Engine
from opentinker.engine.types import AdamParams, Example, ForwardRequest
from opentinker.lora import LoRAConfig


def batch(vocab: int, prompts: int, group: int, prompt_len: int, head: int, seed: int) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (head,), generator=g).tolist()
    out = []
    for _ in range(prompts):
        prompt = shared + torch.randint(3, vocab, (prompt_len - head,), generator=g).tolist()
        for _ in range(group):
            comp = torch.randint(
                3, vocab, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g
            ).tolist()
            seq = prompt + comp
            n = len(seq) - 1
            adv = torch.tensor([0.0] * (len(prompt) - 1) + [float(torch.randn(1, generator=g))] * len(comp))
            out.append(Example(torch.tensor(seq[:-1]), {
                "target_tokens": torch.tensor(seq[1:]), "advantages": adv, "logprobs": -torch.rand(n, generator=g) - 1,
            }))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="opentinker/tiny")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=46)
    ap.add_argument("--head", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    eng = Engine(args.model)
    aid = eng.create_adapter(LoRAConfig(rank=8, seed=0, train_mlp=False, train_unembed=False))
    data = batch(eng.vocab_size, args.prompts, args.group, args.prompt_len, args.head, seed=0)
    req = ForwardRequest(aid, data, "importance_sampling")

    def step(share: bool):
        def run() -> None:
            eng.share_prefixes = share
            check(eng.forward_backward_many([req]))
            eng.optim_step(aid, AdamParams(learning_rate=1e-4))

        return run

    times = interleaved(
        {"one padded pass": step(False), "shared prefixes": step(True)}, args.repeats, warmup=1
    )
    print(f"{args.model}: {args.prompts} prompts x {args.group} completions, prompt {args.prompt_len} tokens")
    print_table(times, "shared prefixes")
    print(
        f"P8 {statistics.median(times['one padded pass']) / statistics.median(times['shared prefixes']):.2f}"
    )


if __name__ == "__main__":
    main()
