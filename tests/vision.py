"""Random 2-layer vision-language models of transformers' own config classes, for the vision tests.

``vl_model(folder, family)`` builds one of ``VL_FAMILIES`` (Qwen2.5-VL, Qwen3-VL, Qwen3.5 with its
vision tower): a 2-layer language model of hidden size 32 and a depth-2 vision tower of hidden
size 32, saved with the tiny model's tokenizer (four special tokens added: ``<|vision_start|>``,
``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``, whose ids the config names, then
``<think>`` and ``</think>`` as single tokens) and a
``preprocessor_config.json`` of transformers' PIL image processor (``Qwen2VLImageProcessorPil``,
which Qwen2.5-VL, Qwen3-VL and Qwen3.5 share), with small pixel bounds so that a 64x64 image is a
few tokens. ``png(...)`` / ``jpeg(...)`` make small test images; ``TowerCalls`` counts what the
real vision tower embeds.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
THINK = [
    "<think>",
    "</think>",
]  # single tokens, as in Qwen3.5's tokenizer (the cookbook's qwen3_5 renderer needs them)

_TEXT: dict[str, Any] = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
    head_dim=8,
)  # fmt: skip
_VISION: dict[str, Any] = dict(
    depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=32, patch_size=16,
    spatial_merge_size=2, temporal_patch_size=2,
)  # fmt: skip
_GDN: dict[str, Any] = dict(
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    layer_types=["linear_attention", "full_attention"],
)  # fmt: skip

VL_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": dict(text=dict(_TEXT, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
                       vision=dict(_VISION, patch_size=14, window_size=56, fullatt_block_indexes=[1])),
    "qwen3_vl": dict(text=dict(_TEXT, rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2],
                                                    "mrope_interleaved": True}),
                     vision=dict(_VISION, num_position_embeddings=64, deepstack_visual_indexes=[1])),
    "qwen3_5": dict(text=dict(_TEXT, **_GDN), vision=dict(_VISION, num_position_embeddings=64)),
}  # fmt: skip

# the image processor's bounds: 16x16 (Qwen2.5-VL: 14x14) patches merged 2x2, at most 16x16 of them
PROCESSOR: dict[str, Any] = {"min_pixels": 32 * 32, "max_pixels": 128 * 128}


def vl_model(folder: Path, family: str) -> str:
    """A random 2-layer ``family`` VL model, its tokenizer and image processor, saved to ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

    from opentinker.models.registry import tiny_model_dir

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.add_tokens(THINK)
    start, end, image, video = tok.convert_tokens_to_ids(SPECIAL)
    spec = VL_FAMILIES[family]
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = AutoConfig.for_model(
        family,
        text_config=dict(spec["text"], vocab_size=len(tok), **ids),
        vision_config=spec["vision"],
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        **ids,
    )
    torch.manual_seed(0)
    model: Any = AutoModelForImageTextToText.from_config(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    patch = spec["vision"]["patch_size"]
    Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=2, temporal_patch_size=2,
        min_pixels=PROCESSOR["min_pixels"], max_pixels=PROCESSOR["max_pixels"],
    ).save_pretrained(folder)  # fmt: skip
    return str(folder)


def image(size: tuple[int, int] = (64, 64), seed: int = 0) -> Any:
    """A random RGB PIL image."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def png(size: tuple[int, int] = (64, 64), seed: int = 0) -> bytes:
    buf = io.BytesIO()
    image(size, seed).save(buf, format="PNG")
    return buf.getvalue()


def jpeg(size: tuple[int, int] = (64, 64), seed: int = 0) -> bytes:
    buf = io.BytesIO()
    image(size, seed).save(buf, format="JPEG")
    return buf.getvalue()


class TowerCalls:
    """Images the real vision tower embeds, per call (a forward hook on ``model.model.visual``)."""

    def __init__(self, engine: Any) -> None:
        self.calls: list[int] = []
        visual = engine.base.model.model.visual
        self.handle = visual.register_forward_hook(
            lambda _m, args, kw, _o: self._record(kw, args), with_kwargs=True
        )

    def _record(self, kw: dict[str, Any], args: tuple[Any, ...]) -> None:
        grid = kw.get("grid_thw", args[1] if len(args) > 1 else None)
        self.calls.append(int(grid.shape[0]))

    def __enter__(self) -> TowerCalls:
        return self

    def __exit__(self, *_: Any) -> None:
        self.handle.remove()
