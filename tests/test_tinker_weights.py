"""External weights in hosted Tinker's adapter layout, through the cookbook's unmodified converters.

``save_weights_external`` (embedded client here; ``tests/test_weights_sharing.py`` goes through the
SDK and a server) writes the layout ``tinker_cookbook.weights`` reads
(:mod:`opentinker.engine.tinker_format`). On a dense tied model (the tiny Llama), a dense untied
one (a random qwen2), and MoE models (qwen3_moe, gpt-oss), ``build_hf_model`` merges it into a
model whose logprobs equal the engine's, and ``build_lora_adapter``'s PEFT folder, loaded with
``peft``, does too (not on gpt-oss: see :func:`test_gpt_oss_merges_exactly`). On a tied model the
converters put the unembedding's LoRA on the shared embedding, in both roles, as the engine does;
``build_lora_adapter`` cannot write that case for ``peft``, which is stated.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tinker import types
from tinker_cookbook.exceptions import WeightsAdapterError, WeightsMergeError

from opentinker.client import Runtime, ServiceClient
from opentinker.models.registry import tiny_model_dir
from tests.families import FAMILIES, family_model
from tests.tolerances import assert_logprobs_close

weights = pytest.importorskip("tinker_cookbook.weights")
peft = pytest.importorskip("peft")

TOKENS = [int(t) for t in np.random.default_rng(5).integers(3, 1000, 18)]
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints(TOKENS[:-1]),
    loss_fn_inputs={"target_tokens": TOKENS[1:]},  # type: ignore[dict-item]  # lists: the client converts
)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runtime]:
    rt = Runtime(tmp_path_factory.mktemp("tinker-weights") / "data")
    yield rt
    rt.shutdown()


def _untied_qwen2(folder: Path) -> str:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, vocab_size=len(tok), tie_word_embeddings=False,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def _trained(runtime: Runtime, base: str, *, train_unembed: bool = True) -> Any:
    tc = ServiceClient(runtime=runtime).create_lora_training_client(
        base, rank=4, seed=1, train_unembed=train_unembed
    )
    for _ in range(3):
        tc.forward_backward([DATUM], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    return tc


def _external(runtime: Runtime, tc: Any, name: str = "ext") -> Path:
    """``save_weights_external``'s folder (what ``weights.download`` fetches over HTTP)."""
    path = tc.save_weights_external(name).result().path
    assert path == f"tinker://{tc.model_id}/external_weights/{name}"
    rec = runtime.external.record(tc.model_id, name)
    assert rec is not None and set(rec.files) == {"adapter_model.safetensors", "adapter_config.json"}
    return rec.folder


def _engine_logprobs(tc: Any) -> np.ndarray:
    return tc.forward([DATUM], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def _logprobs(model: Any) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(TOKENS) - 1), torch.tensor(TOKENS[1:])].numpy()


def _merged(base: str, adapter: Path, out: Path) -> Any:
    from transformers import AutoModelForCausalLM

    weights.build_hf_model(base_model=base, adapter_path=str(adapter), output_path=str(out))
    return AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()


def _peft_model(base: str, adapter: Path, out: Path) -> Any:
    from transformers import AutoModelForCausalLM

    weights.build_lora_adapter(base_model=base, adapter_path=str(adapter), output_path=str(out))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return peft.PeftModel.from_pretrained(model, str(out)).eval()


def _both_equal_the_engine(runtime: Runtime, base: str, tmp_path: Path, **kw: Any) -> Path:
    tc = _trained(runtime, base, **kw)
    ext = _external(runtime, tc)
    expected = _engine_logprobs(tc)
    assert_logprobs_close(_logprobs(_merged(base, ext, tmp_path / "merged")), expected)
    assert_logprobs_close(_logprobs(_peft_model(base, ext, tmp_path / "peft")), expected)
    return ext


def test_dense_untied_model_with_its_unembedding(runtime: Runtime, tmp_path: Path) -> None:
    base = _untied_qwen2(tmp_path / "qwen2")
    ext = _both_equal_the_engine(runtime, base, tmp_path)
    keys = load_file(str(ext / "adapter_model.safetensors"))
    assert keys["base_model.model.model.unembed_tokens.lora_B.weight"].shape == (1024, 4)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert not any("lm_head" in k for k in keys)


def test_dense_tied_model_without_its_unembedding(runtime: Runtime, tmp_path: Path) -> None:
    _both_equal_the_engine(runtime, str(tiny_model_dir()), tmp_path, train_unembed=False)


def test_dense_tied_model_with_its_unembedding_merges_to_the_engine(runtime: Runtime, tmp_path: Path) -> None:
    """The cookbook maps ``unembed_tokens`` onto ``embed_tokens`` when the base has no ``lm_head``
    (``_merge_utils.build_name_remaps``): the shared matrix gets the delta in both roles, which
    is what the engine computes on a tied model (docs/DESIGN.md, "Tied embeddings")."""
    base = str(tiny_model_dir())
    tc = _trained(runtime, base)
    ext = _external(runtime, tc)
    merged = _merged(base, ext, tmp_path / "merged")
    assert merged.get_output_embeddings().weight is merged.get_input_embeddings().weight
    assert_logprobs_close(_logprobs(merged), _engine_logprobs(tc))
    lora = load_file(str(ext / "adapter_model.safetensors"))
    a, b = (lora[f"base_model.model.model.unembed_tokens.lora_{x}.weight"] for x in "AB")
    base_embed = load_file(str(tiny_model_dir() / "model.safetensors"))["model.embed_tokens.weight"]
    want = base_embed.float() + (32 / 4) * (b @ a)  # the SDK's lora_alpha 32 over rank 4
    assert torch.allclose(merged.get_input_embeddings().weight.detach(), want, atol=1e-5)
    # cookbook 0.6.1's build_lora_adapter writes it as linear keys on embed_tokens, which peft's
    # embedding layer cannot take: stated, so a cookbook that writes lora_embedding_A/B shows here
    with pytest.warns(UserWarning, match=r"missing adapter keys.*lora_embedding_A"):
        _peft_model(base, ext, tmp_path / "peft")


@pytest.mark.parametrize("family", ["qwen3_moe"])
def test_moe_model_experts_as_tinker_w1_w2_w3(runtime: Runtime, tmp_path: Path, family: str) -> None:
    base = family_model(tmp_path / family, family)
    ext = _both_equal_the_engine(runtime, base, tmp_path)
    keys = load_file(str(ext / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.mlp.experts"
    shapes = {w: (keys[f"{prefix}.{w}.lora_A.weight"].shape, keys[f"{prefix}.{w}.lora_B.weight"].shape) for w in ("w1", "w2", "w3")}  # fmt: skip
    assert shapes == {
        "w1": ((4, 4, 32), (4, 16, 4)),
        "w3": ((4, 4, 32), (4, 16, 4)),
        "w2": ((4, 4, 16), (4, 32, 4)),
    }
    assert not any("gate_up_proj" in k or "down_proj" in k for k in keys)


def test_gpt_oss_merges_exactly(runtime: Runtime, tmp_path: Path) -> None:
    """gpt-oss: interleaved gate/up rows split into w1/w3, attention under Tinker's ``attn``.
    ``build_lora_adapter`` writes per-expert keys (``experts.0.gate_proj``) for vLLM, which
    ``peft`` cannot load on gpt-oss's fused experts (it drops them without a warning)."""
    base = family_model(tmp_path / "gpt_oss", "gpt_oss")
    tc = _trained(runtime, base)
    ext = _external(runtime, tc)
    assert_logprobs_close(_logprobs(_merged(base, ext, tmp_path / "merged")), _engine_logprobs(tc))
    keys = load_file(str(ext / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.attn.q_proj.lora_A.weight" in keys
    assert keys["base_model.model.model.layers.1.mlp.experts.w1.lora_B.weight"].shape == (4, 16, 4)


# where cookbook 0.6.1's converters give no model equal to the server's (docs/SERVER.md), and what
# they do instead; every other family of the matrix must give the server's logprobs through both
NO_MERGE = {  # build_hf_model raises, naming the key it has no place for
    "gpt2": "model.embed_tokens.weight' which does not exist",  # no GPT-2 names (transformer.wte)
    "mixtral": "experts.0.gate_proj.weight' which does not exist",  # no Mixtral profile
}
NO_PEFT = {  # build_lora_adapter's folder, in peft: refused, or its keys dropped with a warning
    "deepseek_v3": "does not support LoRA adapter serving",  # the cookbook refuses, says merge
    # per-expert keys (experts.N.gate_proj) for vLLM, which peft has no conversion for here
    "gpt_oss": "adapter keys",
    "mixtral": "adapter keys",
    "qwen3_5_moe_text": "adapter keys",
    # tied: linear keys on embed_tokens, which peft's embedding layer has as lora_embedding_A/B
    "gemma3_text": "lora_embedding_A",
    "gpt2": "adapter keys",
}


# the dense families tied as their small checkpoints are (Llama 3.2 1B/3B, Qwen3 0.6B-4B), and
# Gemma untied: the same converters, the other way round
TIED = {"llama": True, "qwen3": True, "gemma3_text": False}


@pytest.mark.parametrize(("family", "tied"), [(f, None) for f in sorted(FAMILIES)] + sorted(TIED.items()))
def test_cookbook_converters_on_every_family(
    runtime: Runtime, tmp_path: Path, family: str, tied: bool | None
) -> None:
    """The SDK's default ``LoraConfig`` (attention, MLP and routed experts, unembedding) on a
    random 2-layer model of each family, tied where its config ties by default (gemma3_text,
    gpt2), untied otherwise; then, for :data:`TIED`, the other way round."""
    overrides = {} if tied is None else {"tie_word_embeddings": tied}
    base = family_model(tmp_path / family, family, **overrides)
    tc = _trained(runtime, base)
    ext, want = _external(runtime, tc), _engine_logprobs(tc)
    no_peft = NO_PEFT.get(family) if tied is None else ("lora_embedding_A" if tied else None)
    if family in NO_MERGE:
        with pytest.raises(WeightsMergeError, match=NO_MERGE[family]):
            _merged(base, ext, tmp_path / "merged")
    else:
        assert_logprobs_close(_logprobs(_merged(base, ext, tmp_path / "merged")), want)
    if no_peft is None:
        assert_logprobs_close(_logprobs(_peft_model(base, ext, tmp_path / "peft")), want)
    elif "adapter serving" in no_peft:
        with pytest.raises(WeightsAdapterError, match=no_peft):
            _peft_model(base, ext, tmp_path / "peft")
    else:
        with pytest.warns(UserWarning, match=no_peft):
            _peft_model(base, ext, tmp_path / "peft")
