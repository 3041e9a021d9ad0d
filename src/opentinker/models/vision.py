"""Images for vision-language base models: decode, check, and turn into the model's pixel patches.

An image reaches the engine as an :class:`Image`: the pixel patches the model's own image
processor made (``pixel_values``, ``grid_thw``), the number of placeholder positions it takes in
the token sequence (``n_tokens``: the patches over ``merge_size``², what Tinker's
``ImageChunk.expected_tokens`` counts) and a digest of its pixels (what the prefix cache keys
images by). In a datum or a prompt an image is ``n_tokens`` copies of the model's image
placeholder id (``<|image_pad|>``), which the model replaces by the vision tower's embeddings.

Bad input is refused with an :class:`ImageError` (a ``ValueError``) naming the problem, never a
path or a library's traceback: bytes that are not an image, a format other than PNG or JPEG, a
format that disagrees with the bytes, a truncated or corrupt file, an image over
:data:`MAX_IMAGE_PIXELS` (``status`` 413, checked from the header before any pixel is decoded,
so a decompression bomb costs nothing), an ``expected_tokens`` that disagrees with the
processor's count, and any image sent to a text-only base model.
"""

from __future__ import annotations

import hashlib
import io
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The largest image taken, in pixels (width x height): 4096 x 4096. Larger is refused with 413,
# from the header alone. The processor then resizes what is taken to its own pixel bounds.
MAX_IMAGE_PIXELS = 4096 * 4096
FORMATS = {"png": "PNG", "jpeg": "JPEG"}
ENCODED_KEPT = 32  # images kept encoded (by their bytes' digest): a server checks, then runs, each  # Tinker's ImageChunk.format -> PIL's format name


class ImageError(ValueError):
    """An image refused: the message names the problem; ``status`` is 400, or 413 for oversize."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, eq=False)
class Image:
    """One image as the model takes it (module docstring)."""

    pixel_values: torch.Tensor  # [patches, channels x temporal x patch x patch]
    grid_thw: torch.Tensor  # int64 [3]: temporal, height, width in patches
    n_tokens: int  # placeholder positions in the token sequence
    digest: str  # sha256 of the pixel patches: equal images, equal digests
    size: tuple[int, int] = (0, 0)  # the decoded image's width and height


def decode_image(data: bytes, fmt: str, *, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """``data`` (a ``fmt`` image, ``png`` or ``jpeg``) as an RGB PIL image; :class:`ImageError` if
    it is not one, is over ``max_pixels``, or is truncated or corrupt."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    if fmt not in FORMATS:
        raise ImageError(f"unsupported image format {fmt!r}: send png or jpeg")
    if not data:
        raise ImageError("the image has no data")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PILImage.DecompressionBombWarning)
            img = PILImage.open(io.BytesIO(data), formats=list(FORMATS.values()))
    except UnidentifiedImageError:
        raise ImageError(f"the image data is not a PNG or JPEG image (format says {fmt})") from None
    except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning):
        raise ImageError(f"the image is over the limit of {max_pixels} pixels", status=413) from None
    except Exception as e:  # any decoder failure is the image's fault
        raise ImageError(f"the {fmt} image cannot be read: {_reason(e)}") from None
    if img.format != FORMATS[fmt]:
        raise ImageError(f"the image data is {img.format}, but its format says {fmt}")
    width, height = img.size
    if width * height > max_pixels:
        raise ImageError(
            f"the image is {width}x{height} = {width * height} pixels, over the limit of {max_pixels}",
            status=413,
        )
    if width < 1 or height < 1:
        raise ImageError(f"the image is {width}x{height}: empty")
    try:
        img.load()
        return img.convert("RGB")
    except Exception as e:  # truncated data, a bad CRC, a broken stream
        raise ImageError(f"the {fmt} image is truncated or corrupt: {_reason(e)}") from None


def _reason(e: BaseException) -> str:
    """A library error's own words, without a path (PIL's messages name none, but be sure)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if "/" not in text else type(e).__name__


class Vision:
    """A VL base model's image side: its image processor and placeholder token ids."""

    def __init__(self, processor: Any, config: Any) -> None:
        self.processor = processor
        self.config = config
        self.image_token_id = int(config.image_token_id)
        self.merge = int(getattr(processor, "merge_size", 1) or 1)
        self.dtype = torch.float32  # the vision tower's (the loader sets it)
        self._kept: OrderedDict[tuple[str, str, int], Image] = OrderedDict()
        self._lock = threading.Lock()
        # the image and video placeholders and the vision start/end markers: never sampled
        names = ("video_token_id", "vision_start_token_id", "vision_end_token_id")
        self.special_ids = {self.image_token_id} | {
            int(i) for i in (getattr(config, n, None) for n in names) if i is not None
        }

    @classmethod
    def load(cls, path: str, config: Any) -> Vision:
        """The image processor saved in model folder ``path``: transformers' auto class, else its
        PIL Qwen-VL processor (the default one needs torchvision)."""
        from transformers import AutoImageProcessor

        if not (Path(path) / "preprocessor_config.json").is_file():
            raise ValueError("the VL model folder has no preprocessor_config.json (its image processor)")
        try:
            processor = AutoImageProcessor.from_pretrained(path)
        except Exception:  # e.g. a torchvision-backed class
            from transformers import Qwen2VLImageProcessorPil

            processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        return cls(processor, config)

    def encode(
        self, data: bytes, fmt: str, expected_tokens: int | None = None, *, max_pixels: int = MAX_IMAGE_PIXELS
    ) -> Image:
        """The :class:`Image` of ``data``; :class:`ImageError` if it is refused (module docstring).
        The last :data:`ENCODED_KEPT` images are kept, by their bytes' digest."""
        key = (hashlib.sha256(data).hexdigest(), fmt, max_pixels)
        with self._lock:
            image = self._kept.get(key)
            if image is not None:
                self._kept.move_to_end(key)
        if image is None:
            image = self._encode(data, fmt, max_pixels)
            with self._lock:
                self._kept[key] = image
                while len(self._kept) > ENCODED_KEPT:
                    self._kept.popitem(last=False)
        if expected_tokens is not None and int(expected_tokens) != image.n_tokens:
            raise ImageError(
                f"expected_tokens={expected_tokens} but this {image.size[0]}x{image.size[1]} image is "
                f"{image.n_tokens} tokens for this model's image processor"
            )
        return image

    def _encode(self, data: bytes, fmt: str, max_pixels: int) -> Image:
        pil = decode_image(data, fmt, max_pixels=max_pixels)
        try:
            out = self.processor(images=[pil], return_tensors="pt")
        except Exception as e:  # the processor's refusal is the image's fault
            raise ImageError(f"the image processor cannot take this image: {_reason(e)}") from None
        pixels = out["pixel_values"].float().contiguous()
        grid = out["image_grid_thw"].reshape(-1).long()
        n = int(grid.prod()) // (self.merge * self.merge)
        digest = hashlib.sha256(pixels.numpy().tobytes() + grid.numpy().tobytes()).hexdigest()
        return Image(pixels, grid, n, digest, (pil.width, pil.height))

    def count_placeholders(self, tokens: list[int] | torch.Tensor) -> int:
        t = torch.as_tensor(tokens)
        return int((t == self.image_token_id).sum())

    def forward_kwargs(self, tokens_BT: torch.Tensor, images: list[Image]) -> dict[str, Any]:
        """The HF forward's image arguments for ``tokens_BT`` whose placeholders take ``images``
        in row-major order: the pixel patches, their grids and the multimodal token types (image
        positions 1, which the M-RoPE positions read). The model embeds every image it is given."""
        if not images:
            return {}
        device = tokens_BT.device
        return {
            "pixel_values": torch.cat([im.pixel_values for im in images]).to(device=device, dtype=self.dtype),
            "image_grid_thw": torch.stack([im.grid_thw for im in images]).to(device),
            "mm_token_type_ids": (tokens_BT == self.image_token_id).int(),
        }

    def embedded_kwargs(self, model: Any, tokens_BT: torch.Tensor, images: list[Image]) -> dict[str, Any]:
        """:meth:`forward_kwargs` with the images already embedded by ``model``'s vision tower, each
        distinct image (by pixel digest) once: the embeddings go in as ``mm_encoder_outputs``, one
        entry per image in order, an image used twice sharing its tensors. The tower is frozen, so
        it runs without autograd. An image's embedding depends on that image alone (the tower
        attends within each image), so this equals embedding every copy."""
        if not images:
            return {}
        first: dict[str, int] = {}
        order = [first.setdefault(im.digest, len(first)) for im in images]
        distinct = list({im.digest: im for im in images}.values())
        device = tokens_BT.device
        pixels = torch.cat([im.pixel_values for im in distinct]).to(device=device, dtype=self.dtype)
        with torch.no_grad():
            out = model.get_image_features(
                pixels, torch.stack([im.grid_thw for im in distinct]).to(device), return_dict=True
            )
        out.pooler_output = tuple(out.pooler_output[j] for j in order)
        if getattr(out, "deepstack_features", None) is not None:  # Qwen3-VL's per-layer features
            out.deepstack_features = [tuple(f[j] for j in order) for f in out.deepstack_features]
        return {
            "mm_encoder_outputs": {"image": out},
            "image_grid_thw": torch.stack([im.grid_thw for im in images]).to(device),
            "mm_token_type_ids": (tokens_BT == self.image_token_id).int(),
        }


def check_placeholders(
    where: str, tokens: torch.Tensor, images: tuple[Image, ...], vision: Vision | None
) -> None:
    """A datum's or prompt's images against its tokens: images only on a VL model, and exactly
    one placeholder position per image token (no placeholder id typed as text)."""
    if not images:
        if vision is not None and vision.count_placeholders(tokens):
            raise ValueError(
                f"{where}: token id {vision.image_token_id} is the image placeholder; send images as ImageChunks"
            )
        return
    if vision is None:
        raise ValueError(f"{where}: this base model is text-only; it takes no images")
    want = sum(im.n_tokens for im in images)
    got = vision.count_placeholders(tokens)
    if got != want:
        raise ValueError(
            f"{where}: {got} image placeholder positions for {len(images)} image(s) of {want} tokens "
            f"(token id {vision.image_token_id} is the image placeholder; send images as ImageChunks)"
        )
