"""Model loading: built-in names, local folders of several families (gpt-oss with eager attention),
broken configs and unsupported families refused by name, and SmolLM2 from its GGUF (slow)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from opentinker import ServiceClient
from opentinker.engine import Engine, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model, resolve_model_path
from opentinker.models.loader import ModelLoadError
from opentinker.models.registry import TINY, tiny_model_dir
from opentinker.service.runtime import Runtime
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


def _gpt_oss_model(folder: Path) -> str:
    """A random 2-layer gpt-oss (sliding-window and full attention layers, attention sinks, MoE
    MLP) with the tiny model's tokenizer, saved to ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    config = AutoConfig.for_model(
        "gpt_oss", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, vocab_size=len(tok),
        sliding_window=8, max_position_embeddings=131072,  # = its YaRN factor x 4096: no warning
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def test_gpt_oss_loads_with_an_attention_it_supports_and_runs(tmp_path: Path) -> None:
    """transformers has no SDPA path for gpt-oss (its attention sinks): it loads with eager."""
    base = load_base_model(_gpt_oss_model(tmp_path))
    assert base.model_type == "gpt_oss" and base.model.config._attn_implementation == "eager"
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45]])  # longer than the window
    with torch.no_grad():
        logits = base.model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], base.vocab_size) and torch.isfinite(logits).all()
    assert load_base_model(TINY).model.config._attn_implementation == "sdpa"  # the others keep SDPA


def _broken_copy(tmp_path: Path, edit: Callable[[dict[str, Any]], object], raw: str | None = None) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir(), folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(raw if raw is not None else json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("edit", "raw", "says"),
    [
        (lambda c: None, '{"model_type": "llama",', "config.json is not valid JSON"),
        (lambda c: None, "[1, 2]", "config.json must hold a JSON object"),
        (lambda c: c.pop("model_type"), None, "config.json has no 'model_type' field"),
        (lambda c: c.update(model_type=3), None, "field 'model_type' must be a non-empty string"),
        (
            lambda c: c.update(hidden_size="wide"),
            None,
            "config.json: field 'hidden_size' is invalid: expected int, got str",
        ),
        (
            lambda c: c.update(num_hidden_layers=2.5),
            None,
            "config.json: field 'num_hidden_layers' is invalid: expected int, got float",
        ),
    ],
    ids=[
        "invalid-json",
        "not-an-object",
        "no-model-type",
        "model-type-int",
        "hidden-size-str",
        "layers-float",
    ],
)
def test_a_broken_config_names_the_file_and_the_field(
    tmp_path: Path, edit: Callable[[dict[str, Any]], object], raw: str | None, says: str
) -> None:
    folder = _broken_copy(tmp_path, edit, raw)
    with pytest.raises(ModelLoadError) as err:
        load_base_model(str(folder))
    assert says in str(err.value)
    assert str(tmp_path) not in str(err.value)  # never the server's own paths


@pytest.mark.parametrize(
    ("model_type", "says"),
    [
        ("florp", "unsupported model family 'florp'"),
        ("vit", "unsupported model family 'vit': transformers has no causal-LM class"),
    ],
)
def test_an_unsupported_family_is_refused_when_a_client_is_created(
    tmp_path: Path, model_type: str, says: str
) -> None:
    folder = _broken_copy(tmp_path, lambda c: c.update(model_type=model_type))
    with pytest.raises(ModelLoadError, match=says):
        load_base_model(str(folder))
    service = ServiceClient(runtime=Runtime(tmp_path / "data"))
    with pytest.raises(ModelLoadError, match=says) as err:
        service.create_lora_training_client(base_model=str(folder), rank=4)
    assert str(tmp_path) not in str(err.value)
