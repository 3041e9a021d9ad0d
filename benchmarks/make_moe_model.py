"""A random Qwen3-MoE model shaped like a scaled-down Qwen3-30B-A3B, for the MoE benchmarks.

Qwen3-30B-A3B routes each token to 8 of 128 experts (1/16), with expert MLPs 3/8 of the hidden
size wide, GQA 32/4 heads. This keeps those ratios at a size a 2-core CPU runs in seconds:
hidden 256, 4 layers, 32 experts top-2, expert width 96, 8/2 heads of 32, and the tiny model's
tokenizer. Weights are random (``torch.manual_seed(0)``): the benchmarks time compute, not text.
``--shape wide`` (hidden 1024, 64 experts top-4, width 384, 2 layers) keeps the LoRA terms' cost
beside the experts' nearer the real model's (see ``SHAPES``).

    python benchmarks/make_moe_model.py --out /tmp/qwen3-moe-bench
    python benchmarks/p1_mixed_forward.py --model /tmp/qwen3-moe-bench --threads 1     # P1moe, P1moe-peft
    python benchmarks/p2_fused_train.py --model /tmp/qwen3-moe-bench --threads 1       # P2moe
    python benchmarks/p3_sampling.py --model /tmp/qwen3-moe-bench                       # P3moe
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from opentinker.models.registry import tiny_model_dir

SHAPES: dict[str, dict[str, Any]] = {}
SHAPE: dict[str, Any] = dict(
    hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
    intermediate_size=768, moe_intermediate_size=96, num_experts=32, num_experts_per_tok=2,
    max_position_embeddings=4096,
)  # fmt: skip
SHAPES["small"] = SHAPE
# rank 8 on experts 96 wide makes the LoRA terms 8x heavier beside the base than on Qwen3-30B-A3B
# (r·(1/in + 1/out) per projection: 0.07-0.12 here, 0.009-0.014 there); this one is 2x (0.018-0.029)
# and keeps 1/16 of the experts routed and ~4 rows per (expert, adapter) segment at 16 adapters
SHAPES["wide"] = dict(
    hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
    intermediate_size=3072, moe_intermediate_size=384, num_experts=64, num_experts_per_tok=4,
    max_position_embeddings=4096,
)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder to write the model and tokenizer to")
    ap.add_argument(
        "--shape", choices=sorted(SHAPES), default="small", help="small: the default; wide: see SHAPES"
    )
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **SHAPES[args.shape],
    )
    torch.manual_seed(0)
    model: Any = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: qwen3_moe, {n / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
