"""A tick's rows of very different lengths run in separate passes (engine/passes.py), and the results
equal one padded pass: logprobs, losses and every adapter's gradients, with shared prefixes on and
off, on batches shaped like the demo's (one adapter's 2-token replies beside another's 60-token
ones). The sampler's prompt-logprob requests (compute_logprobs) prefill in such buckets too."""

from __future__ import annotations

import pytest
import torch

from opentinker.engine import Engine, ForwardRequest, passes
from opentinker.engine.passes import length_buckets
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams
from opentinker.sampling.decoder import run_to_completion
from tests.test_shared_prefix import check_equal, grouped_examples, perturbed_adapter
from tests.tolerances import assert_logprobs_close


def test_buckets_cut_where_padding_costs_more_than_a_pass() -> None:
    long, short = [[70]] * 8, [[30]] * 8
    assert length_buckets(long + short) == [list(range(8)), list(range(8, 16))]
    # similar lengths: one pass
    assert length_buckets([[60], [64], [58], [70]]) == [[3, 1, 0, 2]]
    # padding, but too few positions to be worth a second pass
    assert len(length_buckets([[40], [4], [3]])) == 1
    # a unit (one shared-prefix group) is never split, and is placed by its longest row
    assert length_buckets([[90, 10, 12, 11], [20] * 4, [21] * 4], pass_cost=10) == [[0], [2, 1]]
    assert length_buckets([[90, 10, 12, 11], [20] * 4, [21] * 4], pass_cost=1) == [[0], [2], [1]]
    assert length_buckets([]) == []


@pytest.mark.parametrize("share", [False, True])
def test_bucketed_passes_equal_one_padded_pass(engine: Engine, monkeypatch, share: bool) -> None:
    vocab = engine.vocab_size
    short, long = perturbed_adapter(engine, 8, 1), perturbed_adapter(engine, 4, 2)
    reqs = [
        ForwardRequest(
            short, grouped_examples(vocab, seed=0, prompts=2, reply=(2, 5)), "importance_sampling"
        ),
        ForwardRequest(long, grouped_examples(vocab, seed=1, prompts=2, reply=(50, 64)), "ppo"),
    ]
    engine.share_prefixes = share
    calls = []
    hook = engine.base.model.register_forward_hook(lambda *_: calls.append(1))
    out, cost = {}, passes.PASS_COST
    try:
        for split in (False, True):  # False: the rows' passes may never split (one padded pass)
            monkeypatch.setattr(passes, "PASS_COST", cost if split else 10**9)
            for aid in (short, long):
                engine._adapters[aid].grads = None
            calls.clear()
            res = engine.forward_backward_many(reqs)
            grads = {
                aid: {k: v.clone() for k, v in (engine.pending_gradients(aid) or {}).items()}
                for aid in (short, long)
            }
            out[split] = (res, grads, len(calls))
    finally:
        hook.remove()
    phases = 2 if share else 1  # shared prefixes: a prefix pass and a suffix pass
    assert out[False][2] == phases and out[True][2] == 2 * phases
    check_equal({False: out[False][:2], True: out[True][:2]})


def test_logprob_requests_prefill_apart_in_length_buckets(engine: Engine) -> None:
    """compute_logprobs requests of very different lengths, admitted with a sampling request: each
    prefills apart (two buckets, and the sampling request on its own), with the results each
    request gets alone."""
    policy = perturbed_adapter(engine, 8, 3)
    sampler = NativeBackend(engine)
    g = torch.Generator().manual_seed(0)
    short, long = (torch.randint(3, engine.vocab_size, (n,), generator=g).tolist() for n in (12, 400))
    reqs = [
        SampleRequest(None, short, SamplingParams(max_tokens=1), prompt_logprobs=True),
        SampleRequest(policy, long, SamplingParams(max_tokens=1), prompt_logprobs=True),
        SampleRequest(None, long[:200], SamplingParams(max_tokens=1), prompt_logprobs=True),
        SampleRequest(policy, short, SamplingParams(max_tokens=6, seed=5)),
    ]
    dec = sampler.decoder()
    parts: list[list[int]] = []
    admit = dec._admit
    dec._admit = lambda items: (parts.append([len(p.req.prompt) for _, p in items]), admit(items))[1]  # type: ignore[method-assign]
    together = run_to_completion(dec, reqs)
    assert sorted(parts) == [[12], [12], [200], [400]]  # the sampling request; three buckets
    for req, got in zip(reqs, together, strict=True):
        [alone] = sampler.generate([req])
        assert not isinstance(got, Exception) and not isinstance(alone, Exception)
        if req.params.seed is not None:
            assert got.sequences[0].tokens == alone.sequences[0].tokens
        else:
            assert got.prompt_logprobs is not None and alone.prompt_logprobs is not None
            assert_logprobs_close(got.prompt_logprobs[1:], alone.prompt_logprobs[1:])
