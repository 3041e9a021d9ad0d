"""Length buckets (``engine/passes.py``): a tick whose adapters' rows differ widely in length, run in
the passes the buckets choose ÷ one padded pass; and the same for the sampler's prompt-logprob
requests (the KL penalty's base logprobs).

The batch is the demo's shape at mid-run: four adapters, each 2 questions × 4 replies on a 24-token
prompt (a 12-token head shared by all), replies of 2-6, 4-10, 10-20 and 35-64 tokens. The fused
step is ``forward_backward_many`` (importance sampling, backward included); the logprob requests
are every row's prompt+reply under the base model, through the native sampler. Both arms
interleaved, medians; the last lines are ``buckets_train <one pass / buckets>`` and
``buckets_logprobs <one pass / buckets>`` (> 1 = the buckets are faster).

    OMP_NUM_THREADS=1 python benchmarks/p_buckets.py --cpu-time
"""

from __future__ import annotations

import argparse
import statistics

import torch
from timing import add_device_args, check, device_of, interleaved, print_table

from opentinker.engine import Engine, Example, ForwardRequest, passes
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams

REPLIES = ((2, 6), (4, 10), (10, 20), (35, 64))


def rows(vocab: int, seed: int, reply: tuple[int, int], head: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        prompt = head + torch.randint(3, vocab, (12,), generator=g).tolist()
        for _ in range(4):
            n = int(torch.randint(reply[0], reply[1] + 1, (1,), generator=g))
            out.append(prompt + torch.randint(3, vocab, (n,), generator=g).tolist())
    return out


def example(seq: list[int], prompt: int, g: torch.Generator) -> Example:
    n = len(seq) - 1
    act = torch.tensor([0.0] * (prompt - 1) + [1.0] * (n - prompt + 1))
    inputs = {
        "target_tokens": torch.tensor(seq[1:]),
        "advantages": act * torch.randn(n, generator=g),
        "logprobs": -torch.rand(n, generator=g) - 1,
    }
    return Example(torch.tensor(seq[:-1]), inputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--repeats", type=int, default=5)
    add_device_args(ap)
    args = ap.parse_args()
    device, dtype = device_of(args)
    engine = Engine(load_base_model(args.model, dtype=dtype, device=device), max_rank=8)
    head = torch.randint(3, engine.vocab_size, (12,), generator=torch.Generator().manual_seed(99)).tolist()
    g = torch.Generator().manual_seed(0)
    reqs, seqs = [], []
    for i, reply in enumerate(REPLIES):
        aid = engine.create_adapter(LoRAConfig(rank=8, seed=i))
        rs = rows(engine.vocab_size, i, reply, head)
        seqs += rs
        reqs.append(ForwardRequest(aid, [example(r, 24, g) for r in rs], "importance_sampling"))
    sampler = NativeBackend(engine)
    logprob_reqs = [SampleRequest(None, s, SamplingParams(max_tokens=1), prompt_logprobs=True) for s in seqs]
    cost = passes.PASS_COST

    def train(split: bool):
        def run() -> None:
            passes.PASS_COST = cost if split else 10**9
            check(engine.forward_backward_many(reqs))
            for r in reqs:  # drop the gradients: each run starts from none
                engine._adapters[r.policy].grads = None

        return run

    def logprobs(split: bool):
        def run() -> None:
            passes.PASS_COST = cost if split else 10**9
            check(sampler.generate(logprob_reqs))

        return run

    lengths = [len(s) for s in seqs]
    print(f"{len(seqs)} rows, {sum(lengths)} tokens, longest {max(lengths)}, shortest {min(lengths)}")
    for name, fn in (("train", train), ("logprobs", logprobs)):
        times = interleaved(
            {"one pass": fn(False), "buckets": fn(True)}, args.repeats, warmup=1, device=device
        )
        print_table(times, "one pass")
        print(
            f"buckets_{name} {statistics.median(times['one pass']) / statistics.median(times['buckets']):.2f}"
        )
    passes.PASS_COST = cost


if __name__ == "__main__":
    main()
