"""Image prompts in the native sampler (vision-language base models, ``models/vision.py``).

A prompt with images is its tokens (each image ``n_tokens`` placeholder ids) and its images. What
the sampler does differently for it:

* **The vision tower runs once per request**: at its prefill, on the images whose placeholders
  that prefill feeds, each distinct image (by pixel digest) once even where a prompt or the
  prefill's rows repeat it (``Vision.embedded_kwargs``); the model's forward puts the embeddings
  in place of the placeholders. Its ``num_samples`` rows are copies of the prefilled state, and decode steps feed
  text tokens only, so neither a sample nor a step runs the tower again.
* **M-RoPE positions**: the model's own ``get_rope_index`` gives the prompt's 3-D positions once;
  they are passed with the text positions as the 4-row ``position_ids`` the Qwen-VL forwards take
  (text first). After the prompt a row's positions advance by one per token from the prompt's
  last one plus one: the text position plus the row's ``delta`` (``rope_deltas``), kept per row in
  the running batch.
* **The prefix cache is keyed by image content**: it matches :func:`cache_tokens`, the prompt with
  each image's placeholder positions replaced by an id made from that image's pixel digest (a
  negative number, never a vocabulary id). Two prompts differing only in an image never share an
  entry past the image; a hit ending inside an image is not taken.
* No prefix shared across the rows of a prefill (the shared-prefix prefill is text-only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from opentinker.models.vision import Image, Vision


def image_spans(prompt: Sequence[int], images: Sequence[Image], token_id: int) -> list[tuple[int, int]]:
    """Each image's placeholder positions ``[start, end)`` in ``prompt`` (images in order)."""
    where = [i for i, t in enumerate(prompt) if t == token_id]
    spans, k = [], 0
    for im in images:
        spans.append((where[k], where[k + im.n_tokens - 1] + 1))
        k += im.n_tokens
    return spans


def cache_tokens(prompt: list[int], images: Sequence[Image], token_id: int) -> list[int]:
    """``prompt`` as the prefix cache matches it: each image's placeholders its digest's id."""
    if not images:
        return prompt
    out = list(prompt)
    for im, (a, b) in zip(images, image_spans(prompt, images, token_id), strict=True):
        out[a:b] = [-1 - int(im.digest[:15], 16)] * (b - a)
    return out


def inside_image(prompt: list[int], images: Sequence[Image], token_id: int, n: int) -> bool:
    """Does a prefix of ``n`` tokens end inside an image (cutting its placeholders)?"""
    return any(a < n < b for a, b in image_spans(prompt, images, token_id))


def mrope_positions(
    model: Any, vision: Vision, prompt: list[int], images: Sequence[Image]
) -> tuple[torch.Tensor, int]:
    """The prompt's M-RoPE positions ``[3, len(prompt)]`` (the model's own ``get_rope_index``) and
    its delta: the position after the prompt minus its length."""
    ids = torch.tensor([prompt])
    pos, delta = model.model.get_rope_index(
        input_ids=ids,
        mm_token_type_ids=(ids == vision.image_token_id).int(),
        image_grid_thw=torch.stack([im.grid_thw for im in images]),
    )
    return pos[:, 0].long().cpu(), int(delta.reshape(-1)[0])


@dataclass
class VisionRows:
    """A prefill's rows as the VL forward takes them: per row, the images its prefilled part holds
    and that part's M-RoPE positions (None: text positions), and each row's position delta."""

    model: Any
    vision: Vision
    images: list[tuple[Image, ...]]
    pos3: list[torch.Tensor | None]
    deltas: torch.Tensor  # long [B]

    def subset(self, idx: torch.Tensor) -> VisionRows:
        rows = idx.tolist()
        images, pos3 = [self.images[i] for i in rows], [self.pos3[i] for i in rows]
        return VisionRows(self.model, self.vision, images, pos3, self.deltas[idx])

    def kwargs(self, ids: torch.Tensor, pos: torch.Tensor) -> dict[str, Any]:
        """The forward's image arguments and 4-row ``position_ids`` for left-padded ``ids``."""
        three = pos[None].expand(3, -1, -1).clone()
        for b, p in enumerate(self.pos3):
            if p is not None:
                n = int(p.shape[1])
                three[:, b, ids.shape[1] - n :] = p.to(three.device)
        out: dict[str, Any] = {"position_ids": torch.cat([pos[None], three])}
        images = [im for row in self.images for im in row]
        if images:  # each distinct image of the prefill embedded once
            out.update(self.vision.embedded_kwargs(self.model, ids, images))
            del out["mm_token_type_ids"]  # positions given: the model computes none
        return out


def vision_rows(
    model: Any, vision: Vision, prompts: list[list[int]], images: list[tuple[Image, ...]], skip: list[int]
) -> VisionRows:
    """:class:`VisionRows` of prompts whose first ``skip[i]`` tokens are already computed."""
    fed: list[tuple[Image, ...]] = []
    pos3: list[torch.Tensor | None] = []
    deltas: list[int] = []
    for prompt, ims, s in zip(prompts, images, skip, strict=True):
        if not ims:
            fed.append(())
            pos3.append(None)
            deltas.append(0)
            continue
        spans = image_spans(prompt, ims, vision.image_token_id)
        fed.append(tuple(im for im, (a, _) in zip(ims, spans, strict=True) if a >= s))
        p, d = mrope_positions(model, vision, prompt, ims)
        pos3.append(p[:, s:])
        deltas.append(d)
    return VisionRows(model, vision, fed, pos3, torch.tensor(deltas, dtype=torch.long))


def step_positions(pos: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """A decode step's 4-row ``position_ids`` for text positions ``pos`` [B, 1]."""
    three = (pos + deltas.to(pos.device)[:, None])[None].expand(3, -1, -1)
    return torch.cat([pos[None], three])
