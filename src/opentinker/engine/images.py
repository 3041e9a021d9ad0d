"""Image rows in the engine's fused forward (vision-language base models, ``models/vision.py``).

A datum with images carries them in ``Example.images`` (in token order) and one image placeholder
id per image token in ``tokens_T``. A batch with any image row runs as one right-padded forward
with every row's images concatenated in row order: the model's vision tower embeds them (each
distinct image of the batch once, so an image a request repeats costs one embedding) and they take
the place of the placeholders, and its M-RoPE positions come from the placeholder layout.
The vision tower is frozen, and the placeholder positions are ordinary positions of the datum:
``target_tokens``, ``weights`` and ``advantages`` count them (Tinker's ``ModelInput.length``
counts an image as its ``expected_tokens``; the cookbook gives them target 0 and weight 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from opentinker.engine.types import EngineError, Example, ForwardRequest
from opentinker.models.vision import Vision, check_placeholders


def check_images(req: ForwardRequest, vision: Vision | None) -> None:
    """Each datum's images against its placeholders (``EngineError`` naming the datum)."""
    for i, ex in enumerate(req.examples):
        try:
            check_placeholders(f"datum {i}", ex.tokens_T, ex.images, vision)
        except ValueError as e:
            raise EngineError(str(e)) from None


def has_images(examples: Sequence[Example]) -> bool:
    return any(ex.images for ex in examples)


def image_kwargs(
    model: Any, vision: Vision | None, tokens_BT: torch.Tensor, examples: Sequence[Example]
) -> dict[str, Any]:
    """The HF forward's image arguments for a batch whose row ``b`` is ``examples[b]``: each
    distinct image of the batch embedded once (``Vision.embedded_kwargs``)."""
    if vision is None or not has_images(examples):
        return {}
    return vision.embedded_kwargs(model, tokens_BT, [im for ex in examples for im in ex.images])
