"""Multi-LoRA layers against a plain per-row reference loop, on several model families (on the
test device: ``OPENTINKER_TEST_DEVICE``, tests/conftest.py)."""

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
    Qwen3Config,
    Qwen3ForCausalLM,
)

from opentinker.lora import LoRAConfig, LoRAWeights, MultiLoRA, init_lora_weights
from tests.tolerances import assert_rel_close

SMALL = dict(
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, vocab_size=97
)


def _models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "llama": LlamaForCausalLM(LlamaConfig(hidden_size=32, **SMALL)),
        "qwen2": Qwen2ForCausalLM(Qwen2Config(hidden_size=32, **SMALL)),
        "qwen3": Qwen3ForCausalLM(Qwen3Config(hidden_size=32, head_dim=8, **SMALL)),
        "gpt2": GPT2LMHeadModel(
            GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=97, bos_token_id=0, eos_token_id=0)
        ),
    }


def _randomise(w: LoRAWeights, seed: int) -> LoRAWeights:
    g = torch.Generator().manual_seed(seed)
    for t in w.b.values():
        with torch.no_grad():
            t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    return w


def _reference_delta_model(
    model: torch.nn.Module, ml: MultiLoRA, weights: LoRAWeights | None, x: torch.Tensor
) -> torch.Tensor:
    """Plain reference: one row, one adapter, hooks that add scale * x A^T B^T layer by layer (and,
    with tied embeddings, the unembedding's delta scale * B A to the shared matrix's lookup)."""
    with ml.use(None):
        if weights is None:
            return model(x).logits
        handles = []
        for name, group in ml.groups.items():
            if name not in weights.a:
                continue
            for layer, path in enumerate(group.paths):
                mod = model.get_submodule(path)
                a, b = weights.a[name][layer], weights.b[name][layer]

                def hook(_m, inp, out, a=a, b=b):
                    return out + (inp[0] @ a.T @ b.T) * weights.scale

                handles.append(mod.register_forward_hook(hook))
        if ml.tied is not None and ml.tied in weights.a:  # the shared matrix W + s·B A, as embedding
            a, b = weights.a[ml.tied][0], weights.b[ml.tied][0]

            def embed(_m, inp, out, a=a, b=b):
                return out + (b[inp[0]] @ a) * weights.scale

            handles.append(model.get_input_embeddings().register_forward_hook(embed))
        try:
            return model(x).logits
        finally:
            for h in handles:
                h.remove()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gpt2"])
def test_mixed_rows_match_per_row_reference(family: str, device: torch.device) -> None:
    model = _models()[family].eval().to(device)
    ml = MultiLoRA.attach(model)
    kinds = {g.kind for g in ml.groups.values()}
    assert kinds == {"attn", "mlp", "unembed"}
    shapes = ml.groups
    w1 = _randomise(init_lora_weights(LoRAConfig(rank=4, seed=1), shapes, device=device), 1)
    w2 = _randomise(
        init_lora_weights(LoRAConfig(rank=8, alpha=16, seed=2, train_mlp=False), shapes, device=device), 2
    )
    w3 = _randomise(
        init_lora_weights(
            LoRAConfig(rank=2, seed=3, train_attn=False, train_unembed=False), shapes, device=device
        ),
        3,
    )
    entries = [w1, w2, None, w3]
    rows = torch.tensor([1, 0, 2, 3, 1], device=device)
    x = torch.randint(0, 97, (5, 7)).to(device)
    with torch.no_grad(), ml.use(ml.make_batch(entries, rows)):
        mixed = model(x).logits
    for i, e in enumerate(rows.tolist()):
        ref = _reference_delta_model(model, ml, entries[e], x[i : i + 1])
        assert_rel_close(mixed[i : i + 1], ref)


def test_fresh_adapter_is_identity_and_attach_is_idempotent(device: torch.device) -> None:
    model = _models()["llama"].eval().to(device)
    ml = MultiLoRA.attach(model)
    assert MultiLoRA.attach(model) is ml
    w = init_lora_weights(LoRAConfig(rank=4, seed=0), ml.groups, device=device)
    x = torch.randint(0, 97, (2, 6)).to(device)
    with torch.no_grad():
        base = model(x).logits
        with ml.use(ml.make_batch([w], torch.tensor([0, 0], device=device))):
            out = model(x).logits
    assert torch.equal(base, out)  # B = 0 at init


def test_a_strided_input_is_not_multiplied_by_a_weight_copied_per_row() -> None:
    """HF slices the last positions (``logits_to_keep``) before the unembedding: a strided
    [B, 1, H] input. Torch's CPU matmul would expand the weight to [B, H, V] (a copy per row) and
    run a bmm (with a frozen weight, as the engine's base); the wrapped projection feeds its base
    a contiguous input, so one mm runs."""
    model = _models()["llama"].eval().requires_grad_(False)
    MultiLoRA.attach(model)
    h = torch.randn(4, 6, 32)[:, -1:]
    with torch.no_grad(), torch.profiler.profile() as prof:
        y = model.lm_head(h)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::bmm" not in ops and "aten::expand" not in ops, sorted(ops)
    assert_rel_close(y, h @ model.lm_head.weight.T)  # another kernel: rounding apart (tolerances.py)


def test_seed_reproduces_adapter_and_ranks_are_exact() -> None:
    model = _models()["llama"]
    ml = MultiLoRA.attach(model)
    a = init_lora_weights(LoRAConfig(rank=3, seed=7), ml.groups)
    b = init_lora_weights(LoRAConfig(rank=3, seed=7), ml.groups)
    c = init_lora_weights(LoRAConfig(rank=3, seed=8), ml.groups)
    for g in a.a:
        assert torch.equal(a.a[g], b.a[g])
        assert not torch.equal(a.a[g], c.a[g])
        assert a.a[g].shape[1] == 3 and a.b[g].shape[2] == 3


# Row layouts that take each path of LoRABatch.delta: equal runs (one batched matmul pair over
# runs), a few unequal runs (matmuls per run), many unequal runs (per-row gather), one run.
LAYOUTS = {
    "equal_runs": [0, 0, 1, 1, 3, 3],
    "unequal_runs": [1, 1, 1, 0, 3, 3],
    "many_unequal_runs": [0, 1, 1, 0, 3, 0, 1, 3, 3, 1, 0, 1],
    "one_run": [1, 1, 1],
    "runs_in_entry_order": [0, 0, 1, 1, 2, 2, 3, 3],  # the stacked weights serve without a gather
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_row_layout_matches_the_per_row_reference_with_gradients(
    layout: str, device: torch.device
) -> None:
    """Forward and the gradients into each entry's A and B equal a per-row loop through hooks."""
    model = _models()["llama"].eval().to(device)
    ml = MultiLoRA.attach(model)
    shapes = ml.groups
    configs = [LoRAConfig(rank=4, seed=1), LoRAConfig(rank=8, alpha=16, seed=2, train_mlp=False), None]
    configs.append(LoRAConfig(rank=2, seed=3, train_unembed=False))
    entries: list[LoRAWeights | None] = [
        None if c is None else _randomise(init_lora_weights(c, shapes, device=device), c.seed)
        for c in configs
    ]
    params = [t for e in entries if e is not None for t in [*e.a.values(), *e.b.values()]]
    for t in params:
        t.requires_grad_(True)
    rows = torch.tensor(LAYOUTS[layout], device=device)
    x = torch.randint(0, 97, (len(rows), 5), generator=torch.Generator().manual_seed(0)).to(device)
    probe = torch.randn(len(rows), 5, 97, generator=torch.Generator().manual_seed(1)).to(device)
    plan = ml.make_batch(entries, rows)
    assert plan is not None
    paths = {
        "equal_runs": "run_len",
        "unequal_runs": "split",
        "one_run": "single",
        "runs_in_entry_order": "run_len",
    }
    if layout in paths:
        assert getattr(plan, paths[layout]) is not None
    else:
        assert plan.single is None and plan.run_len is None and plan.split is None
    assert (plan.slots is None) == (layout == "runs_in_entry_order")
    with ml.use(plan):
        mixed = model(x).logits
    grads = torch.autograd.grad((mixed * probe).sum(), params, allow_unused=True)
    refs = [_reference_delta_model(model, ml, entries[e], x[i : i + 1]) for i, e in enumerate(rows.tolist())]
    ref = torch.cat(refs)
    assert_rel_close(mixed, ref)
    ref_grads = torch.autograd.grad((ref * probe).sum(), params, allow_unused=True)
    for g, r in zip(grads, ref_grads, strict=True):
        if r is None:
            assert g is None or not g.any()
        else:
            assert g is not None
            assert_rel_close(g, r)
