"""A random model of one family at a fixed shape, for the sampler benchmarks (random weights: they time
compute, not text).

Two shapes: ``smollm2`` is SmolLM2-135M's (hidden 576, 30 layers, 9/3 heads of 64, MLP 1536, its
49152-token vocabulary and tokenizer, tied embeddings); ``small`` is hidden 256, 4 layers, 8/2
heads of 32, MLP 768 with the tiny model's tokenizer (what ``p_lean_families.py`` runs every
family at). Each family keeps its own defaults otherwise (its norms, biases, windows). Qwen3.5
(``qwen3_5_text``) has its real layer pattern, three Gated DeltaNet layers to one full-attention
layer, with 4 key / 8 value heads of 64 in its linear-attention layers.

    python benchmarks/make_family_model.py --family qwen3 --shape smollm2 --out /tmp/qwen3-smollm2
    python benchmarks/p3_sampling.py --model /tmp/qwen3-smollm2 --new-tokens 16 --repeats 3
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from opentinker.models import resolve_model_path
from opentinker.models.registry import tiny_model_dir

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        intermediate_size=1536, max_position_embeddings=8192, tie_word_embeddings=True,
    ),
    "small": dict(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
        intermediate_size=768, max_position_embeddings=4096,
    ),
}  # fmt: skip
# per family: the shape's keys in its config's names, and what its real layout needs
EXTRA: dict[str, dict[str, Any]] = {
    "qwen3_5_text": dict(
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64
    ),
}


def _config_kwargs(family: str, shape: dict[str, Any]) -> dict[str, Any]:
    if family == "gpt2":
        return dict(n_embd=shape["hidden_size"], n_layer=shape["num_hidden_layers"], n_head=8,
                    n_positions=shape["max_position_embeddings"])  # fmt: skip
    return {**shape, **EXTRA.get(family, {})}


def build(family: str, shape: str, out: str) -> str:
    """Write a random ``family`` model of ``shape`` with its tokenizer to ``out``; returns ``out``."""
    tok_dir = resolve_model_path("smollm2") if shape == "smollm2" else str(tiny_model_dir())
    tok = AutoTokenizer.from_pretrained(tok_dir)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = AutoConfig.for_model(family, vocab_size=len(tok), **ids, **_config_kwargs(family, SHAPES[shape]))
    torch.manual_seed(0)
    model: Any = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", required=True, help="a transformers model_type (qwen3, qwen3_5_text, ...)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--out", required=True, help="folder to write the model and tokenizer to")
    args = ap.parse_args()
    build(args.family, args.shape, args.out)
    print(f"wrote {args.out}: {args.family}, shape {args.shape}")


if __name__ == "__main__":
    main()
