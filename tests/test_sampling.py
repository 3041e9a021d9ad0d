"""The native rollout backend: invariant 3, greedy/seed/stop/num_samples semantics, pinned versions."""

from __future__ import annotations

import math

import pytest
import torch

from opentinker.engine import AdamParams, Engine, EngineError, Example, ForwardRequest, UnknownPolicyError
from opentinker.lora import LoRAConfig
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams
from opentinker.sampling.native import MIN_SHARED_PREFIX, common_prompt_prefix
from tests.conftest import make_examples
from tests.tolerances import LOGPROB_ATOL, assert_greedy_equal, assert_logprobs_close

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def _train(engine: Engine, aid: str, seed: int, steps: int = 2) -> None:
    for s in range(steps):
        engine.forward_backward(ForwardRequest(aid, make_examples(4, engine.vocab_size, seed=seed * 10 + s)))
        engine.optim_step(aid, AdamParams(learning_rate=2e-2))


@pytest.fixture
def setup(engine: Engine) -> tuple[Engine, NativeBackend, list[str], list[list[int]]]:
    a = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    b = engine.create_adapter(LoRAConfig(rank=8, seed=1, train_mlp=False))
    _train(engine, a, 1)
    _train(engine, b, 2)
    tok = engine.base.tokenizer
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": "What is 23 + 45? Answer with just the number."}],
            add_generation_prompt=True,
        )["input_ids"],
        tok.encode("Hello there, how are you"),
        tok.encode("1 2 3"),
    ]
    return engine, NativeBackend(engine), [a, b], prompts


def _forward_logprobs(engine: Engine, policy: str | None, tokens: list[int]) -> torch.Tensor:
    ex = Example(torch.tensor(tokens[:-1]), {"target_tokens": torch.tensor(tokens[1:])})
    return engine.forward_backward(ForwardRequest(policy, [ex], backward=False)).outputs[0]["logprobs"]


def test_inv3_sampled_logprobs_match_forward_in_mixed_batch(setup) -> None:
    engine, sampler, (a, b), prompts = setup
    snap = engine.snapshot(a).snapshot_id
    _train(engine, a, 3)  # the live adapter moves on; the snapshot must not
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=0, stop=[])
    reqs = [SampleRequest(p, prompts[i % 3], params, num_samples=2) for i, p in enumerate([a, b, snap, None])]
    results = sampler.generate(reqs)
    for req, res in zip(reqs, results, strict=True):
        assert not isinstance(res, Exception)
        assert len(res.sequences) == 2
        for seq in res.sequences:
            lp = _forward_logprobs(engine, req.policy, req.prompt + seq.tokens)[len(req.prompt) - 1 :]
            assert_logprobs_close(lp, seq.logprobs)


def test_greedy_rows_of_a_mixed_batch_equal_their_solo_runs(setup) -> None:
    engine, sampler, (a, b), prompts = setup
    reqs = [SampleRequest(p, prompts[i % 3], GREEDY) for i, p in enumerate([a, b, None, b, a])]
    mixed = sampler.generate(reqs)
    for req, res in zip(reqs, mixed, strict=True):
        [solo] = sampler.generate([req])
        assert not isinstance(res, Exception) and not isinstance(solo, Exception)
        assert_greedy_equal(res.sequences[0].tokens, solo.sequences[0].tokens, f"row {req.policy}")
    outs = {tuple(r.sequences[0].tokens) for r in mixed[:3] if not isinstance(r, Exception)}
    assert len(outs) > 1  # the adapters really differ


def test_seed_reproduces_and_is_independent_of_the_batch(setup) -> None:
    engine, sampler, (a, b), prompts = setup
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, stop=[])
    req = SampleRequest(a, prompts[1], params, num_samples=3)
    [r1] = sampler.generate([req])
    r2 = sampler.generate([SampleRequest(b, prompts[0], params), req])[1]
    other = SampleRequest(
        a, prompts[1], SamplingParams(max_tokens=10, temperature=1.0, seed=99, stop=[]), num_samples=3
    )
    [r3] = sampler.generate([other])
    assert not isinstance(r1, Exception) and not isinstance(r2, Exception) and not isinstance(r3, Exception)
    assert [s.tokens for s in r1.sequences] == [s.tokens for s in r2.sequences]
    assert [s.tokens for s in r1.sequences] != [s.tokens for s in r3.sequences]
    assert len({tuple(s.tokens) for s in r1.sequences}) > 1  # samples of one request differ


def test_max_tokens_and_eos_semantics(setup) -> None:
    engine, sampler, (a, _), prompts = setup
    eos = engine.base.tokenizer.eos_token_id
    [never] = sampler.generate(
        [SampleRequest(None, prompts[0], SamplingParams(max_tokens=7, temperature=0.0, stop=[]))]
    )
    assert not isinstance(never, Exception)
    seq = never.sequences[0]
    assert len(seq.tokens) == 7 and seq.stop_reason == "length"
    if eos in seq.tokens:  # stop=[] must run past EOS; stop=None must end at it
        [at_eos] = sampler.generate(
            [SampleRequest(None, prompts[0], SamplingParams(max_tokens=7, temperature=0.0))]
        )
        assert not isinstance(at_eos, Exception)
        cut = seq.tokens.index(eos) + 1
        assert at_eos.sequences[0].tokens == seq.tokens[:cut] and at_eos.sequences[0].stop_reason == "stop"
    stop_tok = seq.tokens[2]
    [by_id] = sampler.generate(
        [SampleRequest(None, prompts[0], SamplingParams(max_tokens=7, temperature=0.0, stop=[stop_tok]))]
    )
    assert not isinstance(by_id, Exception)
    assert by_id.sequences[0].tokens == seq.tokens[: seq.tokens.index(stop_tok) + 1]
    assert by_id.sequences[0].stop_reason == "stop"


def test_non_empty_stop_list_also_stops_at_eos(setup) -> None:
    """The SDK's contract: ``None`` stops at EOS, a non-empty list at its entries *and* at EOS,
    only ``[]`` at nothing. The EOS set is pointed at a token greedy decoding is known to emit, so
    every case is exercised whatever the tiny model's weights make of the real EOS."""
    engine, sampler, _, prompts = setup
    [free] = sampler.generate(
        [SampleRequest(None, prompts[0], SamplingParams(max_tokens=8, temperature=0.0, stop=[]))]
    )
    assert not isinstance(free, Exception)
    tokens = free.sequences[0].tokens
    eos = tokens[3]
    cut = tokens.index(eos) + 1
    sampler.eos_ids = {eos}
    never = next(t for t in range(engine.vocab_size) if t not in tokens)  # an id greedy never emits
    cases = {
        "None": (None, cut),
        "[]": ([], len(tokens)),
        "ids": ([never], cut),
        "strings": (["\x00never-in-text\x00"], cut),
    }
    for name, (stop, n) in cases.items():
        [res] = sampler.generate(
            [SampleRequest(None, prompts[0], SamplingParams(max_tokens=8, temperature=0.0, stop=stop))]
        )
        assert not isinstance(res, Exception)
        seq = res.sequences[0]
        assert seq.tokens == tokens[:n], name
        assert seq.stop_reason == ("length" if n == len(tokens) else "stop"), name


def test_stop_string_spanning_tokens(setup) -> None:
    engine, sampler, _, prompts = setup
    tok = engine.base.tokenizer
    [free] = sampler.generate(
        [SampleRequest(None, prompts[1], SamplingParams(max_tokens=12, temperature=0.0, stop=[]))]
    )
    assert not isinstance(free, Exception)
    tokens = free.sequences[0].tokens
    upto = [tok.decode(tokens[:n]) for n in range(len(tokens) + 1)]
    for i in range(1, len(tokens)):
        prev, cur = upto[i], upto[i + 1]
        if prev and len(cur) > len(prev) and cur.startswith(prev) and prev[-1] + cur[len(prev)] not in prev:
            break
    else:
        pytest.skip("no two consecutive text tokens in this completion")
    stop = prev[-1] + cur[len(prev)]  # last char of token i-1 + first char of token i
    [res] = sampler.generate(
        [SampleRequest(None, prompts[1], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop]))]
    )
    assert not isinstance(res, Exception)
    assert res.sequences[0].stop_reason == "stop"
    assert res.sequences[0].tokens == tokens[: i + 1]  # ends at the token that completes the string


def test_pinned_snapshot_is_unchanged_by_training_and_survives_retire_of_others(setup) -> None:
    engine, sampler, (a, _), prompts = setup
    snap = engine.snapshot(a).snapshot_id
    req = SampleRequest(
        snap, prompts[0], SamplingParams(max_tokens=8, temperature=1.0, seed=5, stop=[]), prompt_logprobs=True
    )
    [before] = sampler.generate([req])
    _train(engine, a, 7, steps=3)
    other = engine.snapshot(a).snapshot_id
    sampler.retire(other)
    [after] = sampler.generate([req])
    assert not isinstance(before, Exception) and not isinstance(after, Exception)
    assert before.sequences[0].tokens == after.sequences[0].tokens
    assert before.prompt_logprobs == after.prompt_logprobs
    with pytest.raises(UnknownPolicyError):
        sampler.validate(SampleRequest(other, prompts[0]))


def test_prompt_logprobs_and_topk(setup) -> None:
    engine, sampler, (a, _), prompts = setup
    prompt = prompts[0]
    [res] = sampler.generate(
        [SampleRequest(a, prompt, SamplingParams(max_tokens=1), prompt_logprobs=True, topk_prompt_logprobs=3)]
    )
    assert not isinstance(res, Exception)
    assert res.prompt_logprobs is not None and res.topk_prompt_logprobs is not None
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(prompt)
    ref = _forward_logprobs(engine, a, prompt)
    got = torch.tensor([x for x in res.prompt_logprobs[1:] if x is not None])
    assert_logprobs_close(got, ref)
    computed = sampler.compute_logprobs(a, prompt)
    assert computed[0] is None
    assert_logprobs_close(computed[1:], res.prompt_logprobs[1:])
    for pos in range(1, len(prompt)):
        top = res.topk_prompt_logprobs[pos]
        assert top is not None and len(top) == 3
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        actual = res.prompt_logprobs[pos]
        assert actual is not None and actual <= values[0] + 1e-6


def _forward_logits(engine: Engine, policy: str | None, tokens: list[int]) -> torch.Tensor:
    """fp32 logits [T, V] of one plain HF forward of ``tokens`` routed through ``policy``."""
    with torch.no_grad(), engine.routing([policy]):
        return engine.base.model(input_ids=torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_topk_sample_logprobs_match_a_forward_pass(setup, temperature: float) -> None:
    """At each sampled position, the k most likely (token, logprob) under softmax(logits / T)
    (T = 1 when greedy, the sampled logprobs' distribution), from a forward pass of prompt +
    completion: same tokens, logprobs within tolerance; the sampled token's own logprob is its
    entry there when it is among them. Requests that do not ask get None."""
    engine, sampler, (a, b), prompts = setup
    params = SamplingParams(max_tokens=10, temperature=temperature, seed=4, top_k=-1, stop=[])
    k = 5
    reqs = [
        SampleRequest(a, prompts[0], params, num_samples=2, topk_sample_logprobs=k),
        SampleRequest(b, prompts[1], params),
    ]
    res, plain = sampler.generate(reqs)
    assert not isinstance(res, Exception) and not isinstance(plain, Exception)
    assert plain.sequences[0].topk_logprobs is None
    for seq in res.sequences:
        assert seq.topk_logprobs is not None and len(seq.topk_logprobs) == len(seq.tokens)
        full = prompts[0] + seq.tokens
        logits = _forward_logits(engine, a, full)[len(prompts[0]) - 1 : -1]  # [n, V]
        t = temperature if temperature > 0 else 1.0
        ref = torch.log_softmax(logits / t, -1)
        ref_v = torch.topk(ref, k).values
        for pos, top in enumerate(seq.topk_logprobs):
            toks, lps = [tok for tok, _ in top], [lp for _, lp in top]
            # each token's logprob is the forward's, and they are its k most likely, in order, up to
            # near ties (two logprobs within the tolerance may swap on another CPU's rounding)
            assert len(set(toks)) == k and lps == sorted(lps, reverse=True)
            assert_logprobs_close(lps, ref[pos, toks].tolist())
            assert float(ref[pos, toks].min()) >= float(ref_v[pos, -1]) - LOGPROB_ATOL
            own = dict(top).get(seq.tokens[pos])
            if own is not None:
                assert abs(own - seq.logprobs[pos]) <= 1e-5
        if temperature == 0:  # greedy: the sampled token is the most likely one
            assert [top[0][0] for top in seq.topk_logprobs] == seq.tokens


def test_topk_topp_restrict_the_support(setup) -> None:
    engine, sampler, (a, _), prompts = setup
    [greedy] = sampler.generate([SampleRequest(a, prompts[1], SamplingParams(max_tokens=1, temperature=0.0))])
    [k1] = sampler.generate(
        [
            SampleRequest(
                a, prompts[1], SamplingParams(max_tokens=1, temperature=1.0, top_k=1, seed=3), num_samples=4
            )
        ]
    )
    [p_small] = sampler.generate(
        [
            SampleRequest(
                a,
                prompts[1],
                SamplingParams(max_tokens=1, temperature=1.0, top_p=1e-6, seed=4),
                num_samples=4,
            )
        ]
    )
    assert (
        not isinstance(greedy, Exception)
        and not isinstance(k1, Exception)
        and not isinstance(p_small, Exception)
    )
    first = greedy.sequences[0].tokens[0]
    assert all(s.tokens[0] == first for s in k1.sequences)
    assert all(s.tokens[0] == first for s in p_small.sequences)


@pytest.mark.parametrize(
    "req_kwargs, message",
    [
        (dict(prompt=[]), "empty"),
        (dict(params=SamplingParams(max_tokens=0)), "max_tokens"),
        (dict(params=SamplingParams(max_tokens=-2)), "max_tokens"),
        (dict(params=SamplingParams(top_p=0.0)), "top_p"),
        (dict(params=SamplingParams(top_p=1.5)), "top_p"),
        (dict(params=SamplingParams(temperature=-0.1)), "temperature"),
        (dict(params=SamplingParams(temperature=math.nan)), "temperature"),
        (dict(params=SamplingParams(top_k=0)), "top_k"),
        (dict(num_samples=0), "num_samples"),
        (dict(policy="no-such-snapshot@v3"), "unknown"),
        (dict(prompt=[1, 10**7]), "outside the vocabulary"),
        (dict(topk_sample_logprobs=-1), "topk_sample_logprobs"),
    ],
)
def test_bad_sampling_requests_fail_alone(setup, req_kwargs, message: str) -> None:
    engine, sampler, (a, _), prompts = setup
    base = dict(policy=a, prompt=prompts[1], params=GREEDY)
    bad = SampleRequest(**{**base, **req_kwargs})  # type: ignore[arg-type]
    good = SampleRequest(a, prompts[1], GREEDY)
    res_bad, res_good = sampler.generate([bad, good])
    assert isinstance(res_bad, EngineError) and message in str(res_bad)
    [solo] = sampler.generate([good])
    assert not isinstance(res_good, Exception) and not isinstance(solo, Exception)
    assert res_good.sequences[0].tokens == solo.sequences[0].tokens


def test_prompt_longer_than_context_is_refused(setup) -> None:
    engine, sampler, (a, _), _ = setup
    [res] = sampler.generate([SampleRequest(a, [5] * engine.max_context)])
    assert isinstance(res, EngineError) and "context length" in str(res)


def test_retired_snapshot_is_refused_and_base_is_sampleable(setup) -> None:
    engine, sampler, (a, _), prompts = setup
    snap = engine.snapshot(a).snapshot_id
    sampler.retire(snap)
    [res, base] = sampler.generate([SampleRequest(snap, prompts[0]), SampleRequest(None, prompts[0], GREEDY)])
    assert isinstance(res, UnknownPolicyError) and snap in str(res)
    assert not isinstance(base, Exception) and base.sequences[0].tokens


def test_prompts_sharing_a_prefix_prefill_it_once_with_the_same_results(setup) -> None:
    """Prompts of one policy that begin alike (chat template + question template) share one prefill
    of that prefix; tokens and logprobs equal those of the plain left-padded prefill, and the
    sampled logprobs still equal the trainer's (invariant 3)."""
    engine, sampler, (a, _), _ = setup
    tok = engine.base.tokenizer
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"What is {x} + {y}? Answer with just the number."}],
            add_generation_prompt=True,
        )["input_ids"]
        for x, y in [(23, 45), (7, 81), (123, 4)]  # different lengths after the common prefix
    ]
    plain = NativeBackend(engine, share_prefix=False)
    assert common_prompt_prefix([SampleRequest(a, p) for p in prompts]) >= MIN_SHARED_PREFIX
    assert common_prompt_prefix([SampleRequest(a, prompts[0]), SampleRequest(None, prompts[1])]) == 0
    for policy in (a, None):
        for params in (GREEDY, SamplingParams(max_tokens=8, temperature=1.0, seed=3)):
            reqs = [SampleRequest(policy, p, params, num_samples=2) for p in prompts]
            shared, ref = sampler.generate(reqs), plain.generate(reqs)
            for req, s, r in zip(reqs, shared, ref, strict=True):
                assert not isinstance(s, Exception) and not isinstance(r, Exception)
                for ss, rs in zip(s.sequences, r.sequences, strict=True):
                    assert_greedy_equal(ss.tokens, rs.tokens)
                    assert_logprobs_close(ss.logprobs, rs.logprobs)
                    lp = _forward_logprobs(engine, policy, req.prompt + ss.tokens)[len(req.prompt) - 1 :]
                    if params.temperature == 1.0:
                        assert_logprobs_close(lp, ss.logprobs)
