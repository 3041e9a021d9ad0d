"""Images in the OpenAI chat route's messages, on vision-language base models.

A user message's content may hold image parts, ``{"type": "image_url", "image_url": {"url":
"data:image/png;base64,..."}}``: PNG or JPEG bytes inline in a ``data:`` URL. The server fetches
nothing, so an ``http(s)`` URL is refused (a 400 in OpenAI's shape naming the part), as is any
other URL, media type or bad base64 (:func:`image_part`).

The messages become the prompt as on the Tinker routes: before the chat template renders them,
each image becomes the model's image marker text (``<|vision_start|><|image_pad|><|vision_end|>``,
what Qwen-VL's own templates write for an image), so any template renders it in its place; after
tokenizing, each placeholder id is the image's place, and the prompt goes to the sampler as a
``ModelInput`` with an ``ImageChunk`` there (its ``expected_tokens`` the image processor's
count): the ``ModelInput`` the Tinker ``sample`` route takes for the same image. A bad image is a
400 naming the part; so is an image on a text-only model, and a placeholder typed as text.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from tinker import types

from opentinker.server.openai_schemas import OpenAIError

_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg);base64,(.*)", re.DOTALL)


def image_part(part: dict[str, Any]) -> dict[str, Any]:
    """An ``image_url`` content part (as ``check_messages`` keeps it, with its ``where``) as
    ``{"type": "image", "data", "format", "where"}``."""
    where = part["where"]
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    param = f"{where}.image_url.url"
    if not isinstance(url, str):
        raise OpenAIError(f"{param} must be a string (a data: URL)", param=param)
    if url.startswith(("http://", "https://")):
        raise OpenAIError(
            f"{param} is an http(s) URL: this server fetches nothing; send the image inline as a data: "
            "URL (data:image/png;base64,... or data:image/jpeg;base64,...)",
            param=param,
        )
    m = _DATA_URL.fullmatch(url.strip())
    if m is None:
        raise OpenAIError(
            f"{param} must be a data:image/png;base64,... or data:image/jpeg;base64,... URL "
            f"(got one starting {url[:24]!r})",
            param=param,
        )
    try:
        data = base64.b64decode(m.group(2), validate=True)
    except (binascii.Error, ValueError):
        raise OpenAIError(f"{param}: the base64 image data is malformed", param=param) from None
    fmt = "jpeg" if m.group(1) == "jpg" else m.group(1)
    return {"type": "image", "data": data, "format": fmt, "where": where}


def inline_images(
    messages: list[dict[str, Any]], tok: Any, vision: Any, base_model: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``messages`` with each content given as parts joined into text, an image as the model's
    image marker; and the images, in order."""
    images: list[dict[str, Any]] = []
    out = []
    for msg in messages:
        content = msg.get("content")
        if not isinstance(content, list):
            out.append(msg)
            continue
        text = []
        for part in content:
            if part["type"] == "text":
                text.append(part["text"])
                continue
            part = image_part(part)
            if vision is None:
                raise OpenAIError(
                    f"{part['where']} is an image, but {base_model!r} is a text-only model; it takes no images",
                    param=part["where"],
                )
            ids = [
                int(vision.config.vision_start_token_id),
                vision.image_token_id,
                int(vision.config.vision_end_token_id),
            ]
            text.append("".join(tok.convert_ids_to_tokens(ids)))
            images.append(part)
        out.append({**msg, "content": "".join(text)})
    return out, images


def image_prompt(
    tokens: list[int], images: list[dict[str, Any]], vision: Any
) -> tuple[list[int], types.ModelInput]:
    """The rendered ``tokens`` (one placeholder id per image) as the model takes them (each image
    its processor's count of placeholder ids) and as the ``ModelInput`` the sampler takes."""
    if vision is None or not images:
        return tokens, types.ModelInput.from_ints(tokens)
    at = [i for i, t in enumerate(tokens) if t == vision.image_token_id]
    if len(at) != len(images):
        raise OpenAIError(
            f"the rendered prompt has {len(at)} image placeholders for {len(images)} image(s): the text "
            "holds the image placeholder token, or the chat template dropped an image",
            param="messages",
        )
    chunks: list[Any] = []
    model: list[int] = []
    last = 0
    for i, part in zip(at, images, strict=True):
        try:
            n = vision.encode(part["data"], part["format"]).n_tokens
        except ValueError as e:  # the model's image refusal (models/vision.py ImageError), naming the problem
            status = getattr(e, "status", 400)
            raise OpenAIError(f"{part['where']}: {e}", param=part["where"], status=status) from None
        if i > last:
            chunks.append(types.EncodedTextChunk(tokens=tokens[last:i]))
        chunks.append(types.ImageChunk(data=part["data"], format=part["format"], expected_tokens=n))
        model += [*tokens[last:i], *[vision.image_token_id] * n]
        last = i + 1
    if last < len(tokens):
        chunks.append(types.EncodedTextChunk(tokens=tokens[last:]))
    return model + tokens[last:], types.ModelInput(chunks=chunks)
