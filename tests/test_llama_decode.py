"""The lean forward of the sampler (``sampling/lean_model.py``) on the tiny Llama against the HF forward.

Same batches through ``NativeBackend(engine)`` (lean prefill + decode: fused weights, static KV
cache, fused multi-LoRA) and ``NativeBackend(engine, lean_decode=False)`` (the HF module tree with
the engine's LoRA layers): greedy tokens must be identical and sampled logprobs agree to
``LOGPROB_ATOL`` (tests/tolerances.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from opentinker.engine import AdamParams, Engine, ForwardRequest
from opentinker.lora import LoRABatch, LoRAConfig, MultiLoRA
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams
from opentinker.sampling import native as native_mod
from opentinker.sampling.lean_lora import FUSED, LeanLoRA, _plus_lora
from opentinker.sampling.lean_model import _Mlp, lean_model, unsupported_reason
from opentinker.sampling.types import SampleResult
from tests.conftest import make_examples
from tests.tolerances import assert_greedy_equal, assert_logprobs_close, assert_rel_close


def _train(engine: Engine, aid: str, seed: int) -> None:
    for s in range(2):
        engine.forward_backward(ForwardRequest(aid, make_examples(4, engine.vocab_size, seed=seed * 10 + s)))
        engine.optim_step(aid, AdamParams(learning_rate=2e-2))


@pytest.fixture
def policies(engine: Engine) -> list[str | None]:
    """Trained adapters of different ranks and targets, one with large random B, a snapshot, base."""
    a = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    b = engine.create_adapter(LoRAConfig(rank=8, seed=1, train_mlp=False))  # no mlp groups: zero there
    c = engine.create_adapter(LoRAConfig(rank=8, seed=2, train_unembed=False))
    _train(engine, a, 1)
    _train(engine, b, 2)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for t in engine.adapter_weights(c).b.values():
            t.copy_(torch.randn(t.shape, generator=g) * 0.05)
    snap = engine.snapshot(a).snapshot_id
    _train(engine, a, 4)  # the live adapter moves on from its snapshot
    return [a, b, c, snap, None]


def _prompts(engine: Engine, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            3, engine.vocab_size, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]


def _both(engine: Engine, reqs: list[SampleRequest], **kw) -> tuple[list[SampleResult], list[SampleResult]]:
    lean = NativeBackend(engine, **kw)
    hf = NativeBackend(engine, lean_decode=False, **kw)
    assert lean._lean() is not None and hf._lean() is None
    got, ref = lean.generate(reqs), hf.generate(reqs)
    out_l, out_h = [], []
    for g, r in zip(got, ref, strict=True):
        assert not isinstance(g, Exception) and not isinstance(r, Exception)
        out_l.append(g)
        out_h.append(r)
    return out_l, out_h


def _assert_same(got: list[SampleResult], ref: list[SampleResult]) -> None:
    for g, r in zip(got, ref, strict=True):
        assert len(g.sequences) == len(r.sequences)
        for gs, rs in zip(g.sequences, r.sequences, strict=True):
            assert_greedy_equal(gs.tokens, rs.tokens)
            assert gs.stop_reason == rs.stop_reason
            assert_logprobs_close(gs.logprobs, rs.logprobs)
        if r.prompt_logprobs is not None:
            assert g.prompt_logprobs is not None
            assert g.prompt_logprobs[0] is None
            assert_logprobs_close(g.prompt_logprobs[1:], r.prompt_logprobs[1:])
        if r.topk_prompt_logprobs is not None:
            assert g.topk_prompt_logprobs is not None
            for gt, rt in zip(g.topk_prompt_logprobs[1:], r.topk_prompt_logprobs[1:], strict=True):
                assert gt is not None and rt is not None
                assert [t for t, _ in gt] == [t for t, _ in rt]
                assert_logprobs_close([x for _, x in gt], [y for _, y in rt])


def test_lean_equals_hf_on_a_mixed_batch_with_padding_samples_and_early_stops(
    engine: Engine, policies: list[str | None]
) -> None:
    """Five policies (three adapters with non-zero B, a snapshot, the base model), prompts of
    different lengths (left padding), greedy and seeded sampling, num_samples > 1, and rows that
    stop at different steps (stop ids, max_tokens) so rows leave the cache mid-decode."""
    prompts = _prompts(engine, 10, seed=7)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, stop=[])
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=11, stop=[])
    reqs = [
        SampleRequest(p, prompts[i], greedy if i % 2 else sampled, num_samples=1 + i % 3)
        for i, p in enumerate(policies * 2)
    ]
    got, ref = _both(engine, reqs)
    _assert_same(got, ref)
    outs = {tuple(r.sequences[0].tokens) for r in ref[:5]}
    assert len(outs) > 1  # the policies really differ
    # now make rows stop early: at a token each row sampled, and at different max_tokens
    stop_ids = sorted({s.tokens[3] for r in ref for s in r.sequences})[:4]
    reqs2 = [
        SampleRequest(
            r.policy,
            r.prompt,
            SamplingParams(
                max_tokens=4 + i, temperature=r.params.temperature, seed=r.params.seed, stop=stop_ids
            ),
            num_samples=r.num_samples,
        )
        for i, r in enumerate(reqs)
    ]
    got2, ref2 = _both(engine, reqs2)
    _assert_same(got2, ref2)
    lengths = {len(s.tokens) for r in ref2 for s in r.sequences}
    reasons = {s.stop_reason for r in ref2 for s in r.sequences}
    assert len(lengths) > 3 and reasons == {"stop", "length"}


@pytest.mark.parametrize(
    "layout",
    [
        "single",  # every row on one adapter: plain matmuls
        "equal_runs",  # runs of equal length: one slot per run
        "few_unequal_runs",  # <= MAX_SPLIT_RUNS unequal runs: a loop over runs
        "many_unequal_runs",  # more unequal runs: one slot per row
    ],
)
def test_lean_equals_hf_for_every_routing_layout(
    engine: Engine, policies: list[str | None], layout: str
) -> None:
    a, b, c, snap, _ = policies
    prompts = _prompts(engine, 12, seed=8)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=[])
    spec: list[tuple[str | None, int]] = {
        "single": [(c, 3), (c, 1)],
        "equal_runs": [(a, 2), (b, 2), (None, 2), (c, 2)],
        "few_unequal_runs": [(a, 1), (c, 3), (None, 2)],
        "many_unequal_runs": [(p, 1 + i % 2) for i, p in enumerate([a, b, c, snap, None] * 2)],
    }[layout]
    reqs = [SampleRequest(p, prompts[i], params, num_samples=n) for i, (p, n) in enumerate(spec)]
    got, ref = _both(engine, reqs)
    _assert_same(got, ref)


def test_lean_prompt_logprobs_shared_prefix_and_cache_growth(
    engine: Engine, policies: list[str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _, c, _, _ = policies
    prompts = _prompts(engine, 3, seed=9)
    # prompt logprobs and top-k from the lean prefill (all positions' logits)
    reqs = [
        SampleRequest(p, prompts[i], SamplingParams(max_tokens=3, temperature=0.0), True, 3)
        for i, p in enumerate([a, None, c])
    ]
    _assert_same(*_both(engine, reqs))
    # one policy, prompts sharing a prefix: the prefix is prefilled once (B = 1) then fanned out
    head = _prompts(engine, 1, seed=10)[0] * 3
    shared = [head + p for p in prompts]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=2, stop=[])
    reqs = [SampleRequest(c, p, params, num_samples=2) for p in shared]
    assert native_mod.common_prompt_prefix(reqs) >= native_mod.MIN_SHARED_PREFIX
    _assert_same(*_both(engine, reqs))
    # a static cache that starts too small grows (by doubling) mid-decode
    monkeypatch.setattr(native_mod, "LEAN_FIRST_DECODE_COLUMNS", 2)
    reqs = [
        SampleRequest(p, prompts[i], SamplingParams(max_tokens=20, temperature=0.0, stop=[]))
        for i, p in enumerate([a, c])
    ]
    _assert_same(*_both(engine, reqs))


def test_fused_lora_terms_equal_the_per_projection_deltas(engine: Engine, policies: list[str | None]) -> None:
    """``LeanLoRA.apply`` (prefill) and the decode step's terms (``step_terms``: equal output
    blocks when one row per slot) for a fused projection (q|k|v, gate|up, ...) are the
    concatenation of ``LoRABatch.delta`` of its members, in every routing layout, for one token
    and several; groups that no entry of the batch has add nothing."""
    a, b, c, snap, _ = policies
    groups = engine.lora.groups
    layouts = [
        [c] * 4,  # single
        [a, b, c, snap, None],  # runs of one row: one slot per row, no gather
        [a, a, b, b, None, None],  # equal runs
        [a, c, c, c, None],  # a few unequal runs
        [a, a, b, c, c, c, snap, None, a, b, c, snap, None, a],  # many unequal runs: per-row gather
    ]
    g = torch.Generator().manual_seed(0)
    for rows in layouts:
        plan = engine.plan_routing(rows)
        assert isinstance(plan, LoRABatch)
        lora = LeanLoRA(plan, groups, torch.float32)
        n_layers = groups["self_attn.q_proj"].n_layers
        terms = lora.step_terms(n_layers)
        order = ["qkv", "o", "gu", "down"]
        for key, names, t in [(k, n, t) for k, n in FUSED.items() for t in (1, 3)]:  # decode, prefill
            d_in = groups[names[0]].d_in
            d_out = sum(groups[n].d_out for n in names)
            x = torch.randn(len(rows), t, d_in, generator=g).to(engine.device)
            y = torch.randn(len(rows), t, d_out, generator=g).to(engine.device)
            for layer in range(groups[names[0]].n_layers):
                with torch.no_grad():
                    got = lora.apply(y.clone(), x, key, layer) - y
                    parts = []
                    for n in names:
                        d = plan.delta(n, layer, x)
                        parts.append(d if d is not None else x.new_zeros(len(rows), t, groups[n].d_out))
                    want = torch.cat(parts, dim=-1)
                    if t == 1:  # the decode step's term
                        k = 4 * n_layers if key == "lm_head" else 4 * layer + order.index(key)
                        step = _plus_lora(y[:, 0].clone(), x[:, 0], terms, k) - y[:, 0]
                        assert_rel_close(step, want[:, 0])
                assert_rel_close(got, want)


def test_only_supported_models_take_the_lean_path(engine: Engine) -> None:
    model, groups = engine.base.model, engine.lora.groups
    lean = lean_model(model, groups)
    assert lean is not None and lean_model(model, groups) is lean  # built once per model
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp

    def shares(fused: torch.Tensor, *weights: torch.Tensor) -> bool:  # views of the fused rows, in order
        rows = torch.cat([w.detach() for w in weights])
        same = all(w.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr() for w in weights)
        return same and torch.equal(rows, fused)

    assert shares(lean.layers[0].w_qkv, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    dense = lean.layers[0].mlp
    assert isinstance(dense, _Mlp) and shares(
        dense.w_gu, mlp.gate_proj.weight, mlp.up_proj.weight
    )  # one copy
    with torch.no_grad():  # a base weight written in place: the fused weights are rebuilt
        attn.k_proj.weight.mul_(1.0)
    rebuilt = lean_model(model, groups)
    assert rebuilt is not None and rebuilt is not lean and lean_model(model, groups) is rebuilt
    assert shares(rebuilt.layers[0].w_qkv, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    small = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        vocab_size=97,
    )
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=97))
    assert lean_model(gpt2, MultiLoRA(gpt2).groups) is None
    assert "gpt2" in str(unsupported_reason(gpt2, MultiLoRA(gpt2).groups))
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    scaled = LlamaForCausalLM(LlamaConfig(rope_parameters=dynamic, **small))
    reason = unsupported_reason(scaled, MultiLoRA(scaled).groups)
    assert reason is not None and "rope" in reason
    for plain in (LlamaForCausalLM(LlamaConfig(**small)), Qwen2ForCausalLM(Qwen2Config(**small))):
        assert unsupported_reason(plain, MultiLoRA(plain).groups) is None


def test_lean_reuses_stacked_adapters_until_their_weights_change(
    engine: Engine, policies: list[str | None]
) -> None:
    """A backend keeps the last batch's stacked and fused LoRA weights; the same policies with the
    same weights reuse them, and training (in place) or editing an adapter invalidates them."""
    a, _, c, snap, _ = policies
    prompts = _prompts(engine, 4, seed=12)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1, stop=[])
    reqs = [SampleRequest(p, prompts[i], params, num_samples=2) for i, p in enumerate([a, c, None, snap])]
    sampler = NativeBackend(engine)
    first = sampler.generate(reqs)
    plans = list(sampler._lora_cache._plans.values())
    assert len(plans) == 2  # the requests' plan and the fanned-out rows' plan
    again = sampler.generate(reqs)
    assert [p is q for p, q in zip(plans, sampler._lora_cache._plans.values(), strict=True)] == [True, True]
    for f, g in zip(first, again, strict=True):
        assert not isinstance(f, Exception) and not isinstance(g, Exception)
        assert [(s.tokens, s.logprobs) for s in f.sequences] == [(s.tokens, s.logprobs) for s in g.sequences]
    _train(engine, a, 9)  # AdamW updates a's tensors in place
    with torch.no_grad():
        next(iter(engine.adapter_weights(c).b.values())).mul_(3.0)
    got = sampler.generate(reqs)
    assert all(p is not q for p, q in zip(plans, sampler._lora_cache._plans.values(), strict=True))
    ref = NativeBackend(engine, lean_decode=False).generate(reqs)
    assert not isinstance(got[0], Exception) and not isinstance(first[0], Exception)
    assert [s.tokens for s in got[0].sequences] != [s.tokens for s in first[0].sequences]
    _assert_same(
        [r for r in got if not isinstance(r, Exception)], [r for r in ref if not isinstance(r, Exception)]
    )
    sampler.retire(snap)
    assert not sampler._lora_cache._plans
