"""Multi-LoRA layers against a plain per-row reference loop, on several model families."""

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
    """Plain reference: one row, one adapter, hooks that add scale * x A^T B^T layer by layer."""
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
        try:
            return model(x).logits
        finally:
            for h in handles:
                h.remove()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gpt2"])
def test_mixed_rows_match_per_row_reference(family: str) -> None:
    model = _models()[family].eval()
    ml = MultiLoRA.attach(model)
    kinds = {g.kind for g in ml.groups.values()}
    assert kinds == {"attn", "mlp", "unembed"}
    shapes = ml.group_shapes()
    w1 = _randomise(init_lora_weights(LoRAConfig(rank=4, seed=1), shapes), 1)
    w2 = _randomise(init_lora_weights(LoRAConfig(rank=8, alpha=16, seed=2, train_mlp=False), shapes), 2)
    w3 = _randomise(
        init_lora_weights(LoRAConfig(rank=2, seed=3, train_attn=False, train_unembed=False), shapes), 3
    )
    entries = [w1, w2, None, w3]
    rows = torch.tensor([1, 0, 2, 3, 1])
    x = torch.randint(0, 97, (5, 7))
    with torch.no_grad(), ml.use(ml.make_batch(entries, rows)):
        mixed = model(x).logits
    for i, e in enumerate(rows.tolist()):
        ref = _reference_delta_model(model, ml, entries[e], x[i : i + 1])
        torch.testing.assert_close(mixed[i : i + 1], ref, rtol=1e-5, atol=1e-5)


def test_fresh_adapter_is_identity_and_attach_is_idempotent() -> None:
    model = _models()["llama"].eval()
    ml = MultiLoRA.attach(model)
    assert MultiLoRA.attach(model) is ml
    w = init_lora_weights(LoRAConfig(rank=4, seed=0), ml.group_shapes())
    x = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        base = model(x).logits
        with ml.use(ml.make_batch([w], torch.tensor([0, 0]))):
            out = model(x).logits
    assert torch.equal(base, out)  # B = 0 at init


def test_seed_reproduces_adapter_and_ranks_are_exact() -> None:
    model = _models()["llama"]
    ml = MultiLoRA.attach(model)
    a = init_lora_weights(LoRAConfig(rank=3, seed=7), ml.group_shapes())
    b = init_lora_weights(LoRAConfig(rank=3, seed=7), ml.group_shapes())
    c = init_lora_weights(LoRAConfig(rank=3, seed=8), ml.group_shapes())
    for g in a.a:
        assert torch.equal(a.a[g], b.a[g])
        assert not torch.equal(a.a[g], c.a[g])
        assert a.a[g].shape[1] == 3 and a.b[g].shape[2] == 3
