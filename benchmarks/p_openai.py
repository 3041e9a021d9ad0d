"""Popenai: 16 concurrent OpenAI-API clients on 16 different samplers ÷ the same load through the
Tinker ``sample`` route, sampled tokens/s.

What it measures (issue 31; target ≥ 0.95: the compatibility layer costs nothing measurable):
one ``opentinker serve`` child on the base model; ``--adapters`` (16) LoRAs, each trained one SFT
step on its own text and saved as sampler weights. Then, in rounds, ``--adapters`` client threads,
one per adapter, each send ``--requests`` requests one after another (``--new-tokens`` sampled
tokens each, EOS ignored, seeded), two ways on the same server:

- **openai**: the ``openai`` package (``OpenAI(base_url=…/v1)``), ``completions.create`` with the
  adapter's ``tinker://…/sampler_weights/…`` path as ``model`` and the prompt as token ids;
- **tinker**: the official ``tinker`` SDK, ``SamplingClient.sample`` on the same path.

Both go through the same sampling loop (the 16 adapters decode in one mixed batch), so the ratio is
what the OpenAI layer (JSON parsing, model resolution, the response objects) costs per token next
to the Tinker route's protobuf and its long-polled futures. The rounds alternate (openai, tinker,
tinker, openai, …) after a warm-up round each, and the medians of tokens/s are quoted. The two
sides' tokens are checked equal (same prompts, seeds and samplers). It prints
``Popenai <openai tokens/s ÷ tinker tokens/s>``.

In the same rounds (issue 43), chat-rendered prompts two more ways each:

- **responses**: the Responses API (``responses.create``, the prompt as its ``input``, EOS ignored)
  ÷ **tinker-chat**, the Tinker route on the same chat-rendered tokens: ``Presponses`` (target
  ≥ 0.95); its sampled token count is checked (``usage.output_tokens``);
- **structured**: chat completions with a ``json_schema`` ``response_format`` (an array of strings,
  which the model fills up to ``--new-tokens``: constrained decoding on every step) ÷ **free**,
  the same request without it: ``Pstructured`` (report), each side's tokens/s counted from its
  answers' ``usage``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/p_openai.py --repeats 5
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from timing import interleaved
from tinker import types

from opentinker.server.local import LocalServer

KEY = "tml-popenai-benchmark"
LIST_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}}},
    "required": ["items"],
}


def train_adapters(service: Any, model: str, n: int, rank: int) -> tuple[list[str], Any]:
    """``n`` LoRAs, each one SFT step on its own text, saved as sampler weights: their paths (and
    the tokenizer)."""
    paths, tok = [], None
    for i in range(n):
        tc = service.create_lora_training_client(base_model=model, rank=rank, seed=i).result()
        tok = tok or tc.get_tokenizer()
        ids = tok.encode(f"Adapter {i} answers: " + "yes " * (i + 2))
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
        )
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        paths.append(tc.save_weights_for_sampler(f"popenai-{i}").result().path)
    return paths, tok


def rounds(
    n: int, requests: int, one: Callable[[int, int], list[int]], pool: ThreadPoolExecutor
) -> Callable[[], object]:
    """A round: ``n`` clients at once, each ``requests`` requests in a row; the tokens kept."""
    out: list[list[list[int]]] = []

    def client(i: int) -> list[list[int]]:
        return [one(i, r) for r in range(requests)]

    def run() -> None:
        out.append([t for got in pool.map(client, range(n)) for t in got])

    run.tokens = out  # type: ignore[attr-defined]
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opentinker/tiny")
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--requests", type=int, default=4, help="requests per client per round")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    logging.getLogger("tinker").setLevel(logging.ERROR)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    import openai
    import tinker  # after TINKER_TELEMETRY is set

    tmp = tempfile.TemporaryDirectory(prefix="popenai-")
    with tmp, LocalServer(["--dev", "--base-model", args.model], data_dir=tmp.name) as srv:
        service = tinker.ServiceClient(base_url=srv.base_url, api_key=KEY)
        paths, tok = train_adapters(service, args.model, args.adapters, args.rank)
        samplers = [service.create_sampling_client(model_path=path).result() for path in paths]
        prompts = [
            tok.encode(f"Question {i}: tell me about the number {i * 7}.") for i in range(args.adapters)
        ]
        oa = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY, max_retries=0, timeout=600)
        m = args.new_tokens

        def via_openai(i: int, r: int) -> list[int]:
            c = oa.completions.create(
                model=paths[i],
                prompt=prompts[i],
                max_tokens=m,
                temperature=1.0,
                seed=r,
                logprobs=0,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
            )
            lp = c.choices[0].logprobs
            assert lp is not None and lp.tokens is not None
            return [int(t.removeprefix("token_id:")) for t in lp.tokens]

        def via_tinker(i: int, r: int) -> list[int]:
            params = types.SamplingParams(max_tokens=m, temperature=1.0, seed=r, stop=[])
            res = samplers[i].sample(types.ModelInput.from_ints(prompts[i]), 1, params).result()
            return list(res.sequences[0].tokens)

        ask = [f"Question {i}: tell me about the number {i * 7}." for i in range(args.adapters)]
        chat_ids = [  # as the server renders a chat prompt (openai_format.ChatFormat.render)
            tok.encode(
                tok.apply_chat_template(
                    [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
                ),
                add_special_tokens=False,
            )
            for q in ask
        ]

        def via_responses(i: int, r: int) -> list[int]:
            got = oa.responses.create(
                model=paths[i],
                input=ask[i],
                max_output_tokens=m,
                temperature=1.0,
                extra_body={"seed": r, "ignore_eos": True},
            )
            assert got.usage is not None and got.usage.output_tokens == m, got.usage
            return [0] * got.usage.output_tokens

        def via_tinker_chat(i: int, r: int) -> list[int]:
            params = types.SamplingParams(max_tokens=m, temperature=1.0, seed=r, stop=[])
            res = samplers[i].sample(types.ModelInput.from_ints(list(chat_ids[i])), 1, params).result()
            return list(res.sequences[0].tokens)

        def via_chat(schema: bool) -> Callable[[int, int], list[int]]:
            fmt = {"type": "json_schema", "json_schema": {"name": "list", "schema": LIST_SCHEMA}}

            def one(i: int, r: int) -> list[int]:
                extra: dict[str, Any] = {"seed": r, "ignore_eos": True}
                if schema:
                    extra["response_format"] = fmt
                got = oa.chat.completions.create(
                    model=paths[i],
                    messages=[{"role": "user", "content": ask[i]}],
                    max_tokens=m,
                    temperature=1.0,
                    extra_body=extra,
                )
                assert got.usage is not None
                return [0] * got.usage.completion_tokens

            return one

        with ThreadPoolExecutor(args.adapters) as pool:
            sides = {
                "openai": rounds(args.adapters, args.requests, via_openai, pool),
                "tinker": rounds(args.adapters, args.requests, via_tinker, pool),
                "responses": rounds(args.adapters, args.requests, via_responses, pool),
                "tinker-chat": rounds(args.adapters, args.requests, via_tinker_chat, pool),
                "structured": rounds(args.adapters, args.requests, via_chat(True), pool),
                "free": rounds(args.adapters, args.requests, via_chat(False), pool),
            }
            times = interleaved(dict(sides), args.repeats, args.warmup)
    got = {name: run.tokens for name, run in sides.items()}  # type: ignore[attr-defined]
    same = got["openai"][-1] == got["tinker"][-1]
    counted = {name: statistics.mean(sum(len(t) for t in one) for one in runs) for name, runs in got.items()}
    print(
        f"model {args.model}, {args.adapters} clients on {args.adapters} samplers, {args.requests} requests "
        f"each x {m} new tokens per round, {args.repeats} repeats; same tokens both ways: {same}"
    )
    print(f"{'route':<12} {'median s':>9} {'min s':>7} {'max s':>7} {'tokens/s':>9}")
    rates = {}
    for name, ts in times.items():
        rates[name] = statistics.median(counted[name] / t for t in ts)
        med = statistics.median(ts)
        print(f"{name:<12} {med:>9.2f} {min(ts):>7.2f} {max(ts):>7.2f} {rates[name]:>9.0f}")
    best = min(times["tinker"]) / min(times["openai"])
    print(f"best-of ratio {best:.3f} (less sensitive to a busy machine)")
    print(f"Presponses {rates['responses'] / rates['tinker-chat']:.3f}")
    print(f"Pstructured {rates['structured'] / rates['free']:.3f} (tokens/s with a schema ÷ without)")
    print(f"Popenai {rates['openai'] / rates['tinker']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
