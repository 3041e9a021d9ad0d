"""The sampler's prefix cache (``sampling/prefix_cache.py``): a prompt that continues a finished
sequence (the next turn of a conversation) starts from its cached keys and values.

Reference: the same conversation through a backend without the cache (``prefix_cache_bytes=0``,
every turn prefilled whole) and through the HF forward: greedy tokens identical, logprobs to
``LOGPROB_ATOL`` (tests/tolerances.py).
"""

from __future__ import annotations

import pytest
import torch

from opentinker.engine import Engine
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams
from opentinker.sampling.prefix_cache import PrefixCache
from opentinker.sampling.types import SampleResult
from tests.conftest import other_family_model
from tests.test_llama_decode import _assert_same, _prompts, policies  # noqa: F401  (fixture)
from tests.tolerances import assert_greedy_equal, assert_logprobs_close


def _results(out: list) -> list[SampleResult]:
    assert all(not isinstance(r, Exception) for r in out)
    return out


def _turn(
    prompts: list[list[int]], pols: list, max_tokens: list[int], samples: int = 1
) -> list[SampleRequest]:
    return [
        SampleRequest(
            p, prompt, SamplingParams(max_tokens=m, temperature=0.0, stop=[2, 7]), num_samples=samples
        )
        for p, prompt, m in zip(pols, prompts, max_tokens, strict=True)
    ]


def _next_prompts(prompts: list[list[int]], res: list[SampleResult], seed: int) -> list[list[int]]:
    """Each conversation's next prompt: itself, the reply, and an environment answer of 1-6 tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, r in zip(prompts, res, strict=True):
        answer = torch.randint(3, 200, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        out.append(p + r.sequences[0].tokens + answer)
    return out


def test_next_turns_reuse_the_conversation(engine: Engine, policies: list[str | None]) -> None:  # noqa: F811
    """Three turns of five conversations (adapters, a snapshot, the base model; prompts and replies
    of different lengths, early stops): with the cache every later prompt is served from the turn
    before it and only its new tokens are prefilled; tokens and logprobs equal a backend without
    the cache and the HF forward (without it, and with it: the HF path caches prefixes too)."""
    cached = NativeBackend(engine)
    plain = NativeBackend(engine, prefix_cache_bytes=0)
    hf = NativeBackend(engine, lean_decode=False, prefix_cache_bytes=0)
    hf_cached = NativeBackend(engine, lean_decode=False)
    pols = [*policies, policies[0]]  # a live adapter twice
    prompts = [p + [5] * 8 for p in _prompts(engine, len(pols), seed=11)]  # >= 8 tokens to reuse
    last_prompts: list[list[int]] = []
    last: list[SampleResult] = []
    for turn in range(3):
        reqs = _turn(prompts, pols, [3 + turn + i for i in range(len(pols))])
        hits, reused = cached.prefix_cache.hits, cached.prefix_cache.reused_tokens
        got = _results(cached.generate(reqs))
        _assert_same(got, _results(plain.generate(reqs)))
        ref_hf = _results(hf.generate(reqs))
        _assert_same(got, ref_hf)
        _assert_same(_results(hf_cached.generate(reqs)), ref_hf)
        if turn:  # every prompt continued a stored sequence: all of it but the reply's last token
            assert cached.prefix_cache.hits - hits == len(reqs)
            assert cached.prefix_cache.reused_tokens - reused == sum(
                len(p) + len(r.sequences[0].tokens) - 1 for p, r in zip(last_prompts, last, strict=True)
            )
        last_prompts, last = prompts, got
        prompts = _next_prompts(prompts, got, seed=turn)
    assert plain.prefix_cache.hits == 0 and len(plain.prefix_cache) == 0
    assert hf_cached.prefix_cache.hits == 2 * len(pols)
    # a turn replaces the one before it: one entry per conversation (the two on one adapter differ)
    assert len(cached.prefix_cache) == len(pols)


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_other_families_reuse_through_the_hf_forward(tmp_path, family: str, device: torch.device) -> None:
    """The HF path (GPT-2's learned positions are off the lean path; Qwen2's biases taken through
    HF's forward here too) caches prefixes in the HF ``DynamicCache``: two later turns of three conversations (two adapters, the base) equal a
    backend without the cache."""
    engine = Engine(load_base_model(other_family_model(tmp_path, family), device=device))
    pols: list[str | None] = [engine.create_adapter(LoRAConfig(rank=4, seed=s)) for s in (0, 1)] + [None]
    for aid in pols[:2]:
        with torch.no_grad():
            for t in engine.adapter_weights(aid).b.values():
                t.normal_(std=0.05)
    cached = NativeBackend(engine, lean_decode=False)
    plain = NativeBackend(engine, lean_decode=False, prefix_cache_bytes=0)
    assert cached._lean() is None
    prompts = [list(range(10 + 3 * i, 25 + 4 * i)) for i in range(3)]
    for turn in range(3):
        reqs = _turn(prompts, pols, [4 + turn, 5, 6])
        got = _results(cached.generate(reqs))
        _assert_same(got, _results(plain.generate(reqs)))
        prompts = _next_prompts(prompts, got, seed=turn)
    assert cached.prefix_cache.hits == 2 * len(pols)


def test_sampled_continuations_and_samples_share_the_cached_prompt(
    engine: Engine,
    policies: list[str | None],  # noqa: F811
) -> None:
    """num_samples > 1 of a continued prompt fan out from one prefill on the cached prefix; seeded
    sampling at temperature 1 gives the same tokens as without the cache."""
    cached, plain = NativeBackend(engine), NativeBackend(engine, prefix_cache_bytes=0)
    a = policies[0]
    prompt = list(range(10, 30))
    first = [SampleRequest(a, prompt, SamplingParams(max_tokens=6, temperature=0.0, stop=[]))]
    out = _results(cached.generate(first))
    plain.generate(first)
    nxt = prompt + out[0].sequences[0].tokens + [40, 41]
    req = [
        SampleRequest(a, nxt, SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[]), num_samples=3)
    ]
    got, ref = _results(cached.generate(req)), _results(plain.generate(req))
    assert cached.prefix_cache.hits == 1
    for gs, rs in zip(got[0].sequences, ref[0].sequences, strict=True):
        assert_greedy_equal(gs.tokens, rs.tokens)
        assert_logprobs_close(gs.logprobs, rs.logprobs)


def test_a_trained_adapter_or_retired_snapshot_does_not_reuse(
    engine: Engine,
    policies: list[str | None],  # noqa: F811
) -> None:
    """Keys and values are reused only under the weights that computed them: after the adapter
    changes its next turn is prefilled whole (and equals a backend without the cache), as is a
    snapshot id reused for other weights; retiring a snapshot drops its entries; prompt logprob
    requests never take the cache."""
    a, _, _, snap, _ = policies
    assert snap is not None
    cached, plain = NativeBackend(engine), NativeBackend(engine, prefix_cache_bytes=0)
    prompts = [list(range(3, 20)), list(range(50, 70))]
    reqs = _turn(prompts, [a, snap], [5, 5])
    out = _results(cached.generate(reqs))
    assert len(cached.prefix_cache) == 2
    with torch.no_grad():  # the adapter trains on (in place: its version counters move)
        for t in engine.adapter_weights(a).b.values():
            t.add_(0.01)
    nxt = _turn(_next_prompts(prompts, out, seed=5), [a, snap], [5, 5])
    got = _results(cached.generate(nxt))
    _assert_same(got, _results(plain.generate(nxt)))
    assert cached.prefix_cache.hits == 1  # the snapshot's turn only
    with_lp = [
        SampleRequest(
            snap, [*nxt[1].prompt, 9], SamplingParams(max_tokens=1, temperature=0.0), prompt_logprobs=True
        )
    ]
    _assert_same(_results(cached.generate(with_lp)), _results(plain.generate(with_lp)))
    assert cached.prefix_cache.hits == 1
    # the id released behind the sampler's back and reused for other weights: nothing reused
    engine.release_snapshot(snap)
    engine.add_snapshot(snap, engine.adapter_weights(a))
    again = _turn(_next_prompts([r.prompt for r in nxt], got, seed=6), [a, snap], [5, 5])
    _assert_same(_results(cached.generate(again)), _results(plain.generate(again)))
    assert cached.prefix_cache.hits == 2  # the live adapter's second turn only
    cached.retire(snap)
    assert all(
        not (isinstance(e.key, tuple) and e.key[0] == snap) for e in cached.prefix_cache._entries.values()
    )


def test_prefix_cache_entries_budget_and_bad_input() -> None:
    """Longest common prefix under the same key (never the whole prompt), a minimum length, a new
    entry replacing those it extends, least recently used out first under the byte budget; bad
    arguments name the problem and change nothing."""
    kv = lambda n: torch.arange(n, dtype=torch.float32).view(1, 1, 1, n, 1).expand(2, 2, 1, n, 1).clone()  # noqa: E731
    c = PrefixCache(max_bytes=3 * kv(20).numel() * 4, min_tokens=4)
    c.put("p", list(range(20)), kv(20))
    assert c.match("q", list(range(25))) is None  # another policy
    assert c.match("p", [0, 1, 2, 99]) is None  # 3 < min_tokens
    hit = c.match("p", [*range(12), 99, 98])
    assert hit is not None and hit.length == 12 and torch.equal(hit.kv[0, 0, 0, :, 0], torch.arange(12.0))
    hit = c.match("p", list(range(20)))
    assert hit is not None and hit.length == 19  # the last prompt token is always prefilled
    c.put("p", list(range(30)), kv(30))  # extends the first: replaces it
    assert len(c) == 1 and c.match("p", list(range(40))).length == 30  # type: ignore[union-attr]
    c.put("p", [7] * 20, kv(20))
    c.put("p", [8] * 20, kv(20))  # over budget: the least recently used (the 30-token one) leaves
    assert len(c) == 2 and c.nbytes <= c.max_bytes and c.match("p", list(range(40))) is None
    with pytest.raises(ValueError, match="KV columns"):
        c.put("p", [1, 2, 3, 4, 5], kv(4))
    assert len(c) == 2
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1)
    c.drop(lambda key: key == "p")
    assert len(c) == 0 and c.nbytes == 0


def test_runtime_passes_its_budget_to_the_sampler(tmp_path) -> None:
    pytest.importorskip("tinker")  # the client layer needs the SDK (a bare device machine lacks it)
    from opentinker.service.runtime import Runtime

    rt = Runtime(tmp_path, prefix_cache_bytes=0)
    try:
        assert rt.base_stack("opentinker/tiny").sampler.prefix_cache.max_bytes == 0
    finally:
        rt.shutdown()
