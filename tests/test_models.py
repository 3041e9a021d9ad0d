"""Model loading: built-in names, local folders of several families, and SmolLM2 from its GGUF (slow)."""

from __future__ import annotations

import pytest
import torch

from opentinker.engine import Engine, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model, resolve_model_path
from opentinker.models.registry import TINY, tiny_model_dir
from tests.conftest import make_examples, other_family_model


def test_tiny_model_is_builtin_with_chat_template(tiny_base) -> None:
    assert resolve_model_path("tiny") == str(tiny_model_dir())
    assert tiny_base.name == TINY
    text = tiny_base.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 34? Answer with just the number."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWhat is 12 + 34?" in text
    assert all(not p.requires_grad for p in tiny_base.model.parameters())


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_local_folder_of_other_families_trains(tmp_path, family: str) -> None:
    base = load_base_model(other_family_model(tmp_path, family))
    assert base.model_type == family
    vocab = base.vocab_size
    engine = Engine(base)
    aid = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    data = make_examples(2, vocab, seed=0)
    first = engine.forward_backward(ForwardRequest(aid, data)).metrics["loss:sum"]
    for _ in range(3):
        from opentinker.engine import AdamParams

        engine.optim_step(aid, AdamParams(learning_rate=5e-2))
        last = engine.forward_backward(ForwardRequest(aid, data)).metrics["loss:sum"]
    assert last < first


@pytest.mark.slow
def test_smollm2_resolves_offline_from_its_gguf() -> None:
    base = load_base_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert base.model_type == "llama" and base.vocab_size == 49152
    ids = base.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    with torch.no_grad():
        out = base.model(input_ids=torch.tensor([ids])).logits
    assert torch.isfinite(out).all()
