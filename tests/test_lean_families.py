"""The lean forward (``sampling/lean_model.py``) on every family it covers, against HF's forward and
HF's ``generate``; the families it does not cover fall back to HF's forward, saying why.

Random 2-layer models of transformers' own config classes (tests/families.py) whose norm weights
and biases are made random too (HF initialises them to ones and zeros, which would hide a
missing ``q|k|v`` bias, q/k norm or Gemma sandwich norm), with sliding windows shorter than the
sequences sampled (Mistral, Qwen2's windowed layers, Gemma 3's local layer), so that a wrong
window changes the result, and the MoE families (Qwen3-MoE, also with a dense MLP first layer
before a MoE one; Mixtral) with every adapter training every routed expert, so a row on the wrong
adapter's expert pairs changes the result:

* a batch mixing three adapters and the base model, prompts of different lengths (left padding),
  greedy and seeded rows, ``num_samples`` > 1: lean = ``NativeBackend(lean_decode=False)`` (the
  HF module tree with the engine's LoRA layers), greedy tokens identical, logprobs within
  ``LOGPROB_ATOL``;
* continuous batching: requests admitted into a running lean batch mid-decode, rows leaving as
  they stop, get what the HF path gives them in one batch;
* the base model's greedy tokens and logprobs = HF ``generate`` on the same model, row by row;
* on a bf16 base (Qwen3, Gemma 3, Qwen3-MoE), sampled logprobs = the trainer's within the bf16 bounds.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from opentinker.engine import Engine
from opentinker.lora import LoRAConfig
from opentinker.models import BaseModel, load_base_model
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams
from opentinker.sampling.lean_model import FAMILIES
from opentinker.sampling.types import SampleResult
from tests.families import family_model
from tests.test_dtype import _agreement
from tests.tolerances import (
    BF16_LOGPROB_ATOL,
    BF16_LOGPROB_MEAN,
    assert_greedy_equal,
    assert_logprobs_close,
    assert_mean_abs_close,
)

# (family, config overrides): every family the lean path covers, with windows that bite
LEAN_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen2_windowed": ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", dict(sliding_window=6)),
    "gemma3_text": ("gemma3_text", {}),  # window 4 on its first (local) layer
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_dense_first": ("qwen3_moe", dict(mlp_only_layers=[0])),  # a dense MLP layer, then MoE
    "mixtral": ("mixtral", dict(sliding_window=6)),
}
FALLBACK_FAMILIES = ["phi3", "olmo2", "granite", "gpt2", "olmoe"]  # OLMoE: q/k norms over all heads at once
MAX_TOKENS = 14


def _randomised(folder: Path, family: str, overrides: dict[str, Any]) -> BaseModel:
    base = load_base_model(family_model(folder, family, **overrides))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in base.model.parameters():
            if p.dim() == 1:  # norm weights and biases
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return base


@pytest.fixture(scope="module", params=sorted(LEAN_CASES))
def lean_base(request: Any, tmp_path_factory: pytest.TempPathFactory) -> BaseModel:
    family, overrides = LEAN_CASES[request.param]
    return _randomised(tmp_path_factory.mktemp(request.param), family, overrides)


@pytest.fixture
def engine_and_policies(lean_base: BaseModel) -> tuple[Engine, list[str | None]]:
    engine = Engine(lean_base, max_rank=16)
    ids = [engine.create_adapter(LoRAConfig(rank=r, seed=i)) for i, r in enumerate([4, 8, 4])]
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for aid in ids:  # non-zero B: every adapter changes the function
            for t in engine.adapter_weights(aid).b.values():
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    return engine, [*ids, None]


def _ok(res: object) -> SampleResult:
    assert isinstance(res, SampleResult), res
    return res


def _prompts(engine: Engine, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, engine.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _assert_same(got: list[SampleResult], ref: list[SampleResult]) -> None:
    for g, r in zip(got, ref, strict=True):
        assert len(g.sequences) == len(r.sequences)
        for gs, rs in zip(g.sequences, r.sequences, strict=True):
            assert_greedy_equal(gs.tokens, rs.tokens)
            assert_logprobs_close(gs.logprobs, rs.logprobs)


def _requests(engine: Engine, policies: list[str | None], seed: int) -> list[SampleRequest]:
    prompts = _prompts(engine, [3, 11, 7, 2, 9, 5, 12, 4], seed)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[])
    sampled = SamplingParams(max_tokens=MAX_TOKENS - 3, temperature=1.0, seed=seed, stop=[])
    return [
        SampleRequest(p, prompts[i], greedy if i % 2 else sampled, num_samples=1 + i % 2)
        for i, p in enumerate(policies * 2)
    ]


def test_lean_equals_hf_forward_on_a_mixed_batch(
    engine_and_policies: tuple[Engine, list[str | None]],
) -> None:
    engine, policies = engine_and_policies
    lean, hf = NativeBackend(engine, prefix_cache_bytes=0), NativeBackend(engine, lean_decode=False)
    assert lean.lean_reason is None and lean._lean() is not None and hf._lean() is None
    reqs = _requests(engine, policies, seed=3)
    got, ref = [_ok(r) for r in lean.generate(reqs)], [_ok(r) for r in hf.generate(reqs)]
    _assert_same(got, ref)
    assert len({tuple(r.sequences[0].tokens) for r in ref[:4]}) > 1  # the policies really differ


def test_lean_continuous_batching_equals_hf_in_one_batch(
    engine_and_policies: tuple[Engine, list[str | None]],
) -> None:
    """Requests join a running lean batch at different steps while others leave (different
    ``max_tokens``); each gets what the HF path gives it."""
    engine, policies = engine_and_policies
    reqs = _requests(engine, policies, seed=4)
    reqs = [  # rows stop at different steps
        replace(r, params=replace(r.params, max_tokens=4 + (2 * i) % 9)) for i, r in enumerate(reqs)
    ]
    ref = [_ok(r) for r in NativeBackend(engine, lean_decode=False).generate(reqs)]
    dec = NativeBackend(engine, prefix_cache_bytes=0).decoder()
    done = dec.admit([(i, dec.pin(reqs[i])) for i in range(3)])
    waves = [[3, 4], [5], [6, 7]]
    while dec.live_rows or waves:
        done += dec.step()
        if waves and dec.steps % 2 == 0:
            wave = waves.pop(0)
            done += dec.admit([(i, dec.pin(reqs[i])) for i in wave])
    got = dict(done)
    _assert_same([_ok(got[i]) for i in range(len(reqs))], ref)


def test_lean_base_rows_equal_hf_generate(engine_and_policies: tuple[Engine, list[str | None]]) -> None:
    """The base model's greedy rows, padded in one lean batch, against HF ``generate`` on each
    prompt alone (the engine's model with no adapter routed: HF's own forward and cache)."""
    engine, _ = engine_and_policies
    prompts = _prompts(engine, [5, 12, 3], seed=5)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[])
    res = NativeBackend(engine, prefix_cache_bytes=0).generate(
        [SampleRequest(None, p, params) for p in prompts]
    )
    model = engine.base.model
    for prompt, r in zip(prompts, res, strict=True):
        x = torch.tensor([prompt], device=engine.device)
        with torch.no_grad():
            out = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                output_logits=True,  # raw: min_new_tokens masks EOS in the processed scores
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = [s[0].float().log_softmax(-1)[t].item() for s, t in zip(out.logits, tokens, strict=True)]
        assert_greedy_equal(_ok(r).sequences[0].tokens, tokens)
        assert_logprobs_close(_ok(r).sequences[0].logprobs, logprobs)


@pytest.mark.parametrize("family", FALLBACK_FAMILIES)
def test_other_families_fall_back_to_hf_saying_why(
    family: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Engine(load_base_model(family_model(tmp_path, family)))
    aid = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    with caplog.at_level(logging.INFO, logger="opentinker.sampling.native"):
        sampler = NativeBackend(engine)
    assert family not in FAMILIES and sampler._lean() is None
    assert sampler.lean_reason is not None and family in sampler.lean_reason
    assert any(family in rec.getMessage() and "HF forward" in rec.getMessage() for rec in caplog.records)
    reqs = [
        SampleRequest(p, [5, 9, 14, 3], SamplingParams(max_tokens=6, temperature=0.0)) for p in (aid, None)
    ]
    got = [_ok(r) for r in sampler.generate(reqs)]  # the HF path: it samples
    assert all(len(r.sequences[0].tokens) == 6 for r in got)


def test_a_covered_family_with_an_unsupported_part_falls_back(tmp_path: Path) -> None:
    """Llama with a RoPE whose table depends on the sequence length (dynamic scaling): refused by
    name, sampled through HF's forward."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    base = load_base_model(family_model(tmp_path, "llama", rope_parameters=rope))
    sampler = NativeBackend(Engine(base))
    assert sampler._lean() is None and sampler.lean_reason is not None and "rope" in sampler.lean_reason
    res = sampler.generate([SampleRequest(None, [5, 9, 14], SamplingParams(max_tokens=4, temperature=0.0))])
    assert len(_ok(res[0]).sequences[0].tokens) == 4


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "qwen3_moe"])
def test_lean_on_a_bf16_base_matches_the_trainer(family: str, tmp_path: Path) -> None:
    """bf16 base weights: the lean path's q/k norms, Gemma's fp32-scaled norms and the router in bf16; its
    sampled logprobs against the trainer's within the bf16 bounds (tests/tolerances.py)."""
    base = load_base_model(family_model(tmp_path, family), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in base.model.parameters():
            if p.dim() == 1:
                p.add_((torch.randn(p.shape, generator=g) * 0.3).to(p.dtype))
    engine = Engine(base, max_rank=8)
    aid = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    with torch.no_grad():
        for t in engine.adapter_weights(aid).b.values():
            t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    sampler = NativeBackend(engine)
    assert sampler.lean_reason is None
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=0, stop=[])
    prompts = _prompts(engine, [4, 9], seed=6)
    reqs = [SampleRequest(p, prompts[i % 2], params, num_samples=2) for i, p in enumerate([aid, None])]
    d = _agreement(engine, sampler, reqs)
    assert_logprobs_close(d, torch.zeros_like(d), atol=BF16_LOGPROB_ATOL)
    assert_mean_abs_close(d, BF16_LOGPROB_MEAN)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "hf"])
def test_prefix_cache_reuse_beside_a_longer_prompt_equals_a_fresh_prefill(
    engine_and_policies: tuple[Engine, list[str | None]], lean: bool
) -> None:
    """A conversation's next turn starts from its cached keys and values, in a batch beside a longer
    new prompt, so its few new tokens would be left-padded after the cached prefix: the lean path
    counts a window in positions, the HF path (whose mask counts columns) prefills such rows in
    groups of one length. Either way equal to prefilling it whole."""
    engine, policies = engine_and_policies
    a = policies[0]
    cached = NativeBackend(engine, lean_decode=lean)
    fresh = NativeBackend(engine, lean_decode=lean, prefix_cache_bytes=0)
    first, other = _prompts(engine, [6, 13], seed=7)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    turn1 = _ok(cached.generate([SampleRequest(a, first, greedy)])[0]).sequences[0].tokens
    reqs = [SampleRequest(a, first + turn1 + [21, 22], greedy), SampleRequest(policies[1], other, greedy)]
    got = [_ok(r) for r in cached.generate(reqs)]
    assert got[0].prompt_cache_hit_tokens > 0 and (cached._lean() is not None) == lean
    _assert_same(got, [_ok(r) for r in fresh.generate(reqs)])
