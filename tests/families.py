"""Random 2-layer models of transformers' own config classes, saved with the tiny model's tokenizer.

``family_model(folder, family)`` builds one (``AutoConfig.for_model(family, **FAMILIES[family])``),
saves it with ``save_pretrained`` and returns the folder, which ``load_base_model`` takes. Sizes
are small enough that a whole conformance run takes seconds on two cores, but every structural
feature is kept: the MoE families route 4 experts top-2 so a short batch reaches each expert, GLM-4
MoE and DeepSeek V3 have a dense first layer before a MoE layer, gpt-oss has biased experts with its
clamped SwiGLU and sliding-window attention with sinks, and Qwen3.5-MoE mixes a Gated DeltaNet
layer with a full-attention layer. The hybrid families (``HYBRID_FAMILIES``: Qwen3.5 dense,
Qwen3-Next, Nemotron-H) have one recurrent-state layer (Gated DeltaNet, Mamba2) and one
full-attention layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_ATTN: dict[str, Any] = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)

MOE_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(_ATTN, head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                      num_experts_per_tok=2),
    "mixtral": dict(_ATTN, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(_ATTN, intermediate_size=16, num_experts=4, num_experts_per_tok=2),
    "glm4_moe": dict(_ATTN, head_dim=8, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
                     n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                     topk_group=1),
    "deepseek_v3": dict(_ATTN, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16,
                        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    "gpt_oss": dict(_ATTN, head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    "qwen3_5_moe_text": dict(_ATTN, head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                             num_experts=4, num_experts_per_tok=2,
                             layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                             linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8),
}  # fmt: skip

# hybrid families: a recurrent-state layer (Gated DeltaNet, Mamba2) and a full-attention layer
_GDN: dict[str, Any] = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    layer_types=["linear_attention", "full_attention"],
)
HYBRID_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_5_text": dict(_ATTN, **_GDN, head_dim=8, intermediate_size=48),
    "qwen3_next": dict(_ATTN, **_GDN, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
    "nemotron_h": dict(_ATTN, head_dim=8, intermediate_size=48, layers_block_type=["mamba", "attention"],
                       mamba_num_heads=4, mamba_head_dim=8, n_groups=1, ssm_state_size=8, conv_kernel=4,
                       chunk_size=8),
}  # fmt: skip

FAMILIES: dict[str, dict[str, Any]] = {**MOE_FAMILIES, **HYBRID_FAMILIES}


def family_model(folder: Path, family: str, **overrides: Any) -> str:
    """A random 2-layer ``family`` model with the tiny model's tokenizer, saved to ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from opentinker.models.registry import tiny_model_dir

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = AutoConfig.for_model(family, vocab_size=len(tok), **ids, **{**FAMILIES[family], **overrides})
    torch.manual_seed(0)
    model: Any = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


_DENSE: dict[str, Any] = dict(_ATTN, intermediate_size=48)

# dense attention families (gemma3_text with a sliding-window layer before a full one, window 4)
DENSE_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(_DENSE),
    "qwen2": dict(_DENSE),
    "qwen3": dict(_DENSE, head_dim=8),
    "mistral": dict(_DENSE),
    "gemma3_text": dict(
        _DENSE, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    ),
    "phi3": dict(_DENSE),
    "olmo2": dict(_DENSE),
    "granite": dict(_DENSE),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4),
}
FAMILIES.update(DENSE_FAMILIES)
