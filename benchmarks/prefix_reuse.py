"""Multi-turn sampling with the prefix cache ÷ without: the time to sample every turn of a batch of
conversations (each next prompt = the previous prompt + the sampled reply + an environment answer,
as ``MessageEnv.step`` builds it).

Conversations are spread over ``--adapters`` policies; every turn is one ``generate`` call of all
conversations (temperature 1, seeded, fixed-length replies). Each repeat starts from an empty cache
(a fresh backend) and runs all turns; the two ways alternate and medians are quoted. The last line
is ``prefix_reuse <ratio>`` (time without the cache ÷ time with it; > 1 = faster with it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from opentinker.engine import Engine
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="opentinker/tiny")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--answer-tokens", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    base = load_base_model(args.model)
    engine = Engine(base)
    ids = [engine.create_adapter(LoRAConfig(rank=8, seed=i)) for i in range(args.adapters)]
    policies = [ids[i % len(ids)] for i in range(args.conversations)]
    g = torch.Generator().manual_seed(0)
    vocab = base.vocab_size
    first = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in policies]
    answers = [
        [torch.randint(3, vocab, (args.answer_tokens,), generator=g).tolist() for _ in policies]
        for _ in range(args.turns)
    ]
    params = SamplingParams(max_tokens=args.reply_tokens, temperature=1.0, seed=0, stop=[])

    def conversation(cache_bytes: int | None) -> tuple[float, int]:
        kw = {} if cache_bytes is None else {"prefix_cache_bytes": cache_bytes}
        backend = NativeBackend(engine, **kw)
        prompts = [list(p) for p in first]
        t = time.perf_counter()
        for turn in range(args.turns):
            out = backend.generate(
                [SampleRequest(p, q, params) for p, q in zip(policies, prompts, strict=True)]
            )
            replies = []
            for r in out:
                assert not isinstance(r, Exception)
                replies.append(r.sequences[0].tokens)
            prompts = [q + a + b for q, a, b in zip(prompts, replies, answers[turn], strict=True)]
        return time.perf_counter() - t, backend.prefix_cache.reused_tokens

    conversation(None), conversation(0)  # warm-up
    with_cache, without = [], []
    reused = 0
    for _ in range(args.repeats):
        dt, reused = conversation(None)
        with_cache.append(dt)
        without.append(conversation(0)[0])
    tw, tn = statistics.median(with_cache), statistics.median(without)
    total = sum(args.prompt_len + k * (args.reply_tokens + args.answer_tokens) for k in range(args.turns))
    print(
        f"model {args.model}: {args.conversations} conversations on {args.adapters} adapters, {args.turns} turns, "
        f"prompt {args.prompt_len} tokens, replies {args.reply_tokens}, answers {args.answer_tokens}"
    )
    print(f"  prompt tokens over all turns: {total * args.conversations}; served from the cache: {reused}")
    print(f"  with the prefix cache:    {tw:.3f} s (median)")
    print(f"  without (prefill whole):  {tn:.3f} s (median)")
    print(f"prefix_reuse {tn / tw:.2f}")


if __name__ == "__main__":
    main()
